"""Node-side programs, and the one way every layer runs them on a node.

Each module here is a complete program that a node runs with its own Python (the interpreter
the cluster file names): standard library only (plus torch where the node has it), a `main(argv)`
and an `if __name__ == "__main__"`, and never an import of vpscluster, so no node needs
vpscluster installed to be probed, synced, torn down or given a port.

    facts.py       node facts (CPU, quota, memory, disk, interfaces, torch, GPUs)   one JSON line
    links.py       TCP measurement tool: `server` / `client` (RTT, bandwidth, clock)
    allreduce.py   all-reduce sweep with torch.distributed (rank 0 prints one JSON line)
    reap.py        stop every process tagged with a launch id, then check none is left;
                   `reap.py guard ...` runs a launch command that stops when the launcher dies
    tree_hash.py   SHA-256 of the given files under each root (stdin: the paths)
    unpack.py      unpack a tar archive into a directory and delete the archive
    free_port.py   a free TCP port on the node (IPv4 or IPv6 by the address)
    run_module.py  run a module of a package sent as a zip on stdin (calibration: the real model)
    queue_exporter.py  NATS JetStream monitoring as Prometheus metrics (`queue up` starts it on the head)
    torchrun.py    torch.distributed.run with its TCPStore servers bound to their own address
    lighthouse.py  torchft's lighthouse bound to the head's address (the quorum engine's meeting point)

`command(python, name, *args)` is the argv that runs program `name`: its source travels inside
the command line (zlib + base64 in a one-line `python -c` bootstrap), so nothing is copied to
the node first, `start()` (which has no stdin) works as well as `run()`, and stdin stays free for
the program. Run locally with `sys.executable`, the same argv tests the very thing nodes run.
Work that needs vpscluster's own code on the node (calibration times the real model) runs
through `run_module` with `package_archive()` as stdin: the launcher's package travels with the
command, so the node needs nothing installed but Python (and torch for that work).
"""

from __future__ import annotations

import base64
import io
import json
import zipfile
import zlib
from functools import lru_cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent

PROGRAMS = ("facts", "links", "allreduce", "reap", "tree_hash", "unpack", "free_port", "run_module", "queue_exporter",
            "torchrun", "lighthouse")

# The bootstrap puts argv in place as the program expects it (argv[0] = the program's file name).
_BOOTSTRAP = (
    "import sys,zlib,base64;sys.argv[0]={name!r};"
    "exec(compile(zlib.decompress(base64.b64decode({blob!r})),{name!r},'exec'),"
    "{{'__name__':'__main__'}})"
)


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The source of `vpscluster/nodeside/<name>.py`."""
    if name not in PROGRAMS:
        raise ValueError(f"no node-side program {name!r}; known: {', '.join(PROGRAMS)}")
    return (_HERE / f"{name}.py").read_text()


@lru_cache(maxsize=None)
def _bootstrap(name: str) -> str:
    blob = base64.b64encode(zlib.compress(source(name).encode(), 9)).decode()
    return _BOOTSTRAP.format(name=f"{name}.py", blob=blob)


def command(python: str, name: str, *args: str) -> list[str]:
    """argv that runs node-side program `name` with interpreter `python` and arguments `args`."""
    return [python, "-c", _bootstrap(name), *args]


def parse_json_output(stdout: str) -> dict | None:
    """The last line of `stdout` that is a JSON object (the programs print exactly one)."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


@lru_cache(maxsize=1)
def package_archive() -> bytes:
    """The vpscluster package's Python files as a zip (for `run_module`'s stdin); no data files."""
    package = _HERE.parent
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(package.rglob("*.py")):
            if "__pycache__" not in path.parts:
                z.write(path, path.relative_to(package.parent).as_posix())
    return buf.getvalue()
