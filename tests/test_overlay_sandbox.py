"""After `vpscluster provision` made the WireGuard overlay, `train --cluster` binds to it by itself:
on a real 2-node sandbox with per-node filesystems, the launch's rendezvous endpoint, each node's
--local-addr and GLOO/NCCL_SOCKET_IFNAME are the overlay's, the gradients' bytes show up on the
WireGuard interface's counters, and a node whose overlay went down is refused before anything
starts, with the fix."""

from __future__ import annotations

import gzip
import json
import secrets
import shutil
from pathlib import Path

import pytest
import yaml

from sandbox_fixtures import TEST_PREFIX, sandbox_unavailable_reason, ssh_run

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def lend_host_python(info) -> None:
    """This machine's interpreter (and the torch of its venv) on every node, read-only, as on a VPS
    image with Python preinstalled: own-root nodes see the host's files, but /root is each node's
    fresh home, and the interpreter behind the venv may live there (pyenv). Bound inside the
    node's mount namespace (where its sshd runs), so the host sees nothing of it."""
    import subprocess
    import sys

    # The interpreter and the venv (a fresh clone may live under /tmp, which is each node's own).
    hidden = [p for p in dict.fromkeys((sys.base_prefix, sys.prefix))
              if p == "/root" or p.startswith(("/root/", "/tmp/"))]
    for n in info.nodes:
        node_dir = Path(info.state_dir) / "nodes" / n.name
        pid = (node_dir / "sshd.pid").read_text().strip()
        merged = node_dir / "rootfs" / "merged"
        for prefix in hidden:
            subprocess.run(["nsenter", "-t", pid, "-m", "--", "sh", "-c",
                            'mkdir -p "$1$2" && mount --bind "$2" "$1$2" && mount -o remount,bind,ro "$1$2"',
                            "sh", str(merged), prefix], check=True, timeout=30)


@pytest.fixture(scope="module")
def meshed(tmp_path_factory):
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.cluster.sandbox import rootfs
    from vpscluster.provision import provision

    why = sandbox_unavailable_reason() or rootfs.supported()
    missing = [t for t in ("wg", "wireguard-go", "nft") if not shutil.which(t)]
    if why or missing:
        pytest.skip(f"sandbox unavailable: {why or 'missing ' + ', '.join(missing)}")
    name = f"{TEST_PREFIX}ov-{secrets.token_hex(3)}"
    try:
        info = sandbox.up(name, nodes=2, bandwidth="1gbit", own_root=True)
        lend_host_python(info)
        report = provision(load_cluster(info.cluster_file), roles=["overlay", "firewall"])
        assert report["ok"], report
        root = tmp_path_factory.mktemp("overlay-train")
        corpus = root / "corpus.txt"
        with gzip.open(REPO / "src" / "vpscluster" / "data" / "kjv.txt.gz", "rt") as f:
            corpus.write_text(f.read(100_000))
        config = root / "c.yaml"
        config.write_text(yaml.safe_dump({"preset": "tiny", "data": str(corpus), "batch_size": 2, "eval_batches": 1,
                                          "eval_every": 100, "checkpoint_every": 100, "threads_per_rank": 1}))
        yield info, report, root, config
    finally:
        sandbox.down(name)


class Listeners:
    """Every TCP listener seen in the nodes' network namespaces (`ss -ltnp`, polled) while the
    `with` block runs: {node: {(local address:port, process)}}."""

    def __init__(self, info, nodes=("node-1", "node-2"), every_s: float = 0.2):
        self.info, self.nodes, self.every_s = info, nodes, every_s
        self.seen: dict[str, set] = {n: set() for n in nodes}

    def _poll(self) -> None:
        import re
        import subprocess

        while not self._done.wait(self.every_s):
            for n in self.nodes:
                r = subprocess.run(["ip", "netns", "exec", self.info.node(n).namespace, "ss", "-Hltnp"],
                                   capture_output=True, text=True, timeout=30)
                for line in r.stdout.splitlines():
                    proc = re.search(r'users:\(\("([^"]+)"', line)
                    self.seen[n].add((line.split()[3], proc.group(1) if proc else "?"))

    def __enter__(self):
        import threading

        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(30)

    def wide(self) -> dict[str, set]:
        """The listeners on every interface (0.0.0.0, [::], *), per node."""
        return {n: {x for x in seen if x[0].rsplit(":", 1)[0] in ("0.0.0.0", "[::]", "*", "[::ffff:0.0.0.0]")}
                for n, seen in self.seen.items()}


def counters(info, node: str) -> dict[str, int]:
    """Bytes received + sent per interface in the node's network namespace."""
    r = ssh_run(info, node, "cat /proc/net/dev")
    out = {}
    for line in r.stdout.splitlines()[2:]:
        name, _, rest = line.partition(":")
        f = rest.split()
        out[name.strip()] = int(f[0]) + int(f[8])
    return out


