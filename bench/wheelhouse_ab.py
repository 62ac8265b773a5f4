"""`provision`'s wheelhouse built offline, one pip at a time against WORKERS at a time, side by side.

    PYTHONPATH=src .venv/bin/python bench/wheelhouse_ab.py [WORKERS ...]   (default: 1 4 4 1)

Offline (PIP_NO_INDEX=1, as on a machine that reaches no index) the one `pip download` of the
closure fails, so every package is fetched alone (from pip's find-links, torch's CPU wheel) or
re-packed from what is installed here: one pip start-up per package. Each run builds vpscluster's
run-time closure (its dependencies, torch included) into a fresh temporary folder (the user's cached wheelhouse is not
touched) with `env.WORKERS` set to the figure given; prints each run's seconds and wheels, then
the mean seconds per setting.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["PIP_NO_INDEX"] = "1"

from vpscluster.provision import env  # noqa: E402


def one(workers: int) -> tuple[float, int]:
    env.WORKERS = workers
    reqs = env.pinned_requirements("vpscluster")
    reqs.pop("vpscluster", None)  # its closure: vpscluster itself is an editable install here (nothing to re-pack)
    with tempfile.TemporaryDirectory(prefix="vpsc-wh-ab-") as d:
        t = time.monotonic()
        env.build_wheelhouse(reqs, Path(d) / "w")
        return time.monotonic() - t, len(list((Path(d) / "w").glob("*.whl")))


def main(argv: list[str]) -> None:
    order = [int(a) for a in argv] or [1, 4, 4, 1]
    seen: dict[int, list[float]] = {}
    for workers in order:
        seconds, wheels = one(workers)
        seen.setdefault(workers, []).append(seconds)
        print(f"workers {workers}: {seconds:.1f} s, {wheels} wheels", flush=True)
    for workers, runs in seen.items():
        print(f"workers {workers}: mean {statistics.mean(runs):.1f} s over {len(runs)} run(s)")


if __name__ == "__main__":
    main(sys.argv[1:])
