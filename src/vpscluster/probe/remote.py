"""Run one of the probe's self-contained scripts with a node's own Python, through its executor.

The script travels inside the command line (zlib + base64 in a one-line `python -c` bootstrap),
so nothing is copied to the node first and `start()` (which has no stdin) works as well as
`run()`. The scripts use only the standard library (and torch when the node has it), which is
the point: they must work with whatever interpreter the cluster file names.
"""

from __future__ import annotations

import base64
import json
import zlib
from functools import lru_cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent

# The bootstrap puts argv in place as the script expects it (argv[0] = the script's name).
_BOOTSTRAP = (
    "import sys,zlib,base64;sys.argv[0]={name!r};"
    "exec(compile(zlib.decompress(base64.b64decode({blob!r})),{name!r},'exec'),"
    "{{'__name__':'__main__'}})"
)


@lru_cache(maxsize=None)
def script_source(name: str) -> str:
    """The source of `vpscluster/probe/<name>.py`."""
    return (_HERE / f"{name}.py").read_text()


@lru_cache(maxsize=None)
def _bootstrap(name: str) -> str:
    blob = base64.b64encode(zlib.compress(script_source(name).encode(), 9)).decode()
    return _BOOTSTRAP.format(name=f"{name}.py", blob=blob)


def script_command(python: str, name: str, *args: str) -> list[str]:
    """argv that runs script `name` with interpreter `python` and arguments `args`."""
    return [python, "-c", _bootstrap(name), *args]


def parse_json_output(stdout: str) -> dict | None:
    """The last line of `stdout` that is a JSON object (scripts print exactly one)."""
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
