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
    p.add_argument("--controller", metavar="NODE",
                   help="with --detach: run the launcher on this node of the cluster (`head`: its head), so this "
                        "machine may sleep or go offline; `attach`, `logs`, `stop` and `report` reach it over SSH")
    p.add_argument("--detached-child", action="store_true", help=argparse.SUPPRESS)  # the launcher --detach starts


def run_as_child(args: argparse.Namespace, run_dir: str | Path, body: Callable[[], int]) -> int:
    """`body()` as the background launcher of `run_dir`: its end (exit status and message) is
    written to launcher.json, however it ends."""
    from vpscluster.errors import UserError
    from vpscluster.launch import detached

    check_controller(args)
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
    if getattr(args, "controller", None):
        raise UserError("--controller works with `train --detach` so far, not with `run`; drop --controller")
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


def check_controller(args: argparse.Namespace) -> None:
    """--controller only with --detach (refused before anything is planned)."""
    from vpscluster.errors import UserError

    if getattr(args, "controller", None) and not args.detach:
        raise UserError(f"--controller {args.controller} goes with --detach; add --detach")


def start_on_controller(args: argparse.Namespace, prepared, out) -> int:
    """`train --detach --controller NODE`: the launcher on NODE (launch/controller.py)."""
    from vpscluster.cli.output import emit_json
    from vpscluster.errors import UserError
    from vpscluster.launch import controller

    if args.dry_run:
        raise UserError("--detach and --dry-run do not go together; drop one")
    say = (lambda _line: None) if args.json else (lambda line: out.print(line, markup=False, soft_wrap=True))
    begin = controller.resume if prepared.resume else controller.start
    state = begin(prepared, args.controller, list(args._argv), say=say)
    run_dir = prepared.run_dir
    doc = {"run_id": Path(run_dir).name, "run_dir": str(run_dir), "controller": state["controller"],
           "remote_run_dir": state["remote_run_dir"], "pid": state["pid"], "log": state["remote_log"]}
    if args.json:
        emit_json(doc)
    else:
        out.print(f"started on {state['controller']}: {state['remote_run_dir']} (launcher pid {state['pid']} there); "
                  "this machine may now sleep or go offline", markup=False, soft_wrap=True)
        out.print(f"follow it: vpscluster attach {run_dir}    stop it: vpscluster stop {run_dir}", markup=False, soft_wrap=True)
    return 0
