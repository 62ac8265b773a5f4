"""Every node's output, live, with a `node/rank` prefix; kept per node; errors and events picked out.

torchrun tees each worker's output to its own console with a `[rankN]:` prefix (our
`LOG_LINE_PREFIX_TEMPLATE`); lines without one come from the elastic agent itself. The router
writes every line to RUN_DIR/logs/<node>.log, shows it to the user as `node/rank: text`, hands
rank 0's `VPSC_EVENT` lines to a callback (the progress view) instead, and remembers the first
error each node printed — a rank killed by a signal (the elastic agent's "failed (exitcode: -9)
local_rank: 1" line, said for people), else the last line of its first Python traceback, else
its last line on stderr — so a failed launch can say which node failed and why in one line.
A C++ stack trace (the `frame #N: ...` lines torch's c10 errors carry, e.g. an agent's store
connection closing as the run ends) stays in the log; the user sees one line pointing there.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")
# glog/c10d warnings ("[W1202 19:48:59.88 socket.cpp:207] ...") and Python warnings are not errors.
_WARNING = re.compile(r"^\s*(\[W\d{4} |W\d{4} |\S+Warning: |warnings\.warn|warning: )")
_TRACEBACK = "Traceback (most recent call last):"
# Exceptions that only say "a worker failed" (the agent's summary): the worker's own error is better.
_WRAPPER_ERRORS = ("ChildFailedError", "SignalException")
# The elastic agent's account of a worker that died: "... failed (exitcode: -9) local_rank: 1 (pid: ...)".
# A worker that aborts itself (SIGABRT: a C++ destructor or std::terminate after its own uncaught
# exception, e.g. gloo tearing down) printed the real reason first; a kill from outside did not.
_SELF_INFLICTED = ("SIGABRT",)
_DEATH = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_CPP_FRAME = re.compile(r"^frame #\d+: ")


def worker_death(line: str) -> str | None:
    """torchrun's 'failed (exitcode: -9) local_rank: 1' line, said for people."""
    m = _DEATH.search(line)
    if not m:
        return None
    code, local_rank = int(m.group(1)), m.group(2)
    if code < 0 and -code in signal.valid_signals():
        return f"local rank {local_rank} was killed by {signal.Signals(-code).name}"
    return f"local rank {local_rank} exited with status {code}"


def split_rank(line: str) -> tuple[int | None, str]:
    """`[rank3]:text` -> (3, "text"); an agent line -> (None, line)."""
    m = _RANK_PREFIX.match(line)
    if not m:
        return None, line
    text = line[m.end():]
    # torch prefixes a worker's uncaught exception with its own "[rankN]:" as well.
    inner = _RANK_PREFIX.match(text.lstrip())
    if inner and inner.group(1) == m.group(1):
        text = text.lstrip()[inner.end():]
    return int(m.group(1)), text[1:] if text.startswith(" ") else text


@dataclass
class _Source:
    """Traceback state of one (node, rank) output."""

    # The streams inside a traceback: stdout and stderr arrive through separate pipes (torchrun's
    # tee threads, the SSH channel), so a line printed before the traceback may land in its middle.
    in_traceback: set[str] = field(default_factory=set)
    error: str | None = None
    last_stderr: str | None = None
    in_frames: bool = False  # amid a C++ stack trace's `frame #N:` lines


@dataclass
class NodeOutput:
    name: str
    path: Path
    sources: dict[Any, _Source] = field(default_factory=dict)
    lines: int = 0
    deaths: list[str] = field(default_factory=list)  # workers the agent saw die, in order


