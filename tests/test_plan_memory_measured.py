"""The memory model against what torch really keeps for vpscluster's GPT on this CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vpscluster.plan import memory
from vpscluster.plan.shapes import load_model


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_activation_formula_matches_what_autograd_saves(preset):
    import torch

    from vpscluster.train.model import GPT

    spec = load_model(preset)
    s = spec.shape
    model = GPT(s)
    x = torch.randint(0, s.vocab_size, (s.batch_size, s.seq_len))
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()  # unique storages: views share one
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(n for ptr, n in saved.items() if ptr not in params)
    predicted = memory.activation_bytes(spec, s.batch_size, act_bytes=4, checkpointing=False)
    assert predicted == pytest.approx(measured, rel=0.03)


def test_whole_estimate_covers_the_peak_memory_of_a_real_training_process():
    """A fresh process trains `tiny` for two steps; its peak RSS must fit in the estimate."""
    code = textwrap.dedent("""
        import torch
        from vpscluster.train.model import GPT
        from vpscluster.train.presets import get_preset
        torch.set_num_threads(1)
        s = get_preset("tiny")
        m = GPT(s)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        x = torch.randint(0, s.vocab_size, (s.batch_size, s.seq_len))
        for _ in range(2):
            m(x, x).backward(); opt.step(); opt.zero_grad()
        print([int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    peak = int(out.stdout.strip().splitlines()[-1])
    estimate = memory.estimate(load_model("tiny"), "ddp", 1, mixed_precision=False).total_bytes
    assert peak <= estimate <= 2.5 * peak, (peak, estimate)
