"""A session's exit leaves no gloo thread behind (2 real gloo processes, as `vpscluster run`
starts them): `close` destroys the process groups *and* frees their C++ backends, so gloo's
worker and I/O threads are joined while the interpreter is whole. A backend kept alive past
`close` (by the session's own references to its groups) is freed in the interpreter's
teardown instead, where a gloo worker that takes the GIL aborts the process (SIGABRT,
"terminate called without an active exception": session/dist.py `release_groups`).

- After `close` (diloco with an overlapped sync: the default group and the syncs' own), the
  process has no `pt_gloo_runloop` or `gloo_tcp_loop` thread left, on every rank.
- A script that never calls `close` is shut down at exit by the session's atexit hook: by the
  time the script's own earlier atexit hook runs, the same threads are gone, and it exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import free_port
from test_session import run_ranks, user_loop

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _threads() -> list[str]:
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def _closed(rank, world):
    before = _threads()
    user_loop(rank, world, {"strategy": {"name": "diloco", "sync_every": 4, "overlap_steps": 1}},
              epochs=1, stop_after=12)
    return before, _threads()


def test_close_frees_the_groups_and_joins_gloos_threads():
    for before, after in run_ranks(_closed, 2):
        assert not [t for t in before if t in GLOO_THREADS], before  # none before the session
        assert not [t for t in after if t in GLOO_THREADS], after


SCRIPT = textwrap.dedent('''
    import atexit, os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})

    def threads():  # registered before session.start, so it runs after the session's hook (LIFO)
        names = [Path(f"/proc/self/task/{{t}}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
        print("threads at exit:", ",".join(sorted(names)), flush=True)

    atexit.register(threads)
    import torch
    from test_session import make_data, make_model
    from vpscluster import session

    torch.set_num_threads(1)
    s = session.start(strategy={{"name": "diloco", "sync_every": 4, "overlap_steps": 1}})
    model = s.setup(make_model(seed=s.rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in s.shard(make_data(64), batch_size=8):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        s.step(opt, samples=len(x))
        opt.zero_grad()
    print("loop done, no close", flush=True)
''')


def test_a_script_without_close_is_shut_down_at_exit(tmp_path):
    script = tmp_path / "no_close.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    port = free_port()
    src = str(Path(__file__).resolve().parents[1] / "src")
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append((p.communicate(timeout=120)[0], p.returncode))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out, rc in outs:
        assert rc == 0 and "loop done, no close" in out, out[-3000:]
        line = [x for x in out.splitlines() if x.startswith("threads at exit:")]
        assert line and not [t for t in line[0].split(":", 1)[1].strip().split(",") if t in GLOO_THREADS], out[-3000:]
