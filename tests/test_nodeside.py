"""Node-side programs run exactly as the nodes run them: through `nodeside.command`, here with
this machine's Python and `-S` (no site-packages, so no vpscluster and no third-party library)."""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import pid_alive
from vpscluster import nodeside

NODESIDE = Path(nodeside.__file__).parent


def run(name: str, *args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = nodeside.command(sys.executable, name, *args)
    return subprocess.run([cmd[0], "-S", *cmd[1:]], input=input, capture_output=True, text=True, timeout=timeout)


def test_every_module_is_a_program_the_runner_knows():
    modules = sorted(p.stem for p in NODESIDE.glob("*.py") if p.stem != "__init__")
    assert modules == sorted(nodeside.PROGRAMS)
    for name in modules:
        tree = ast.parse(nodeside.source(name))
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name
        assert "if __name__ == \"__main__\":" in nodeside.source(name), name
    with pytest.raises(ValueError, match="no node-side program"):
        nodeside.command("python3", "nope")


def test_node_side_code_imports_only_the_standard_library():
    # torch is allowed (imported where the node has it); vpscluster and other libraries never.
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    bad = []
    for path in sorted(NODESIDE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] not in allowed]
    assert bad == []


# Launchers that sync vpscluster's package to the node first (`code/src/vpscluster`) and put it on
# the program's PYTHONPATH, as the torchrun pipeline does for `vpscluster.train.worker`: the node
# needs nothing installed. Each names the one module it runs so.
SYNCED_PACKAGE_RUNNERS = {"vertical/launch.py"}


