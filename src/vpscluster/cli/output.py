"""Where output goes: JSON documents on stdout, everything for people through rich.

With `--json` a command prints exactly one JSON document on stdout; progress bars, tables and
warnings then go to stderr so that `vpscluster probe --json | jq` always works.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def console(json_mode: bool = False):
    """A rich Console for people: stderr when stdout is reserved for JSON."""
    from rich.console import Console

    return Console(stderr=json_mode, highlight=False)


def emit_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False, default=_default)
    sys.stdout.write("\n")
    sys.stdout.flush()


def _default(obj: Any):
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else there")