def test_train_runs_over_the_overlay_by_itself(meshed, cli):
    info, report, root, config = meshed
    addresses = report["overlay"]["addresses"]
    assert addresses == {"node-1": "10.77.0.1", "node-2": "10.77.0.2"}
    underlay = {n.name: n.address for n in info.nodes}
    r = ssh_run(info, "node-1", f"ip -o -4 addr show | grep ' {underlay['node-1']}/' | awk '{{print $2}}'")
    eth = r.stdout.strip().split("@")[0]
    assert eth and eth != "vpsc0", r.stdout + r.stderr

    before = counters(info, "node-1")
    run_dir = root / "run"
    with Listeners(info) as listening:
        r = cli("train", "--cluster", info.cluster_file, "--config", str(config), "--max-steps", "2",
                "--run-dir", str(run_dir), "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    after = counters(info, "node-1")
    doc = json.loads(r.stdout)
    assert doc["world_size"] == 2 and doc["steps"] == 2

    # Nothing of the run listened on every interface: torch's rendezvous store (which did,
    # whatever --local-addr said), the store rank 0 shares, gloo, the exporters: overlay only.
    assert listening.wide() == {"node-1": set(), "node-2": set()}, listening.seen

    # The launch bound everything to the overlay: rendezvous, advertised addresses, gloo's interface.
    log = (run_dir / "logs" / "node-1.log").read_text() + (run_dir / "logs" / "node-2.log").read_text()
    assert "--rdzv-endpoint 10.77.0.1:" in log, log[:2000]
    store = "10.77.0.1:" + log.split("--rdzv-endpoint 10.77.0.1:", 1)[1].split()[0]
    assert store in {a for a, _ in listening.seen["node-1"]}, listening.seen  # the rendezvous store, bound
    assert "--local-addr 10.77.0.1" in log and "--local-addr 10.77.0.2" in log
    assert "GLOO_SOCKET_IFNAME=vpsc0" in log and underlay["node-1"] not in log.split("--rdzv-endpoint", 1)[1].split()[0]

    # Pre-flight's quick probe (saved) reports the provisioning state and what the overlay costs.
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.probe.store import load_probe

    probe = load_probe(load_cluster(info.cluster_file))
    prov = probe["provisioning"]
    assert prov["overlay_up"] is True and prov["firewall_up"] is True and prov["tcp_tuned"] is False, prov
    assert {p["name"]: p["overlay_address"] for p in prov["nodes"]} == addresses
    cost = probe["overlay_cost"]
    assert {(c["src"], c["dst"]) for c in cost["links"]} == {("node-1", "node-2"), ("node-2", "node-1")}
    assert all(c["overlay_mbit"] > 0 and c["underlay_mbit"] > 0 for c in cost["links"]), cost
    assert 0 < cost["bandwidth_ratio"] < 5 and cost["rtt_added_ms"] is not None, cost

    # The gradients crossed the WireGuard interface (and the underlay carried them, encrypted).
    sent = max(doc["bytes_sent"]) if isinstance(doc["bytes_sent"], list) else doc["bytes_sent"]
    wg = after["vpsc0"] - before["vpsc0"]
    assert sent > 0 and wg >= sent, (wg, sent)
    assert after[eth] - before[eth] >= wg, (after[eth] - before[eth], wg)


def test_batch_workers_join_the_scheduler_over_the_overlay(meshed, cli):
    """Dask too: the workers listen on and reach the scheduler at overlay addresses (their own
    log lines say where), while this machine's client reaches the scheduler through an SSH tunnel
    to the head: nothing of Dask listens on the underlay or on every interface."""
    from vpscluster.jobs.outputs import LOG_DIR

    info, _, root, _ = meshed
    code = root / "code"
    code.mkdir(exist_ok=True)
    (code / "ovfns.py").write_text("def score(rows):\n    return [{'id': r['id'], 'n': len(r['text'])} for r in rows]\n")
    data = root / "in.jsonl"
    data.write_text("".join(json.dumps({"id": i, "text": "x" * i}) + "\n" for i in range(40)))
    out = root / "batch-out"
    with Listeners(info) as listening:
        r = cli("batch", "--cluster", info.cluster_file, "--fn", "ovfns:score", "--input", str(data), "--output", str(out),
                "--code", str(code), "--partition-rows", "10", "--json", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    # The scheduler listened on 0.0.0.0 for this machine's client; now on the overlay only (the
    # client comes through an SSH tunnel to the head), as the workers.
    assert listening.wide() == {"node-1": set(), "node-2": set()}, listening.seen
    dask = {a for a, proc in listening.seen["node-1"] if proc.startswith("python")}
    assert any(a.startswith("10.77.0.1:") for a in dask), listening.seen
    assert all(a.startswith(("10.77.0.1:", "127.0.0.1:")) for a in dask), listening.seen  # HTTP routes: loopback
    assert json.loads(r.stdout)["rows_out"] == 40
    logs = "".join(p.read_text() for p in (out / LOG_DIR).glob("*.log"))
    assert "tcp://10.77.0.1:" in logs and "tcp://10.77.0.2:" in logs, logs[-3000:]
    underlay = [n.address for n in info.nodes]
    assert not any(f"Start worker at:       tcp://{a}" in logs for a in underlay)


def test_monitoring_scrapes_the_nodes_over_the_overlay(meshed, cli):
    """Exporters listen on the overlay's addresses (Prometheus on the head scrapes them over the
    mesh); Prometheus itself on the head's overlay address too (it listened on the head's
    underlay address, unauthenticated), and this machine queries it through an SSH tunnel."""
    import time

    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.monitor import query

    info, _, _, _ = meshed
    r = cli("monitor", "up", "--cluster", info.cluster_file, "--scrape-interval", "1", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(r.stdout)
    try:
        assert {n: e["address"] for n, e in rec["node_exporters"].items()} == {"node-1": "10.77.0.1", "node-2": "10.77.0.2"}
        assert rec["url"].startswith("http://10.77.0.1:") and rec["tunnel"] is True, rec
        with Listeners(info, every_s=0.1) as listening:
            time.sleep(0.5)
        assert listening.wide() == {"node-1": set(), "node-2": set()}, listening.seen
        assert any(proc == "prometheus" and a.startswith("10.77.0.1:") for a, proc in listening.seen["node-1"])
        prom = query.prometheus_for(load_cluster(info.cluster_file))
        deadline = time.monotonic() + 60
        up: list = []
        while time.monotonic() < deadline:
            up = sorted(t["labels"]["node"] for t in prom.targets() if t["health"] == "up")
            if up == ["node-1", "node-2"]:
                break
            time.sleep(1)
        assert up == ["node-1", "node-2"], prom.targets()
        prom.close()
    finally:
        down = cli("monitor", "down", "--cluster", info.cluster_file, timeout=120)
    assert down.returncode == 0, down.stderr


def test_a_node_whose_overlay_is_down_is_refused_with_the_fix(meshed, cli):
    info, _, root, config = meshed
    assert ssh_run(info, "node-2", "ip link del vpsc0").returncode == 0
    try:
        r = cli("train", "--cluster", info.cluster_file, "--config", str(config), "--max-steps", "1",
                "--run-dir", str(root / "refused"), "--json", timeout=120)
        assert r.returncode != 0
        line = r.stderr.strip().splitlines()[-1]
        assert "node node-2: the overlay is not up there (vpsc0 does not carry 10.77.0.2)" in line, r.stderr
        assert "--only overlay" in line
    finally:
        from vpscluster.cluster.inventory import load_cluster
        from vpscluster.provision import provision

        assert provision(load_cluster(info.cluster_file), roles=["overlay"])["ok"]


def test_pre_flight_asks_every_public_node_for_its_firewall(meshed):
    """The probe's `firewall_up` never blocked a launch. The same nodes as if they had public
    addresses (203.0.113.x, each reached through its real SSH connection): with provision's
    firewall loaded, pre-flight passes; with node-2's table deleted, it refuses, naming node-2 and
    the fix."""
    import asyncio
    import dataclasses

    from vpscluster.cluster.inventory import load_cluster, open_executors
    from vpscluster.cluster.netsafety import require_firewall
    from vpscluster.errors import UserError

    info = meshed[0]
    cluster = load_cluster(info.cluster_file)
    public = dataclasses.replace(cluster, nodes=tuple(dataclasses.replace(n, host=f"203.0.113.{i + 10}")
                                                      for i, n in enumerate(cluster.nodes)))

    async def check() -> None:
        async with open_executors(cluster) as executors:
            await require_firewall(public, executors, timeout_s=30)

    asyncio.run(check())
    saved = ssh_run(info, "node-2", "nft list table inet vpscluster").stdout
    assert "table inet vpscluster" in saved
    assert ssh_run(info, "node-2", "nft delete table inet vpscluster").returncode == 0
    try:
        with pytest.raises(UserError) as e:
            asyncio.run(check())
        msg = str(e.value)
        assert "the firewall is not up on node-2 (203.0.113.11)" in msg and "node-1" not in msg, msg
        assert "--only overlay,firewall" in msg
    finally:
        assert ssh_run(info, "node-2", f"nft -f - <<'EOF'\n{saved}\nEOF").returncode == 0
