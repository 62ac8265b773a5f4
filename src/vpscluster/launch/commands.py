"""Each node's launch command: PyTorch's elastic launcher wired for a WAN cluster (pure functions).

What goes wrong when people wire `torchrun` by hand across rented machines, and what this
module does about it:

- A hostname or the wrong interface gets advertised: we pass `--local-addr` (the address by which
  the cluster reaches the node), a rendezvous endpoint that is an address, not a name, and set
  GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface carrying that address.
- The c10d rendezvous guesses which node hosts its store by comparing hostnames: we say it
  (`is_host=1` on the head only).
- torch's TCPStore server listens on every interface whatever address it is given (the
  rendezvous store on the head, and the store rank 0's agent shares with its workers), and
  torchrun has no flag to change that. Every node runs torchrun through `nodeside/torchrun.py`,
  which hands each store server a socket bound to the address it was asked for (TCPStore's
  `master_listen_fd`): the rendezvous endpoint, or the node's `--local-addr`. gloo and NCCL bind
  the address of GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME's interface.
- Join time-outs sized for a LAN: `join_timeout` comes from the run's `timeouts.rendezvous_s`.
- Remote commands `cd` into the launcher's path: every command `cd`s into a directory that
  exists on that node (its workdir, or the synced copy of the code).

Nothing here does I/O, so `--dry-run` prints exactly what a launch runs and the output is
snapshot-tested (tests/snapshots/).
"""

from __future__ import annotations

import os
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Any, Sequence

from vpscluster import nodeside
from vpscluster.errors import UserError

# The elastic launcher's prefix for each worker's output lines, so the launcher can tell ranks
# apart (torch substitutes ${rank} with the global rank). Parsed back by `logs.split_rank`.
LOG_LINE_PREFIX_TEMPLATE = "[rank${rank}]:"
# Every process a launch starts carries this variable (workers inherit it from torchrun), so
# teardown can find and verify stragglers by their environment, whatever the process tree.
LAUNCH_ID_ENV = "VPSC_LAUNCH_ID"
DEFAULT_RDZV_PORT = 29400



@dataclass(frozen=True)
class Program:
    """What torchrun starts on every rank: a script, a module, or any executable."""

    kind: str  # "script" | "module" | "exec"
    target: str
    args: tuple[str, ...] = ()

    def torchrun_args(self) -> list[str]:
        if self.kind == "script":
            return [self.target, *self.args]
        if self.kind == "module":
            return ["-m", self.target, *self.args]
        return ["--no-python", self.target, *self.args]


def parse_program(argv: Sequence[str]) -> Program:
    """`python script.py A` -> script; `python -m pkg A` -> module; anything else -> executable.

    The leading interpreter (python, python3, /usr/bin/python3.11, ...) is dropped: each node
    runs its own configured interpreter.
    """
    argv = list(argv)
    if not argv:
        raise UserError("no command given; write it after --, e.g. vpscluster run --cluster c.yaml -- python train.py")
    if _is_python(argv[0]):
        rest = argv[1:]
        # Interpreter flags such as -u are harmless to drop: output is unbuffered anyway.
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest = rest[1:]
        if not rest:
            raise UserError(f"{' '.join(argv)}: name a script or -m MODULE to run")
        if rest[0] == "-c":
            raise UserError("python -c is not supported by torchrun; put the code in a script")
        if rest[0] == "-m":
            if len(rest) < 2:
                raise UserError("python -m needs a module name")
            return Program("module", rest[1], tuple(rest[2:]))
        return Program("script", rest[0], tuple(rest[1:]))
    return Program("exec", argv[0], tuple(argv[1:]))


def _is_python(word: str) -> bool:
    base = posixpath.basename(word)
    return base == "python" or (base.startswith("python") and base[6:].replace(".", "").isdigit())


@dataclass(frozen=True)
class NodeTarget:
    """What the launcher knows about one node when it builds that node's command."""

    name: str
    address: str  # the address the cluster reaches it by (also what it binds to)
    python: str
    cwd: str  # a directory that exists on that node
    nproc: int = 1
    interface: str | None = None  # None: unknown (a dry run without probe data)
    env: tuple[tuple[str, str], ...] = ()  # extra variables, in order (PYTHONPATH for train, ...)
    log_dir: str | None = None  # torchrun's per-rank log files (default: a temp dir left in /tmp)


