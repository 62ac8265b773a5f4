"""The library never imports the CLI: only `vpscluster.cli` (and the `python -m` entry point) may."""

from __future__ import annotations

import ast
from pathlib import Path

import vpscluster

PACKAGE = Path(vpscluster.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_nothing_outside_cli_imports_the_cli():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "cli" or rel.name == "__main__.py":
            continue
        bad = sorted(n for n in _imports(path) if n == "vpscluster.cli" or n.startswith("vpscluster.cli."))
        offenders += [f"{rel}: {n}" for n in bad]
    assert offenders == [], offenders


def test_the_scan_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from vpscluster.cli.output import console\n")
    assert "vpscluster.cli.output" in _imports(f)
