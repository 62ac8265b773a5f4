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


# Pairs (lower, higher) of DESIGN.md's layers: the lower never imports the higher, not even
# inside a function. train sits below plan: what both need (the sync rule, a strategy's cost
# companion) lives under train/strategies/ (torch-free), and plan reads it from there.
LOWER_NEVER_IMPORTS = [
    ("train", "plan"),
    ("train", "launch"),
    ("launch", "monitor"),  # monitoring subscribes to the launch's events (monitor/targets.py)
    ("train", "bench"),
    ("probe", "train"),
    ("probe", "plan"),
    ("cluster", "probe"),
    ("cluster", "train"),
    ("cluster", "plan"),
]


def _upward_imports(lower: str, higher: str) -> list[str]:
    found = []
    for path in sorted((PACKAGE / lower).rglob("*.py")):
        bad = sorted(n for n in _imports(path) if n == f"vpscluster.{higher}" or n.startswith(f"vpscluster.{higher}."))
        found += [f"{path.relative_to(PACKAGE)}: {n}" for n in bad]
    return found


def test_lower_layers_never_import_higher_ones():
    offenders = [f for lower, higher in LOWER_NEVER_IMPORTS for f in _upward_imports(lower, higher)]
    assert offenders == [], offenders


def test_the_sync_rule_and_every_cost_companion_load_without_torch():
    """plan imports them at module level; `vpscluster plan` and `--help` must not pay for torch."""
    import subprocess
    import sys

    code = ("import sys; import vpscluster.train.strategies.sync_rule; "
            "from vpscluster.train.strategies import COSTS, costs_for; [costs_for(n) for n in COSTS]; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr
