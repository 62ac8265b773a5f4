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
    from vpscluster.errors import UserError
    from vpscluster.launch import controller

    if args.dry_run:
        raise UserError("--detach and --dry-run do not go together; drop one")
    say = (lambda _line: None) if args.json else (lambda line: out.print(line, markup=False, soft_wrap=True))
    begin = controller.resume if prepared.resume else controller.start
    state = begin(prepared, args.controller, list(args._argv), say=say)
    return _started(args, Path(prepared.run_dir), state, out)


def _started(args: argparse.Namespace, run_dir: Path, state: dict, out) -> int:
    from vpscluster.cli.output import emit_json

    doc = {"run_id": Path(run_dir).name, "run_dir": str(run_dir), "controller": state["controller"],
           "remote_run_dir": state["remote_run_dir"], "pid": state["pid"], "log": state["remote_log"]}
    if args.json:
        emit_json(doc)
    else:
        out.print(f"started on {state['controller']}: {state['remote_run_dir']} (launcher pid {state['pid']} there); "
                  "this machine may now sleep or go offline", markup=False, soft_wrap=True)
        out.print(f"follow it: vpscluster attach {run_dir}    stop it: vpscluster stop {run_dir}", markup=False, soft_wrap=True)
    return 0


# `run`'s options that the controller node gets its own value of (or none): the cluster file, the
# folder and the run dir as shipped there, and the words of this detaching command itself.
RUN_OPTIONS_REPLACED = ("cluster", "sync", "run_dir", "resume", "detach", "controller", "json", "detached_child",
                        "accept_new_host_keys", "dry_run")


def option_action(parser: argparse.ArgumentParser, word: str):
    """The action of option `word` (`--opt` or `--opt=value`) as argparse reads it: the exact
    name, or an unambiguous prefix of one long option; None for any other word."""
    if not word.startswith("-") or word in ("-", "--"):
        return None
    name = word.split("=", 1)[0]
    table = parser._option_string_actions
    if name in table:
        return table[name]
    found = {id(a): a for opt, a in table.items() if name.startswith("--") and opt.startswith(name)}
    return next(iter(found.values())) if len(found) == 1 else None


def options_without(parser: argparse.ArgumentParser, words: list[str], dests) -> list[str]:
    """`words` (options as typed, the subcommand's name not among them) less the options whose
    dest is in `dests`, with their values (`--opt V`, `--opt=V`, or an abbreviated `--op V`)."""
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        action = option_action(parser, word)
        takes = 0 if action is None or "=" in word or action.nargs == 0 else 1
        if action is None or action.dest not in dests:
            out += words[i:i + 1 + takes]
        i += 1 + takes
    return out


def program_for_controller(program: list[str], root: str) -> list[str]:
    """The program's words (`python my_train.py ARGS`) as the controller node runs them from the
    shipped copy of `root`: a script given by an absolute path becomes relative to `root` (as
    `run` itself reads a relative one); a script outside `root` is refused in one line, since it
    would not be shipped."""
    import os

    from vpscluster.errors import UserError
    from vpscluster.launch.commands import _is_python, parse_program

    words = list(program[1:] if program[:1] == ["--"] else program)
    parsed = parse_program(words)
    if parsed.kind != "script":
        return words
    at = 1
    while words[at].startswith("-") and words[at] not in ("-m", "-c"):
        at += 1
    assert _is_python(words[0]) and words[at] == parsed.target
    real_root = os.path.realpath(root)
    target = os.path.realpath(os.path.join(real_root, parsed.target))
    if os.path.commonpath([real_root, target]) != real_root:
        raise UserError(f"{parsed.target} is outside the folder {root} that goes to the controller node; "
                        "run from the folder holding it or pass --sync DIR")
    return words[:at] + [os.path.relpath(target, real_root)] + words[at + 1:]


def run_argv_for_controller(parser: argparse.ArgumentParser, argv: list[str], program: list[str], root: str,
                            resume: bool = False):
    """`run ... --detach --controller NODE -- PROGRAM` as typed (`argv`, the subcommand's name
    first; `program`: its trailing words) -> a function of (the cluster file, the shipped folder,
    the run dir, as on NODE) giving the `run` command NODE starts: the same options, with
    RUN_OPTIONS_REPLACED given NODE's values, detached there, printing JSON; `resume`: that run
    dir continued (`--resume`), not a new one (`--run-dir`)."""
    if argv[:1] != ["run"]:
        raise ValueError(f"not a `run` command line: {argv[:1]}")
    at = len(argv) - len(program)
    kept = options_without(parser, argv[1:at], RUN_OPTIONS_REPLACED)
    words = program_for_controller(program, root)

    def argv_on(cluster_file: str, shipped: str, run_dir: str) -> list[str]:
        return ["run", *kept, "--cluster", cluster_file, "--sync", shipped, "--resume" if resume else "--run-dir", run_dir,
                "--detach", "--json", "--", *words]

    return argv_on


def start_run_on_controller(args: argparse.Namespace, parser: argparse.ArgumentParser, job, out) -> int:
    """`run --detach --controller NODE`: the user's folder and the launcher on NODE (launch/controller.py)."""
    import os

    from vpscluster.launch import controller

    root = os.path.abspath(args.sync or os.getcwd())
    node = controller.resolve_node(job.cluster, args.controller)  # before anything is shipped
    argv_on = run_argv_for_controller(parser, list(args._argv), list(args.program), root, resume=bool(args.resume))
    say = (lambda _line: None) if args.json else (lambda line: out.print(line, markup=False, soft_wrap=True))
    begin = controller.resume_run if args.resume else controller.start_run
    state = begin(job.cluster, node.name, job.run_dir, root, argv_on, list(args._argv), say=say)
    return _started(args, Path(job.run_dir), state, out)
