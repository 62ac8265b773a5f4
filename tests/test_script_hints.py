"""Hints for scripts that cannot work under a launcher (`launch/script_hints.py`): the static look
finds mp.spawn, MASTER_ADDR & co. set in the script and a hard-coded tcp:// init_method, leaves a
torchrun-style script alone, and `vpscluster run` says it in one line before the run and again
in the error when the script's own group never forms."""

from __future__ import annotations

import time

from conftest import REPO, run_cli

from vpscluster.launch.script_hints import findings, hint

SCRIPTS = REPO / "tests" / "scripts"


def test_the_spawn_recipe_is_found_with_its_lines():
    found = findings((SCRIPTS / "spawn_recipe.py").read_text())
    assert found == ["sets MASTER_ADDR itself (line 18)", "sets MASTER_PORT itself (line 19)",
                     "starts its own processes with mp.spawn (line 20)"], found


def test_tcp_init_env_update_and_an_imported_spawn_are_found():
    found = findings((SCRIPTS / "tcp_init.py").read_text())
    assert found == ["sets RANK itself (line 8)", "sets WORLD_SIZE itself (line 8)",
                     "joins a hard-coded tcp:// address (line 12)", "starts its own processes with start (line 16)"], found


def test_torchrun_style_and_session_scripts_get_no_hint():
    for script in (SCRIPTS / "ddp_tutorial.py", REPO / "examples" / "image_classifier.py",
                   REPO / "examples" / "hf_transformer.py"):
        assert hint(script) is None, script
    assert findings("import os\nos.environ.setdefault('MASTER_ADDR', 'x')\nprint(os.environ['RANK'])\n") == []
    assert findings("def broken(:\n") == []  # Python says so itself, on every rank


def test_run_says_what_to_change_in_one_line_and_again_when_the_group_never_forms(tmp_path):
    t0 = time.monotonic()
    r = run_cli("run", "--nodes", "1", "--run-dir", str(tmp_path / "run"), "--sync", str(SCRIPTS),
                "--", "python", "spawn_recipe.py", cwd=str(tmp_path), timeout=120)
    assert r.returncode != 0
    hints = [line for line in r.stderr.splitlines() if line.startswith("hint: spawn_recipe.py ")]
    assert len(hints) == 1 and "mp.spawn (line 20)" in hints[0] and "init_process_group(backend)" in hints[0], r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("vpscluster run: error: ") and "likely cause: the script's own rendezvous" in last, last
    assert time.monotonic() - t0 < 90
