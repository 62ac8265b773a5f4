"""The GPT model: exact parameter counts, causality, determinism."""

from __future__ import annotations

import pytest
import torch

from vpscluster.train.model import build_model, count_parameters
from vpscluster.train.presets import PRESETS, ModelShape


@pytest.mark.parametrize("name", [n for n, s in PRESETS.items() if s.trainable])
def test_parameter_count_matches_preset(name):
    shape = PRESETS[name]
    assert count_parameters(build_model(shape, seed=0)) == shape.num_params()


@pytest.mark.parametrize("gated", [False, True])
def test_parameter_count_small_shapes(gated):
    shape = ModelShape(d_model=48, n_layer=3, n_head=4, seq_len=32, d_ff=80, gated_mlp=gated)
    assert count_parameters(build_model(shape, seed=0)) == shape.num_params()


def test_output_is_causal():
    shape = ModelShape(d_model=32, n_layer=2, n_head=2, seq_len=16)
    model = build_model(shape, seed=1).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 7) % 256  # change only the future of position 9
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_same_seed_same_weights_and_rng_untouched():
    shape = ModelShape(d_model=32, n_layer=2, n_head=2, seq_len=16)
    before = torch.random.get_rng_state()
    a, b, c = build_model(shape, 5), build_model(shape, 5), build_model(shape, 6)
    assert torch.equal(torch.random.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_initial_loss_is_about_ln256():
    model = build_model(PRESETS["tiny"], seed=0)
    x = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = model(x, y).item()
    assert abs(loss - 5.545) < 0.05