@dataclass(frozen=True)
class LaunchOptions:
    """Settings shared by every node of one launch."""

    rdzv_id: str
    rdzv_port: int = DEFAULT_RDZV_PORT
    join_timeout_s: float = 600.0  # all nodes must join the rendezvous within this
    store_timeout_s: float = 300.0  # store reads while starting (generous over WAN)
    max_restarts: int = 0


@dataclass
class NodeCommand:
    """One node's exact launch: working directory, environment and argv."""

    node: str
    address: str
    is_head: bool
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """The single shell line run on the node (through SSH or locally)."""
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"cd {shell_path(self.cwd)} && exec env {assignments} {shlex.join(self.argv)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.node, "address": self.address, "head": self.is_head, "cwd": self.cwd,
            "env": dict(self.env), "argv": list(self.argv), "command": self.shell(),
        }


def shell_path(path: str) -> str:
    """Quote a path for the shell, keeping a leading `~/` expandable on the node."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def build_node_commands(
    targets: Sequence[NodeTarget], head: str, program: Program, options: LaunchOptions
) -> list[NodeCommand]:
    """Every node's command, in the targets' order; `head` names the rendezvous host."""
    if not targets:
        raise UserError("the cluster has no nodes")
    by_name = {t.name: t for t in targets}
    if head not in by_name:
        raise UserError(f"head node {head!r} is not one of the cluster's nodes: {', '.join(by_name)}")
    head_address = by_name[head].address
    endpoint = f"{_bracket(head_address)}:{options.rdzv_port}"
    return [_node_command(t, t.name == head, endpoint, len(targets), program, options) for t in targets]


def _node_command(
    t: NodeTarget, is_head: bool, endpoint: str, nnodes: int, program: Program, options: LaunchOptions
) -> NodeCommand:
    conf = {
        "join_timeout": int(options.join_timeout_s),
        "read_timeout": int(options.store_timeout_s),
        # Say which node hosts the store; the default compares hostnames, which we never trust.
        "is_host": 1 if is_head else 0,
    }
    argv = [
        *nodeside.command(t.python, "torchrun"),  # torch.distributed.run, its stores bound
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(t.nproc),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", options.rdzv_id,
        "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
        "--local-addr", t.address,
        "--max-restarts", str(options.max_restarts),
        # Tee every rank's stdout and stderr to the console with a "[rankN]:" prefix.
        "--tee", "3",
    ]
    if t.log_dir:
        argv += ["--log-dir", t.log_dir]
    argv += program.torchrun_args()
    env: dict[str, str] = {}
    if t.interface:
        env["GLOO_SOCKET_IFNAME"] = t.interface
        env["NCCL_SOCKET_IFNAME"] = t.interface
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = LOG_LINE_PREFIX_TEMPLATE
    env[LAUNCH_ID_ENV] = options.rdzv_id
    env["VPSC_NODE"] = t.name
    env.update(dict(t.env))
    return NodeCommand(node=t.name, address=t.address, is_head=is_head, cwd=t.cwd, env=env, argv=argv)


def _bracket(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def render_dry_run(commands: Sequence[NodeCommand], notes: Sequence[str] = ()) -> dict[str, Any]:
    """The `--dry-run --json` document (also what the text view prints)."""
    return {"dry_run": True, "nodes": [c.to_dict() for c in commands], "notes": list(notes)}


def relative_script(program: Program, local_root: str) -> Program:
    """A script given by an absolute path inside the synced directory becomes relative to it."""
    if program.kind != "script" or not os.path.isabs(program.target):
        return program
    root = os.path.realpath(local_root)
    target = os.path.realpath(program.target)
    if os.path.commonpath([root, target]) != root:
        raise UserError(
            f"{program.target} is outside the synced directory {local_root}; "
            "run from the directory holding it or pass --sync DIR"
        )
    return Program("script", os.path.relpath(target, root), program.args)