def test_no_node_runs_python_from_a_string_outside_nodeside():
    # Every program a node's interpreter runs goes through `nodeside.command`: no `node.python,
    # "-c", CODE` (code in a format string) and no `-m vpscluster...` that needs it installed.
    import re

    package = NODESIDE.parent
    bad = []
    for path in sorted(package.rglob("*.py")):
        if path.parent == NODESIDE:
            continue
        text = path.read_text()
        if path.relative_to(package).as_posix() in SYNCED_PACKAGE_RUNNERS:
            text = text.replace('.python, "-m", "vpscluster.vertical.worker"', "")
        for pattern in (r"\.python\s*,\s*\"-c\"", r"\.python\s*,\s*\"-m\"\s*,\s*\"vpscluster"):
            bad += [f"{path.relative_to(package)}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert bad == []


def test_every_program_loads_without_vpscluster_or_site_packages():
    # Only the programs' own folder on the path, no site-packages: importing vpscluster (or any
    # third-party library) at module level would fail here.
    names = ",".join(nodeside.PROGRAMS)
    code = f"import sys; sys.path[:0] = [{str(NODESIDE)!r}]; import {names}; print('ok')"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                         cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    for name in ("reap", "unpack"):  # bad arguments: the program's own usage line through the runner
        bad = run(name)
        assert bad.returncode == 2 and f"usage: {name}.py" in bad.stderr


def test_free_port_is_bindable():
    out = run("free_port", "127.0.0.1")
    assert out.returncode == 0
    port = int(out.stdout.strip())
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert int(run("free_port").stdout.strip()) > 0  # no address: IPv4, as the collectives use it


def test_tree_hash_and_unpack_round_trip(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("print('a')\n")
    (src / "data.bin").write_bytes(os.urandom(3_000_000))  # more than one 1 MiB read
    archive = tmp_path / "files.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        for rel in ("pkg/a.py", "data.bin"):
            t.add(src / rel, arcname=rel)
    dest = tmp_path / "node" / "code"
    out = run("unpack", str(archive), str(dest))
    assert out.returncode == 0, out.stderr
    assert not archive.exists() and (dest / "pkg" / "a.py").read_text() == "print('a')\n"

    paths = ["pkg/a.py", "data.bin", "missing.txt"]
    out = run("tree_hash", json.dumps([str(src), str(dest)]), input=json.dumps(paths))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc == nodeside.parse_json_output(out.stdout)
    from vpscluster.launch.sync import local_manifest  # the launcher's side of the comparison

    assert doc[str(src)] == doc[str(dest)] == local_manifest(str(src))


def _escaping_archive(path: Path) -> Path:
    import io

    with tarfile.open(path, "w") as t:
        info = tarfile.TarInfo("ok.txt")  # a good member first: it must not be written either
        info.size = 2
        t.addfile(info, io.BytesIO(b"ok"))
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        t.addfile(info, io.BytesIO(b"bad"))
    return path


def test_unpack_refuses_a_path_outside_the_destination_in_one_line(tmp_path):
    archive = _escaping_archive(tmp_path / "evil.tar")
    out = run("unpack", str(archive), str(tmp_path / "dest"))
    assert out.returncode == 1 and not (tmp_path / "escaped.txt").exists()
    assert not (tmp_path / "dest" / "ok.txt").exists()  # refused whole, before the first member
    assert len(out.stderr.strip().splitlines()) == 1 and "'../escaped.txt' refused" in out.stderr, out.stderr


def _run_without_data_filter(tmp_path, archive: Path, dest: Path) -> subprocess.CompletedProcess:
    """unpack on a Python whose tarfile predates the "data" filter (Debian 12's 3.11.2): simulated
    by that very thing (a sitecustomize removes `tarfile.data_filter` before the program runs),
    not by touching unpack."""
    site = tmp_path / "oldpython"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import tarfile\ndel tarfile.data_filter\n")
    cmd = nodeside.command(sys.executable, "unpack", str(archive), str(dest))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"})


def test_unpack_without_the_data_filter_refuses_what_escapes_and_unpacks_plain_files(tmp_path):
    import io

    out = _run_without_data_filter(tmp_path, _escaping_archive(tmp_path / "evil.tar"), tmp_path / "dest")
    assert out.returncode == 1 and not (tmp_path / "escaped.txt").exists() and not (tmp_path / "dest").exists()
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1 and "'../escaped.txt' refused (outside the destination)" in line, line

    with tarfile.open(tmp_path / "link.tar", "w") as t:  # a link: the data filter's job, refused here
        info = tarfile.TarInfo("key")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
        t.addfile(info)
    out = _run_without_data_filter(tmp_path, tmp_path / "link.tar", tmp_path / "dest2")
    assert out.returncode == 1 and "'key' refused (not a regular file or directory" in out.stderr, out.stderr
    assert not (tmp_path / "dest2").exists()

    with tarfile.open(tmp_path / "plain.tar", "w") as t:  # what vpscluster sends: files and folders
        info = tarfile.TarInfo("pkg")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        t.addfile(info)
        info = tarfile.TarInfo("pkg/run.sh")
        info.size, info.mode, info.uid = 3, 0o6777, 4242  # setuid, world-writable, someone else's
        t.addfile(info, io.BytesIO(b"hi\n"))
    out = _run_without_data_filter(tmp_path, tmp_path / "plain.tar", tmp_path / "dest3")
    assert out.returncode == 0, out.stderr
    f = tmp_path / "dest3" / "pkg" / "run.sh"
    assert f.read_text() == "hi\n" and f.stat().st_mode & 0o7777 == 0o755 and f.stat().st_uid == os.getuid()


def _sleeper(env_extra: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, **env_extra}, start_new_session=True)


def test_reap_stops_only_the_launch_ids_processes():
    var, mine, other = "VPSC_TEST_LAUNCH_ID", f"nsd-{uuid.uuid4().hex}", f"nsd-{uuid.uuid4().hex}"
    ours = [_sleeper({var: mine}) for _ in range(2)]
    # Same id under another variable, and a prefix of the id: neither is the exact tag.
    theirs = [_sleeper({var: other}), _sleeper({"OTHER_VAR": mine}), _sleeper({var: mine[:-1]})]
    try:
        out = run("reap", var, mine, "5", "3")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert sorted(doc["found"]) == sorted(p.pid for p in ours) and doc["left"] == []
        for p in ours:
            p.wait(timeout=10)
        assert all(pid_alive(p.pid) for p in theirs)
        # Nothing left with that tag: a second pass finds nothing.
        assert json.loads(run("reap", var, mine, "5", "3").stdout) == {"found": [], "left": []}
    finally:
        for p in ours + theirs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_reap_of_one_node_spares_the_launchs_processes_of_the_others():
    """VAR2=VALUE2: a node started again within a launch (the quorum engine) gets its own
    leftovers stopped; the same launch's processes of other nodes sharing the /proc live on."""
    var, mine = "VPSC_TEST_LAUNCH_ID", f"nsd-{uuid.uuid4().hex}"
    node3 = [_sleeper({var: mine, "VPSC_NODE": "node-3"})]
    others = [_sleeper({var: mine, "VPSC_NODE": "node-1"}), _sleeper({var: mine}),
              _sleeper({var: f"nsd-{uuid.uuid4().hex}", "VPSC_NODE": "node-3"})]
    try:
        doc = json.loads(run("reap", var, mine, "5", "3", "VPSC_NODE=node-3").stdout)
        assert doc == {"found": [node3[0].pid], "left": []}, doc
        node3[0].wait(timeout=10)
        assert all(pid_alive(p.pid) for p in others)
    finally:
        for p in node3 + others:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_reap_kills_what_ignores_sigterm():
    var, mine = "VPSC_TEST_LAUNCH_ID", f"nsd-{uuid.uuid4().hex}"
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, var: mine}, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        doc = json.loads(run("reap", var, mine, "0.5", "3").stdout)
        assert doc == {"found": [p.pid], "left": []}
        assert p.wait(timeout=10) == -9
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def test_reap_gives_a_lingering_torchrun_agent_only_a_short_grace():
    """The grace period is for the workers (a checkpoint); once only torchrun agents are left
    (they can linger half a minute after SIGTERM), they get AGENT_GRACE_S, then SIGKILL. A worker
    that ignores SIGTERM still gets the whole grace."""
    import time

    from vpscluster.nodeside.reap import AGENT_GRACE_S

    var, mine = "VPSC_TEST_LAUNCH_ID", f"nsd-{uuid.uuid4().hex}"
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    for argv_tail, least, most in ((["-m", "torch.distributed.run"], AGENT_GRACE_S - 0.5, AGENT_GRACE_S + 4),
                                   (["worker"], 8.0, 14.0)):
        # `python -c CODE -m torch.distributed.run`: the agent's markers in its command line
        p = subprocess.Popen([sys.executable, "-c", code, *argv_tail], env={**os.environ, var: mine},
                             stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            t0 = time.monotonic()
            doc = json.loads(run("reap", var, mine, "8", "3").stdout)
            took = time.monotonic() - t0
            assert doc == {"found": [p.pid], "left": []}
            assert least <= took <= most, (argv_tail, took)
        finally:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_guard_passes_the_command_through_and_reaps_when_told_to_stop():
    var, mine = "VPSC_TEST_LAUNCH_ID", f"nsd-{uuid.uuid4().hex}"
    assert run("reap", "guard", var, mine, "1", "/bin/sh", "-c", "exit 7").returncode == 7
    # A stop request (the SSH wrapper's SIGTERM) ends the tagged processes of the launch: the
    # guard's child and a stopped (SIGSTOP) one that only acts on SIGTERM after SIGCONT.
    cmd = nodeside.command(sys.executable, "reap", "guard", var, mine, "1", "/bin/sh", "-c", "sleep 60 & sleep 60")
    g = subprocess.Popen([cmd[0], "-S", *cmd[1:]], env={**os.environ, var: mine}, stderr=subprocess.PIPE, text=True)
    stopped = _sleeper({var: mine})
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(1.0)
        g.terminate()
        assert g.wait(timeout=20) != 0
        assert "stopping launch" in g.stderr.read()
        assert stopped.wait(timeout=10) is not None
        assert json.loads(run("reap", var, mine, "1", "3").stdout) == {"found": [], "left": []}
    finally:
        for p in (g, stopped):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_parse_json_output_takes_the_last_object():
    assert nodeside.parse_json_output('noise\n{"a": 1}\n{"b": 2}\n[1]\n{bad\n') == {"b": 2}
    assert nodeside.parse_json_output("LISTENING 5\n") is None


def test_run_module_runs_a_package_sent_on_stdin(tmp_path):
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/tool.py", "import json, sys\nif __name__ == '__main__':\n"
                                  "    print(json.dumps({'argv': sys.argv[1:], 'file': __file__}))\n")
    cmd = nodeside.command(sys.executable, "run_module", "pkg.tool", "a b", "--x")
    out = subprocess.run([cmd[0], "-S", *cmd[1:]], input=buf.getvalue(), capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = nodeside.parse_json_output(out.stdout.decode())
    assert doc["argv"] == ["a b", "--x"] and ".zip" in doc["file"]
    assert not os.path.exists(doc["file"].split(".zip")[0] + ".zip")  # the archive is removed
    bad = subprocess.run([cmd[0], "-S", *cmd[1:]], input=b"not a zip", capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"not a zip archive" in bad.stderr


def test_calibration_runs_on_a_node_without_vpscluster(tmp_path):
    """The head node's python has torch but cannot import vpscluster: calibration still runs there,
    with the launcher's package sent along."""
    import dataclasses
    import sysconfig

    from vpscluster.cluster.inventory import local_cluster
    from vpscluster.plan.calibrate import calibrate_on_node
    from vpscluster.plan.shapes import ModelSpec
    from vpscluster.train.presets import ModelShape

    # -S: no site processing, so no editable-install .pth (no vpscluster); torch from site-packages.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{sysconfig.get_paths()["purelib"]}" exec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    check = subprocess.run([str(python), "-c", "import torch; import vpscluster"], capture_output=True, text=True,
                           timeout=120, cwd=str(tmp_path))
    assert "No module named 'vpscluster'" in check.stderr

    cluster = local_cluster()
    node = dataclasses.replace(cluster.head_node, python=str(python), workdir=str(tmp_path))
    cluster = dataclasses.replace(cluster, nodes=(node,))
    model = ModelSpec("tiny", ModelShape(d_model=32, n_layer=1, n_head=2, seq_len=16, batch_size=2))
    value = calibrate_on_node(cluster, model, threads=1, matmul_threads=1, timeout_s=300)
    assert 0 < value < 10


def test_torchrun_rendezvous_polls_its_store_faster_keeping_the_random_skew():
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic

    from vpscluster.nodeside import torchrun

    assert callable(dynamic._delay)  # the torch installed has the pause the wrapper shortens
    calls = []
    delay = torchrun.shorter_sync(calls.append)
    delay(1)
    delay((0, 0.3))
    delay(0.05)
    assert calls == [torchrun.SYNC_POLL_S, (0, 0.3), 0.05]