class LogRouter:
    """Callable per node as an executor's `on_line(stream, line)` (see `for_node`)."""

    def __init__(
        self,
        logs_dir: str | Path,
        node_names: list[str],
        show: Callable[[str], None] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        file_names: dict[str, str] | None = None,
        events_from: str | None = None,
    ) -> None:
        from vpscluster.train.events import parse_event

        self._parse_event = parse_event
        self.logs_dir = Path(logs_dir)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.show = show
        self.on_event = on_event
        names = file_names or {}
        self.nodes = {n: NodeOutput(n, self.logs_dir / names.get(n, f"{n}.log")) for n in node_names}
        self._files = {n: o.path.open("a", buffering=1) for n, o in self.nodes.items()}
        self._lock = threading.Lock()
        self.rank0_node: str | None = None  # which node runs global rank 0 (the report's writer)
        # Only this node's rank 0 speaks for the run (the quorum engine: one group per node); None: any.
        self.events_from = events_from
        self.events: list[dict[str, Any]] = []
        self.last_line_at = time.monotonic()  # for the launcher's silence watchdog
        self.started = False  # rank 0 announced the start of training

    def add_node(self, node: str) -> None:
        """A node added to the running launch: its own log file from now on."""
        if node not in self.nodes:
            self.nodes[node] = NodeOutput(node, self.logs_dir / f"{node}.log")
            self._files[node] = self.nodes[node].path.open("a", buffering=1)

    def for_node(self, node: str) -> Callable[[str, str], None]:
        return lambda stream, line: self.line(node, stream, line)

    def note(self, node: str, text: str) -> None:
        """A launcher remark about a node: logged and shown like its lines."""
        self.line(node, "launcher", text)

    def line(self, node: str, stream: str, line: str) -> None:
        line = line.rstrip("\r\n")
        rank, text = split_rank(line)
        out = self.nodes[node]
        with self._lock:
            out.lines += 1
            if stream != "launcher":
                self.last_line_at = time.monotonic()
            who = f"{node}/{rank}" if rank is not None else (f"{node}/launcher" if stream == "launcher" else node)
            self._files[node].write(f"{time.strftime('%H:%M:%S')} {who} {stream}: {text}\n")
            src = out.sources.setdefault(rank, _Source())
            if _CPP_FRAME.match(text):  # kept in the log; shown as one line
                if src.in_frames or not self.show:
                    return
                src.in_frames = True
                text = f"(a C++ stack trace follows in {out.path})"
            else:
                src.in_frames = False
                self._track_error(src, stream, text)
            death = worker_death(text) if rank is None else None
            if death:
                out.deaths.append(death)
            if rank == 0 and self.events_from in (None, node):
                self.rank0_node = node
                event = self._parse_event(text)
                if event is not None:
                    self.started = self.started or event.get("event") == "start"
                    self.events.append(event)
                    if self.on_event:
                        self.on_event(event)
                    return
        if self.show:
            self.show(f"{who}: {text}")

    @staticmethod
    def _track_error(src: _Source, stream: str, text: str) -> None:
        if stream == "stderr" and text.strip() and not _WARNING.match(text):
            src.last_stderr = text.strip()
        if text.startswith(_TRACEBACK):
            src.in_traceback.add(stream)
        elif stream in src.in_traceback and text and not text[0].isspace():
            # The first unindented line after the frames is "SomeError: message".
            src.in_traceback.discard(stream)
            if src.error is None and not text.startswith(("During handling", "The above exception")):
                src.error = text.strip()

    def first_error(self, node: str) -> str | None:
        """The node's first error: a worker killed by a signal from outside (the root cause: its
        peers' errors, a lost connection, follow from it), else a worker's traceback, else a
        worker that aborted itself (after printing that traceback, if it had one), else the
        agent's error, else its last stderr line."""
        deaths = self.nodes[node].deaths
        killed = [d for d in deaths if "killed by" in d and not d.endswith(_SELF_INFLICTED)]
        if killed:
            return killed[0]
        sources = self.nodes[node].sources
        ranks = sorted(k for k in sources if k is not None)
        worker_errors = [sources[r].error for r in ranks if sources[r].error]
        if worker_errors:
            return worker_errors[0]
        aborted = [d for d in deaths if d.endswith(_SELF_INFLICTED)]
        if aborted:
            return aborted[0]
        agent = sources.get(None)
        if agent and agent.error and not any(w in agent.error for w in _WRAPPER_ERRORS):
            return agent.error
        for key in ranks + [None]:
            if key in sources and sources[key].last_stderr:
                return sources[key].last_stderr
        return agent.error if agent and agent.error else None

    def close(self) -> None:
        for f in self._files.values():
            f.close()


# A line of RUN_DIR/logs/<node>.log as `LogRouter.line` writes it: "HH:MM:SS who stream: text".
_FILE_LINE = re.compile(r"^(\d\d:\d\d:\d\d) (\S+) (\S+): (.*)$")
LAUNCHER_LOG = "detached.log"  # a detached launcher's own output (launch/detached.py), not a node's
LOCAL_LOG = "launcher.log"  # the local cluster's node log (logs/<node>.log on a cluster)


def read_log_line(line: str) -> tuple[str, str, str, str] | None:
    """(HH:MM:SS, who, stream, text) of a node log's line; who is `node/rank`, `node/launcher` or
    `node` (the elastic agent). None for a line of another form (a continuation, a torn write)."""
    m = _FILE_LINE.match(line.rstrip("\n"))
    return m.groups() if m else None  # type: ignore[return-value]


def node_logs(logs_dir: str | Path) -> dict[str, Path]:
    """{node: its log} in a run's logs/ folder, by node name. Left out: a detached launcher's own
    output and, on the local cluster, each rank's copy of its output (rank-N.log, written by the
    worker itself: the node log has the same lines)."""
    out = {}
    for p in sorted(Path(logs_dir).glob("*.log")):
        if p.name == LAUNCHER_LOG or re.fullmatch(r"rank-\d+\.log", p.name):
            continue
        out[_local_node(p) if p.name == LOCAL_LOG else p.stem] = p
    return out


def _local_node(path: Path) -> str:
    """The local cluster's node name, as its log's lines say it (`local` if none does yet)."""
    with path.open(errors="replace") as f:
        for line in f:
            parsed = read_log_line(line)
            if parsed:
                return parsed[1].split("/")[0]
    return "local"


def diloco_sync_hashes(logs_dir: str | Path) -> dict[tuple[int, int, int, int], dict[str, set[str]]]:
    """What `strategy.sync_hashes` left in a run's node logs: {(world size, fragment, outer step,
    step): {sha256: {"node/rank", ...}}}. A sync whose replicas agree has one sha256; the same key
    logged by a later launch (a round redone after a restart, from the same checkpoint and data)
    lands in the same entry, so it must agree too."""
    from vpscluster.train.strategies.diloco import parse_sync_hash

    out: dict[tuple[int, int, int, int], dict[str, set[str]]] = {}
    for path in node_logs(logs_dir).values():
        with path.open(errors="replace") as f:
            for line in f:
                parsed = read_log_line(line)
                h = parse_sync_hash(parsed[3]) if parsed else None
                if h is not None:
                    key = (h["world_size"], h["fragment"], h["outer_step"], h["step"])
                    out.setdefault(key, {}).setdefault(h["sha256"], set()).add(parsed[1])
    return out


class FileTail:
    """The complete lines appended to a file since the last look (the file may not exist yet)."""

    def __init__(self, path: str | Path, offset: int = 0) -> None:
        self.path, self.offset, self.partial = Path(path), offset, b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *done, self.partial = (self.partial + data).split(b"\n")
        return [d.decode(errors="replace") for d in done]
