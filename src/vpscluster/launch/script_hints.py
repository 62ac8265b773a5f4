"""A static look at a script `vpscluster run` is about to start, for the recipe that cannot work.

The usual hand-written multi-process recipe starts its own processes (`mp.spawn`), writes
`os.environ["MASTER_ADDR"] = "<one IP>"` (and MASTER_PORT, RANK, WORLD_SIZE) and joins with
`init_process_group(init_method="tcp://...")`. Under any launcher that breaks: torchrun already
starts one process per rank and sets those variables for the rendezvous it runs, so the script
either overwrites them with an address the other nodes cannot reach or spawns a second set of
processes per rank, and the group never forms. `hint` reads the script's syntax tree (nothing is
run or imported) and returns one line naming what it found, with the lines, and what to change.

`run --quorum` starts one replica group per node (its own rendezvous, one process) and only the
session API joins those groups through the lighthouse (`strategies/quorum_diloco.py`), so a
script that does not use it would train alone on every node. `quorum_refusal` says so in one
line, from the script's syntax tree and those of the modules of its own it imports.
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


# --- `run --quorum`: only a session gets the quorum ----------------------------------------------

QUORUM_FIX = ("with --quorum every node runs a replica group of its own (one process, its own rendezvous) and only "
              "the session API joins them through the lighthouse: a plain torchrun script would train alone on each "
              "node, nothing synchronised. Put the loop on the session API (from vpscluster import session; "
              "s = session.start(); see the README's bring-your-own-model section) or drop --quorum")
MAX_SCANNED = 200  # local modules followed from the script, at most


def imports_session(tree: ast.AST) -> bool:
    """Whether the module imports the session API (`from vpscluster import session`,
    `import vpscluster.session`, `from vpscluster.session import ...`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == "vpscluster.session" or a.name.startswith("vpscluster.session.") for a in node.names):
                return True
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "vpscluster" and any(a.name == "session" for a in node.names):
                return True
            if node.module == "vpscluster.session" or node.module.startswith("vpscluster.session."):
                return True
    return False


def _imported(tree: ast.AST, here: Path) -> list[tuple[str, Path | None]]:
    """(dotted module, the folder a relative import starts from, else None) of each import,
    with the names a `from M import a, b` imports as candidates M.a, M.b (a submodule or not)."""
    out: list[tuple[str, Path | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here
            for _ in range(max(0, node.level - 1)):
                base = base.parent
            start = base if node.level else None
            module = node.module or ""
            if module:
                out.append((module, start))
            out += [(f"{module}.{a.name}" if module else a.name, start) for a in node.names if a.name != "*"]
    return out


def _module_files(dotted: str, folders: list[Path]) -> list[Path]:
    """The files of `dotted` (and of its parent packages) found under `folders`."""
    parts = dotted.split(".")
    found = []
    for folder in folders:
        for i in range(1, len(parts) + 1):
            stem = folder.joinpath(*parts[:i])
            for f in (stem.with_suffix(".py"), stem / "__init__.py", stem / "__main__.py" if i == len(parts) else None):
                if f is not None and f.is_file():
                    found.append(f)
    return found


def uses_session(path: str | Path, roots: list[str | Path] = ()) -> bool | None:
    """Whether the script at `path`, or a module of its own it imports (found beside it or under
    `roots`, followed up to MAX_SCANNED files), imports the session API; None when the script
    cannot be read (nothing to say)."""
    path = Path(path)
    if not path.is_file():
        return None
    folders = [path.parent.resolve(), *(Path(r).resolve() for r in roots)]
    seen: set[Path] = set()
    todo = [path.resolve()]
    while todo and len(seen) < MAX_SCANNED:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        try:
            tree = ast.parse(f.read_text(errors="replace"))
        except (OSError, SyntaxError, ValueError):
            if f == path.resolve():
                return None  # Python will say so itself
            continue
        if imports_session(tree):
            return True
        for dotted, start in _imported(tree, f.parent):
            if dotted.split(".")[0] in ("vpscluster", "torch", "__future__"):
                continue  # not the user's own code
            todo += [m.resolve() for m in _module_files(dotted, [start] if start else folders)]
    return False


def quorum_refusal(path: str | Path, roots: list[str | Path] = ()) -> str | None:
    """`run --quorum`'s one line for a script that is not on the session API, else None."""
    if uses_session(path, roots) is not False:
        return None
    return f"--quorum: {Path(path).name} does not use the session API; {QUORUM_FIX}"


def module_file(dotted: str, root: str | Path) -> Path | None:
    """The file `python -m dotted` runs when the module is the user's own, under `root`; else None."""
    stem = Path(root).joinpath(*dotted.split("."))
    for f in (stem / "__main__.py", stem.with_suffix(".py")):
        if f.is_file():
            return f
    return None
