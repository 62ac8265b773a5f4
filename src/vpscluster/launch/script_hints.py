"""A static look at a script `vpscluster run` is about to start, for the recipe that cannot work.

The usual hand-written multi-process recipe starts its own processes (`mp.spawn`), writes
`os.environ["MASTER_ADDR"] = "<one IP>"` (and MASTER_PORT, RANK, WORLD_SIZE) and joins with
`init_process_group(init_method="tcp://...")`. Under any launcher that breaks: torchrun already
starts one process per rank and sets those variables for the rendezvous it runs, so the script
either overwrites them with an address the other nodes cannot reach or spawns a second set of
processes per rank, and the group never forms. `hint` reads the script's syntax tree (nothing is
run or imported) and returns one line naming what it found, with the lines, and what to change.
"""

from __future__ import annotations

import ast
from pathlib import Path

LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
FIX = ("torchrun starts one process per rank and sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE itself: "
       "drop those and call init_process_group(backend) with the env:// default (or use the session API: "
       "from vpscluster import session; s = session.start())")


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name) and node.id == "environ")


def _const(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _spawn_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound to torch.multiprocessing, names bound to its spawn/start_processes)."""
    modules, functions = {"mp"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.multiprocessing":
                    modules.add(a.asname or "torch.multiprocessing")
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.multiprocessing"):
            for a in node.names:
                if node.module == "torch" and a.name == "multiprocessing":
                    modules.add(a.asname or a.name)
                elif node.module == "torch.multiprocessing" and a.name in ("spawn", "start_processes"):
                    functions.add(a.asname or a.name)
    return modules, functions


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def findings(source: str) -> list[str]:
    """What in `source` breaks under a launcher, each as "what (line N)"; [] for none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # Python will say so itself, on every rank
    modules, functions = _spawn_names(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Subscript) and _is_environ(t.value) and _const(t.slice) in LAUNCHER_VARS:
                    found.append((node.lineno, f"sets {_const(t.slice)} itself"))
        elif isinstance(node, ast.Call):
            f = node.func
            name = _dotted(f)
            if (isinstance(f, ast.Attribute) and f.attr in ("spawn", "start_processes") and _dotted(f.value) in modules) \
                    or (isinstance(f, ast.Name) and f.id in functions):
                found.append((node.lineno, f"starts its own processes with {name}"))
            elif isinstance(f, ast.Attribute) and f.attr == "update" and _is_environ(f.value):
                keys = {_const(k) for a in node.args if isinstance(a, ast.Dict) for k in a.keys} | \
                       {k.arg for k in node.keywords}
                for key in sorted(k for k in keys if k in LAUNCHER_VARS):
                    found.append((node.lineno, f"sets {key} itself"))
            elif name.endswith("init_process_group"):
                method = next((k.value for k in node.keywords if k.arg == "init_method"), None)
                text = _const(method) or (_const(method.values[0]) if isinstance(method, ast.JoinedStr) and method.values else None)
                if text and text.startswith("tcp://"):
                    found.append((node.lineno, "joins a hard-coded tcp:// address"))
    merged: dict[str, list[int]] = {}
    for line, what in sorted(found):
        merged.setdefault(what, []).append(line)
    return [f"{what} (line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines))})" for what, lines in merged.items()]


def hint(path: str | Path) -> str | None:
    """One line for the script at `path` when it does what breaks under a launcher, else None."""
    try:
        source = Path(path).read_text(errors="replace")
    except OSError:
        return None
    found = findings(source)
    if not found:
        return None
    return f"hint: {Path(path).name} {'; '.join(found)}, which cannot work under vpscluster run: {FIX}"
