"""`vpscluster exec` against a real 3-node sandbox: prefixed output, collected exit codes, a failing
node reported; host-key refusal (unknown, changed) and trust-on-first-use; a node whose link is
down reported within the configured connect time-out instead of a hang.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.sandbox]


def variant(info, tmp_path: Path, **changes) -> str:
    """A copy of the sandbox's cluster file with top-level keys changed (e.g. known_hosts)."""
    doc = yaml.safe_load(Path(info.cluster_file).read_text())
    doc.update(changes)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def test_exec_prefixes_output_and_reports_the_failing_node(sandbox3, cli):
    r = cli("exec", "--cluster", sandbox3.cluster_file, "--", "echo from-$(hostname); test $(hostname) != node-2 || exit 3",
            timeout=120)
    assert r.returncode != 0  # node-2 failed
    lines = (r.stdout + r.stderr).splitlines()
    for n in sandbox3.nodes:  # each node's line carries its own name as prefix, and ran on that node
        assert any(line.startswith(n.name) and line.rstrip().endswith(f"from-{n.name}") for line in lines), lines
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("node-") and "│" in line}
    assert rows["node-2"][2] == "3" and rows["node-1"][2] == "0" and rows["node-3"][2] == "0", rows

    ok = cli("exec", "--cluster", sandbox3.cluster_file, "--json", "--", "hostname", timeout=120)
    assert ok.returncode == 0, ok.stderr
    results = json.loads(ok.stdout)["results"]
    assert [(x["node"], x["exit_status"], x["stdout"].strip()) for x in results] == [
        (n.name, 0, n.name) for n in sandbox3.nodes]


def test_unknown_host_refused_accept_new_records_changed_refused(sandbox3, cli, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    cluster = variant(sandbox3, tmp_path, known_hosts=str(empty))
    r = cli("exec", "--cluster", cluster, "--json", "--", "true", timeout=120)
    assert r.returncode != 0
    results = json.loads(r.stdout)["results"]
    assert all(x["exit_status"] is None and "host key" in (x["error"] or "").lower() for x in results), results
    assert empty.read_text() == ""  # refused, nothing recorded

    r = cli("exec", "--cluster", cluster, "--accept-new-host-keys", "--", "true", timeout=120)
    assert r.returncode == 0, r.stderr
    recorded = {tuple(line.split()[:3]) for line in empty.read_text().splitlines() if line.strip()}
    expected = {tuple(line.split()[:3]) for line in Path(sandbox3.known_hosts).read_text().splitlines()}
    assert recorded == expected  # exactly the keys the sandbox generated

    # node-1 now presents a key other than the recorded one: refused, even with accept-new.
    lines = Path(sandbox3.known_hosts).read_text().splitlines()
    n1, n2 = sandbox3.nodes[0].address, sandbox3.nodes[1].address
    wrong = [f"{n1} {line.split(' ', 1)[1]}" for line in lines if line.startswith(n2 + " ")]
    empty.write_text("\n".join([line for line in lines if not line.startswith(n1 + " ")] + wrong) + "\n")
    r = cli("exec", "--cluster", cluster, "--accept-new-host-keys", "--json", "--", "true", timeout=120)
    assert r.returncode != 0
    by_node = {x["node"]: x for x in json.loads(r.stdout)["results"]}
    assert by_node["node-1"]["exit_status"] is None and "host key" in by_node["node-1"]["error"].lower()
    assert by_node["node-2"]["exit_status"] == 0 and by_node["node-3"]["exit_status"] == 0


def test_link_down_is_a_clear_error_within_the_timeout(sandbox3, cli, tmp_path):
    from vpscluster.cluster import sandbox

    connect_timeout_s = 3
    cluster = variant(sandbox3, tmp_path, connect_timeout_s=connect_timeout_s)
    sandbox.set_link(sandbox3.name, "node-2", up=False)
    try:
        t0 = time.monotonic()
        r = cli("exec", "--cluster", cluster, "--json", "--", "true", timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        sandbox.set_link(sandbox3.name, "node-2", up=True)
    assert r.returncode != 0
    by_node = {x["node"]: x for x in json.loads(r.stdout)["results"]}
    assert by_node["node-1"]["exit_status"] == 0 and by_node["node-3"]["exit_status"] == 0
    err = by_node["node-2"]["error"] or ""
    assert by_node["node-2"]["exit_status"] is None and err and "\n" not in err
    assert sandbox3.node("node-2").address in err or "node-2" in err, err
    # Time-out plus start-up of the CLI (slow on a loaded 2-core machine), but no hang.
    assert elapsed < connect_timeout_s + 20, f"took {elapsed:.1f} s with connect_timeout_s={connect_timeout_s}"
    assert by_node["node-2"]["duration_s"] < connect_timeout_s + 2


def test_a_node_cut_off_mid_command_is_lost_within_dead_after_s(sandbox3, tmp_path):
    """A started command on a node whose link goes down (no FIN, no RST: nothing arrives) ends
    as lost once the node has answered no SSH keepalive for `dead_after_s`, not at a TCP time-out."""
    import asyncio

    from vpscluster.cluster import sandbox
    from vpscluster.cluster.inventory import executor_for, load_cluster

    dead_after_s = 6.0
    cluster = load_cluster(variant(sandbox3, tmp_path, dead_after_s=dead_after_s, command_timeout_s=300))
    lines: list[str] = []

    async def main() -> tuple[int | None, float, str | None]:
        ex = executor_for(cluster.node("node-2"), cluster)
        try:
            handle = await ex.start("echo started; sleep 120", on_line=lambda stream, line: lines.append(line))
            for _ in range(100):
                if "started" in lines:
                    break
                await asyncio.sleep(0.1)
            assert "started" in lines, lines
            sandbox.set_link(sandbox3.name, "node-2", up=False)
            t0 = time.monotonic()
            status = await handle.wait(60)
            took = time.monotonic() - t0
            # Right after the loss the next call fails at once (no connect time-out per call)...
            t1 = time.monotonic()
            again = await ex.run(["true"], timeout_s=30)
            again_s = time.monotonic() - t1
            # ...and once the node answers and dead_after_s has passed, it is reached again.
            sandbox.set_link(sandbox3.name, "node-2", up=True)
            await asyncio.sleep(max(0.0, t0 + took + dead_after_s + 0.5 - time.monotonic()))
            later = await ex.run(["true"], timeout_s=30)
            return status, took, handle.error, again, again_s, later
        finally:
            sandbox.set_link(sandbox3.name, "node-2", up=True)
            await ex.close()

    status, took, error, again, again_s, later = asyncio.run(main())
    assert status == 255, (status, took)
    assert "node-2" in (error or "") and "keepalive" in error, error
    assert dead_after_s - 2 < took < dead_after_s + 3, f"lost after {took:.1f} s with dead_after_s={dead_after_s}"
    assert not again.ok and "keepalive" in (again.error or "") and again_s < 1.0, (again, again_s)
    assert later.ok, later
