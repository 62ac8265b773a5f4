"""Batch jobs on a real 3-node sandbox: Dask started over SSH (verified host keys), code synced.

Outputs equal a single-process run row for row; a node made busy by a foreign CPU hog inside
its cgroup stops receiving partitions (the assignment log says so) and receives them again
once the hog ends; a worker killed with kill -9 mid-job loses nothing and duplicates nothing;
GPU work goes only to nodes with a (declared) GPU resource; nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from sandbox_fixtures import SandboxFactory, ns_popen

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

FNS = textwrap.dedent('''
    import time

    def score(rows):
        return [{"id": r["id"], "n": len(r["text"]), "upper": r["text"].upper()} for r in rows]

    def slow(rows):
        time.sleep(0.25)
        return score(rows)
''')


@pytest.fixture(scope="module")
def sb():
    factory = SandboxFactory(kind="bj-")
    try:
        yield factory(nodes=3, bandwidth="1gbit", cpu=0.5)
    finally:
        factory.close()


@pytest.fixture
def code(tmp_path):
    d = tmp_path / "code"
    d.mkdir()
    (d / "batchfns.py").write_text(FNS)
    return d


def make_input(path: Path, rows: int) -> list[dict]:
    data = [{"id": i, "text": f"row {i} " + "ab" * (i % 7)} for i in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return data


def outputs(out: Path) -> list[dict]:
    rows = []
    for p in sorted(out.glob("part-*.jsonl")):
        rows += [json.loads(line) for line in p.read_text().splitlines()]
    return rows


def serial(rows):
    return [{"id": r["id"], "n": len(r["text"]), "upper": r["text"].upper()} for r in rows]


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "_assignments.jsonl").read_text().splitlines()]


def job_processes(info) -> dict[str, list[str]]:
    found = {}
    for n in info.nodes:
        pids = subprocess.run(["ip", "netns", "pids", n.namespace], capture_output=True, text=True, timeout=10).stdout.split()
        cmds = []
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "distributed.cli" in cmd:
                cmds.append(f"{pid} {cmd}")
        found[n.name] = cmds
    return found


def batch_argv(info, code, data, out, *extra):
    return [sys.executable, "-m", "vpscluster", "batch", "--cluster", info.cluster_file, "--fn", extra[0],
            "--input", str(data), "--output", str(out), "--code", str(code), "--json", *extra[1:]]


def test_outputs_equal_serial_on_three_nodes(sb, cli, code, tmp_path):
    rows = make_input(tmp_path / "in.jsonl", 300)
    out = tmp_path / "out"
    (code / ".env").write_text("API_TOKEN=s3cret\n")  # beside the module: never sent, and said so
    (code / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    r = cli("batch", "--cluster", sb.cluster_file, "--fn", "batchfns:score", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(out), "--code", str(code), "--partition-rows", "10", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    said = " ".join(r.stderr.split())  # the console wraps long lines
    assert f"sync code: {code}: 1 file (" in said and "left out as possible secrets: .env, id_ed25519" in said, said
    doc = json.loads(r.stdout)
    assert doc["partitions_done"] == 30 and doc["rows_out"] == 300
    assert set(doc["nodes"]) == {"node-1", "node-2", "node-3"}
    assert all(v["workers"] == 1 for v in doc["nodes"].values())  # 0.5 core each: one worker
    assert sum(1 for v in doc["per_node"].values() if v["partitions"]) >= 2
    assert outputs(out) == serial(rows)
    assert job_processes(sb) == {n.name: [] for n in sb.nodes}


def test_busy_node_gets_no_partitions_until_load_ends(sb, code, tmp_path):
    rows = make_input(tmp_path / "in.jsonl", 90)
    out = tmp_path / "out"
    hogs = [ns_popen(sb, "node-2", [sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    hog_ended = {}

    def end_hog_once_refused():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "_assignments.jsonl").exists() and any(
                    e["event"] == "admission" and e["node"] == "node-2" and not e["admitted"] for e in log(out)):
                time.sleep(3)
                break
            time.sleep(0.2)
        for h in hogs:
            h.kill()
            h.wait()
        hog_ended["t"] = time.time()

    stopper = threading.Thread(target=end_hog_once_refused, daemon=True)
    try:
        time.sleep(1.0)
        stopper.start()
        p = subprocess.run(batch_argv(sb, code, tmp_path / "in.jsonl", out, "batchfns:slow", "--partition-rows", "1",
                                      "--max-load", "0.6", "--no-speculation"),
                           capture_output=True, text=True, timeout=300)
    finally:
        stopper.join(timeout=130)
        for h in hogs:
            if h.poll() is None:
                h.kill()
                h.wait()
    assert p.returncode == 0, p.stderr[-3000:]
    events = log(out)
    adm = [e for e in events if e["event"] == "admission" and e["node"] == "node-2"]
    assert adm and not adm[0]["admitted"], events[:10]
    refused_at = adm[0]["t"]
    readmitted = [e["t"] for e in adm if e["admitted"]]
    assert readmitted, f"node-2 was never admitted again: {adm}"
    assert readmitted[0] >= hog_ended["t"] - 0.5
    # While refused, node-2 was handed nothing; after the load ended it got partitions again.
    during = [e for e in events if e["event"] == "assign" and e["node"] == "node-2" and refused_at < e["t"] < readmitted[0]]
    after = [e for e in events if e["event"] == "assign" and e["node"] == "node-2" and e["t"] > readmitted[0]]
    assert during == []
    assert after, "node-2 got no partition after its load ended"
    assert outputs(out) == serial(rows)


def test_worker_killed_mid_job_loses_nothing(sb, code, tmp_path):
    rows = make_input(tmp_path / "in.jsonl", 120)
    out = tmp_path / "out"
    p = subprocess.Popen(batch_argv(sb, code, tmp_path / "in.jsonl", out, "batchfns:slow", "--partition-rows", "2"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and killed is None and p.poll() is None:
        if len(list(out.glob("part-*"))) >= 8:
            for line in job_processes(sb)["node-3"]:
                if "dask_worker" in line:
                    killed = int(line.split()[0])
                    os.kill(killed, signal.SIGKILL)
        time.sleep(0.1)
    stdout, stderr = p.communicate(timeout=300)
    assert killed is not None, "no worker was found to kill"
    assert p.returncode == 0, stderr[-3000:]
    doc = json.loads(stdout)
    assert "node-3/0" in doc["workers_lost"]
    assert doc["partitions_done"] == 60
    assert sorted(f.name for f in out.glob("part-*")) == [f"part-{i:05d}.jsonl" for i in range(60)]
    assert outputs(out) == serial(rows)  # no partition missing, none twice
    done = [e["partition"] for e in log(out) if e["event"] == "done"]
    assert sorted(done) == list(range(60))
    assert job_processes(sb) == {n.name: [] for n in sb.nodes}


def test_gpu_work_runs_only_on_gpu_nodes(sb, code, tmp_path):
    doc = yaml.safe_load(Path(sb.cluster_file).read_text())
    doc["nodes"][2]["labels"] = {**doc["nodes"][2].get("labels", {}), "gpus": "1"}
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(doc))
    rows = make_input(tmp_path / "in.jsonl", 40)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "vpscluster", "batch", "--cluster", str(cluster_file), "--fn",
                        "batchfns:score", "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--code",
                        str(code), "--partition-rows", "5", "--gpu", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert {n for n, v in doc["per_node"].items() if v["partitions"]} == {"node-3"}
    assert outputs(out) == serial(rows)
