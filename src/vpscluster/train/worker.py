"""The per-rank entry point that `torch.distributed.run` starts on every node.

    python -m vpscluster.train.worker --run-dir DIR [--backend auto|gloo|nccl] [--resume]

Reads the resolved configuration from DIR/config.yaml (paths in it are valid on this node),
the rank and rendezvous from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), trains, and exits 0. Each rank's output is also written to
DIR/logs/rank-N.log. Rank 0 prints `VPSC_EVENT {...}` lines on stdout (see events.py) and
writes DIR/metrics.jsonl and DIR/report.json. On failure the error goes to stderr (one line for
a `UserError`, a traceback in the rank's log otherwise), rank 0 emits an `error` event, and the
exit status is non-zero.

A failed rank leaves within `LEAVE_AFTER_FAILURE_S`. Its process groups may still hold a peer
that is gone (a node cut off): destroying them, or the interpreter joining a thread stuck in a
collective, can block far longer than any time-out — the rank then ignores SIGTERM, and every
relaunch waits for the teardown's SIGKILL. So the error is reported first, the shutdown runs
under faulthandler's watchdog (it prints where the shutdown hung and exits), and the process
ends with `os._exit`, skipping the interpreter's joins.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import traceback
from pathlib import Path
from typing import TextIO

from vpscluster.train import diskfull

LEAVE_AFTER_FAILURE_S = 5.0


class _Tee:
    """Writes to the original stream and to the rank's log file. A full disk (the log's, or the
    stream's when it is a file) drops the text there and counts it (`diskfull`): training goes on."""

    def __init__(self, stream: TextIO, log: diskfull.AppendFile) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        try:
            self.stream.write(text)
        except OSError as e:
            if not diskfull.is_disk_full(e):
                raise
            diskfull.DROPPED.add("cannot write the rank's output", e, text.count("\n"))
        self.log.write(text)  # unbuffered; drops and counts what a full disk refuses
        return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            if not diskfull.is_disk_full(e):
                raise
            diskfull.DROPPED.add("cannot write the rank's output", e, 0)  # its lines were counted when written

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vpscluster.train.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory holding config.yaml")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: nccl when CUDA is available, else gloo")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in RUN_DIR/checkpoints")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log = diskfull.AppendFile(run_dir / "logs" / f"rank-{rank}.log")
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)

    from vpscluster.errors import UserError
    from vpscluster.train import events
    from vpscluster.train.rundir import read_config

    ev = events.event_writer(rank)
    trainer = None
    code = 1
    try:
        from vpscluster.train.trainer import Trainer

        trainer = Trainer(read_config(run_dir), run_dir, args.backend)
        trainer.train(args.resume)
        code = 0
    except UserError as e:
        print(f"rank {rank}: error: {e}", file=sys.stderr, flush=True)
        ev.emit("error", rank=rank, message=str(e))
        code = 2
    except Exception as e:  # the traceback goes to this rank's log; the event carries one line
        traceback.print_exc()
        ev.emit("error", rank=rank, message=f"{type(e).__name__}: {e}".splitlines()[0][:500])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if code:  # reported: now a bounded shutdown (see the module's docstring)
            faulthandler.dump_traceback_later(LEAVE_AFTER_FAILURE_S, exit=True, file=sys.__stderr__)
        if trainer is not None:
            trainer.close()
        sys.stdout.flush()
        sys.stderr.flush()
    return code


if __name__ == "__main__":
    code = main()  # its `finally` has flushed both streams and the rank's log
    # Failed: the watchdog is armed, do not wait for threads stuck in a collective. Succeeded:
    # everything is written; skip the static destructors (see the module's docstring).
    os._exit(code)
