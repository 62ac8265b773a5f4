"""`--detach` for the commands that launch a run (`train`, `run`): one way to start the launcher in
the background and to record how it ended (launch/detached.py), so `attach`, `logs` and `stop`
treat every detached run alike."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable


def add_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--detach", action="store_true",
                   help=f"start the {what} in the background and return; follow it with `vpscluster attach RUN_DIR`, "
                        "stop it with `vpscluster stop RUN_DIR`")
    p.add_argument("--detached-child", action="store_true", help=argparse.SUPPRESS)  # the launcher --detach starts


def run_as_child(args: argparse.Namespace, run_dir: str | Path, body: Callable[[], int]) -> int:
    """`body()` as the background launcher of `run_dir`: its end (exit status and message) is
    written to launcher.json, however it ends."""
    from vpscluster.errors import UserError
    from vpscluster.launch import detached

    if not args.detached_child:
        return body()
    try:
        status = body()
    except UserError as e:
        detached.finish(run_dir, e.exit_code, str(e))
        raise
    except BaseException as e:
        detached.finish(run_dir, 1, f"{type(e).__name__}: {e}")
        raise
    detached.finish(run_dir, status, None)
    return status


def start(args: argparse.Namespace, run_dir: Path, out, run_dir_given: bool, program: list[str] = ()) -> int:
    """Start this same command again, in the background, as the run's launcher of `run_dir`.
    `program`: the command line's trailing words that are the launched program's (`run -- ...`)."""
    from vpscluster.cli.output import emit_json
    from vpscluster.errors import UserError
    from vpscluster.launch import detached

    if args.dry_run:
        raise UserError("--detach and --dry-run do not go together; drop one")
    at = len(args._argv) - len(program)
    own = [a for a in args._argv[:at] if a not in ("--detach", "--json")]
    if not run_dir_given:  # the run dir picked here is the one it uses
        own += ["--run-dir", str(run_dir)]
    state = detached.start(run_dir, own + ["--detached-child"] + list(args._argv[at:]))
    doc = {"run_id": Path(run_dir).name, "run_dir": str(run_dir), "pid": state["pid"], "log": state["log"]}
    if args.json:
        emit_json(doc)
    else:
        out.print(f"started in the background: {run_dir} (launcher pid {state['pid']}, log {state['log']})")
        out.print(f"follow it: vpscluster attach {run_dir}    stop it: vpscluster stop {run_dir}")
    return 0
