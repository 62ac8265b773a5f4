"""`vpscluster provision` on a real 2-node sandbox whose nodes have their own filesystem
(`--own-root`): ansible-core applies the tcp and firewall roles; --check changes nothing; a
second run reports no changes; the node's sysctls match the plan; the firewall lets peers and
SSH in and keeps a stranger on the same bridge out of the cluster's ports; the host's own
sysctls and nftables ruleset are untouched throughout. The env role installs vpscluster's whole
run-time closure (torch included) on both nodes, finds and fixes a hand-made change, records
each node's venv next to the cluster file, and `train --cluster` with the file unedited then
runs on the provisioned venvs.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from sandbox_fixtures import TEST_PREFIX, sandbox_unavailable_reason, ssh_run

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

HOST_SYSCTLS = ["net.core.rmem_max", "net.core.wmem_max", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
                "net.ipv4.tcp_congestion_control", "net.ipv4.tcp_mtu_probing", "net.ipv4.tcp_slow_start_after_idle"]
STORE_PORT, EXPORTER_PORT, USER_PORT = 29500, 9400, 5432
QUEUE_PORT = 4222  # telemetry.QUEUE_PORT: `vpscluster queue up`'s NATS clients


def host_state() -> dict:
    values = {k: Path("/proc/sys/" + k.replace(".", "/")).read_text().split() for k in HOST_SYSCTLS}
    ruleset = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, timeout=10).stdout
    return {"sysctls": values, "nft": ruleset, "sysctl.d": sorted(p.name for p in Path("/etc/sysctl.d").glob("*"))}


@pytest.fixture(scope="module")
def own_root():
    import shutil

    from vpscluster.cluster import sandbox
    from vpscluster.cluster.sandbox import rootfs

    why = sandbox_unavailable_reason() or rootfs.supported() or (None if shutil.which("nft") else "nft missing (apt-get install nftables)")
    if why:
        pytest.skip(f"sandbox unavailable: {why}")
    name = f"{TEST_PREFIX}pv-{secrets.token_hex(3)}"
    try:
        info = sandbox.up(name, nodes=2, bandwidth="1gbit", own_root=True)
        doc = yaml.safe_load(Path(info.cluster_file).read_text())
        doc["firewall"] = {"allow": [USER_PORT]}
        path = Path(info.state_dir) / "cluster-fw.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        yield info, str(path)
    finally:
        sandbox.down(name)


def provision(cli, cluster_file: str, *extra: str) -> dict:
    r = cli("provision", "--cluster", cluster_file, "--json", *extra, timeout=300)
    assert r.stdout.strip(), r.stderr
    report = json.loads(r.stdout)
    assert r.returncode == (0 if report["ok"] else 1)
    return report


@pytest.fixture
def stranger(own_root):
    """A namespace on the sandbox's bridge that is not a cluster node (like a scanner on the same LAN)."""
    from vpscluster.cluster.sandbox import netns

    info, _ = own_root
    tag = secrets.token_hex(3)
    ns, veth, peer = f"pvx-{tag}", f"pvx{tag}", f"pvy{tag}"
    address = info.gateway.rsplit(".", 1)[0] + ".250"
    try:
        netns.create_node(ns, veth, peer, info.bridge, f"{address}/24")
        yield ns
    finally:
        netns.delete_namespace(ns)
        netns.delete_link(veth)


def can_connect_from_ns(ns: str, address: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=2).close()"
    return subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", code], capture_output=True, timeout=20).returncode == 0


def can_connect_from_node(info, node: str, address: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=2).close()"
    return ssh_run(info, node, f"python3 -c \"{code}\"").returncode == 0


def test_provision_check_apply_idempotent_firewall_and_host_untouched(own_root, stranger, cli):
    info, cluster_file = own_root
    before = host_state()

    # --check: what would change; nothing changes.
    check = provision(cli, cluster_file, "--check", "--only", "tcp,firewall")
    assert check["ok"] and check["check"] and check["changed"] > 0, check
    assert all(n["status"] == "changed" for n in check["nodes"])
    assert any("net.ipv4.tcp_wmem" in line for line in check["nodes"][0]["changes"]), check["nodes"][0]["changes"]
    r = ssh_run(info, "node-1", "test -e /etc/sysctl.d/60-vpscluster-tcp.conf || echo absent; nft list tables")
    assert r.stdout.split() == ["absent"], r.stdout

    # Apply, then again: no changes.
    first = provision(cli, cluster_file, "--only", "tcp,firewall")
    assert first["ok"] and first["changed"] > 0, json.dumps(first)[-3000:]
    assert set(first["nodes"][0]["roles"]) == {"tcp", "firewall"}
    second = provision(cli, cluster_file, "--only", "firewall,tcp")
    assert second["ok"] and second["changed"] == 0 and second["summary"] == "no changes", second

    # The node's sysctls match the plan (16 MB maxima); what a namespace cannot set is reported.
    for n in info.nodes:
        r = ssh_run(info, n.name, "cat /proc/sys/net/ipv4/tcp_rmem /proc/sys/net/ipv4/tcp_wmem "
                                  "/proc/sys/net/ipv4/tcp_mtu_probing; cat /etc/sysctl.d/60-vpscluster-tcp.conf")
        lines = r.stdout.splitlines()
        assert int(lines[0].split()[2]) >= 16 << 20 and int(lines[1].split()[2]) >= 16 << 20, lines
        assert lines[2] == "1" and any(line.startswith("net.ipv4.tcp_wmem = ") for line in lines), lines
    reported = first["nodes"][0]["not_settable"]
    assert "net.core.default_qdisc" in reported and "network namespace" in reported["net.core.default_qdisc"]

    # Firewall: listeners on node-1; a peer reaches them, a stranger only SSH and the user's port.
    node1 = info.nodes[0].address
    listen = ("import socket,time\nss=[]\nfor p in (%d,%d,%d,%d):\n s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              " s.bind(('0.0.0.0',p)); s.listen(16); ss.append(s)\ntime.sleep(90)\n") % (STORE_PORT, EXPORTER_PORT, USER_PORT, QUEUE_PORT)
    ssh_run(info, "node-1", "cat > /tmp/pv-listen.py <<'EOF'\n" + listen + "EOF\n"
                            "nohup python3 /tmp/pv-listen.py >/dev/null 2>&1 &")
    deadline = time.monotonic() + 20
    while not can_connect_from_node(info, "node-2", node1, STORE_PORT):
        assert time.monotonic() < deadline, "the peer cannot reach the store port"
        time.sleep(0.5)
    assert can_connect_from_node(info, "node-2", node1, EXPORTER_PORT)
    assert can_connect_from_node(info, "node-2", node1, QUEUE_PORT)  # the queue: peers only
    assert not can_connect_from_ns(stranger, node1, STORE_PORT)
    assert not can_connect_from_ns(stranger, node1, QUEUE_PORT)
    assert not can_connect_from_ns(stranger, node1, EXPORTER_PORT)
    assert can_connect_from_ns(stranger, node1, 22)
    assert can_connect_from_ns(stranger, node1, USER_PORT)

    # The host (root namespace, own /etc) saw none of it.
    assert host_state() == before


def test_env_full_closure_identical_on_every_node_fixed_after_a_hand_change_and_trained_on(own_root, cli, tmp_path,
                                                                                           monkeypatch):
    """The env role with vpscluster's whole run-time closure (torch included): the same env hash
    on every node, idempotent, a hand-made change found by --check and fixed; then `train
    --cluster` runs on the provisioned venvs (every rank reports the venv's interpreter)."""
    import gzip

    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.provision import env, provision

    info, cluster_file = own_root
    cluster = load_cluster(cluster_file)
    reqs = env.pinned_requirements("vpscluster")
    assert "torch" in reqs and "numpy" in reqs, reqs
    # Offline: pip may use this machine's own wheel folders (find-links), never an index; what
    # they lack is re-packed from the files installed here.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    wheelhouse = env.build_wheelhouse(reqs, tmp_path / "wheels")

    def run(check: bool = False) -> dict:
        return provision(cluster, roles=["env"], check=check, wheelhouse=wheelhouse)

    first = run()
    assert first["ok"] and first["changed"] > 0, json.dumps(first)[-3000:]
    hashes = set()
    for n in info.nodes:
        venv = f"{n.workdir}/venv"
        r = ssh_run(info, n.name, f"cat {venv}/vpscluster-env.json && echo && {venv}/bin/python -c "
                                  f"'import torch, yaml; print(torch.__version__, yaml.__version__)'")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout[:r.stdout.rindex("}") + 1])
        hashes.add(doc["env_hash"])
        assert r.stdout.split()[-2:] == [reqs["torch"], reqs["pyyaml"]], r.stdout[-200:]
        assert not Path(venv).exists()  # on the node's own disk only
    assert hashes == {first["env"]["hash"]}
    for n, rec in zip(info.nodes, first["nodes"]):  # recorded next to the cluster file: launches run it
        assert f"launches on {n.name} now run {n.workdir}/venv/bin/python" in " ".join(rec["notes"]), rec["notes"]
    assert first["env"]["record"] == str(Path(cluster_file).parent / ".vpscluster" / "cluster-fw.venv.json")
    # CPU nodes: the CUDA/driver check says so, without failing anything.
    assert [n["gpu_check"]["status"] for n in first["nodes"]] == ["no GPU", "no GPU"], first["nodes"]
    assert run()["summary"] == "no changes"

    # By hand on node-2: a package removed, and torch at another version. No other torch wheel
    # exists offline, so the other version is its installed metadata's (what pip and
    # importlib.metadata read; what a hand-installed torch changes). --check finds both on
    # node-2 only; provision fixes them.
    venv2 = f"{info.nodes[1].workdir}/venv"
    meta = f"{venv2}/lib/python{env.python_version()}/site-packages/torch-{reqs['torch']}.dist-info/METADATA"
    r = ssh_run(info, "node-2", f"{venv2}/bin/python -m pip uninstall -y -q mdurl && "
                                f"sed -i 's/^Version: .*/Version: 2.12.0/' {meta}")
    assert r.returncode == 0, r.stderr
    check = run(check=True)
    by_node = {n["name"]: n for n in check["nodes"]}
    assert by_node["node-1"]["changed"] == 0 and by_node["node-2"]["changed"] == 1, check
    said = " ".join(by_node["node-2"]["changes"])
    assert f"mdurl {reqs['mdurl']} installed" in said and f"torch 2.12.0 -> {reqs['torch']}" in said, said
    fixed = run()
    assert fixed["ok"] and {n["name"]: n["changed"] for n in fixed["nodes"]} == {"node-1": 0, "node-2": 1}, fixed
    r = ssh_run(info, "node-2", f"{venv2}/bin/python -c 'import mdurl, torch; print(mdurl.__version__, torch.__version__)'")
    assert r.stdout.split() == [reqs["mdurl"], reqs["torch"]], (r.stdout, r.stderr)
    assert run()["summary"] == "no changes"

    # Train on the provisioned venvs with the cluster file as `sandbox up` wrote it: the record
    # says which python each node runs now (nobody edits the file by hand).
    corpus = tmp_path / "corpus.txt"
    with gzip.open(Path(__file__).resolve().parents[1] / "src" / "vpscluster" / "data" / "kjv.txt.gz", "rt") as f:
        corpus.write_text(f.read(200_000))
    r = cli("train", "--cluster", cluster_file, "--preset", "tiny", "--max-steps", "6", "--eval-every", "6",
            "--data", str(corpus), "--run-dir", str(tmp_path / "run"), "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["world_size"] == 2 and report["steps"] == 6
    assert [(p["python"], p["torch"]) for p in report["per_rank"]] == [
        (f"{n.workdir}/venv/bin/python", reqs["torch"]) for n in info.nodes], report["per_rank"]
    assert report["final_val_loss"] < report["initial_val_loss"], report


class BridgeCapture:
    """Every frame through a bridge port (node-1's host-side veth, in the root namespace), read
    with a raw AF_PACKET socket: what anyone on the sandbox's LAN could see of node-1."""

    def __init__(self, port: str):
        import socket
        import threading

        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.bind((port, 0))
        self.sock.settimeout(0.2)
        self.frames: list[bytes] = []
        self.running = True
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while self.running:
            try:
                self.frames.append(self.sock.recv(65535))
            except OSError:
                pass

    def stop(self) -> bytes:
        self.running = False
        self.thread.join(timeout=5)
        self.sock.close()
        return b"".join(self.frames)


def test_overlay_mesh_carries_traffic_encrypted_and_is_idempotent(own_root, cli):
    import shutil

    missing = [t for t in ("wg", "wireguard-go") if not shutil.which(t)]
    if missing:
        pytest.skip(f"overlay needs {', '.join(missing)} (apt-get install wireguard-tools wireguard-go)")
    info, cluster_file = own_root
    first = provision(cli, cluster_file, "--only", "overlay,firewall")
    assert first["ok"], first
    again = provision(cli, cluster_file, "--only", "overlay")
    assert again["ok"] and again["summary"] == "no changes", again
    for n in info.nodes:  # the private key stays on its node, readable by root only
        r = ssh_run(info, n.name, "stat -c %a /etc/vpscluster/wireguard.key && ip -o -4 addr show dev vpsc0")
        assert r.stdout.split()[0] == "600" and "10.77.0." in r.stdout, r.stdout + r.stderr

    def send(marker: str, to: str) -> None:
        listen = ("import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                  "s.bind(('0.0.0.0', 29501)); s.listen(1); s.settimeout(30); c,_=s.accept(); c.settimeout(10)\n"
                  "open('/tmp/pv-got','wb').write(c.recv(1000))\n")
        ssh_run(info, "node-1", "rm -f /tmp/pv-got; cat > /tmp/pv-l.py <<'EOF'\n" + listen + "EOF\n"
                                "nohup python3 /tmp/pv-l.py >/dev/null 2>&1 &")
        code = (f"import socket,time\nfor i in range(50):\n try: c=socket.create_connection(({to!r}, 29501), timeout=2); break\n"
                f" except OSError: time.sleep(0.2)\nc.sendall({marker!r}.encode()); c.close()\n")
        r = ssh_run(info, "node-2", "cat > /tmp/pv-s.py <<'EOF'\n" + code + "EOF\npython3 /tmp/pv-s.py")
        assert r.returncode == 0, r.stderr
        for _ in range(50):
            got = ssh_run(info, "node-1", "cat /tmp/pv-got 2>/dev/null").stdout
            if got:
                break
            time.sleep(0.2)
        assert got == marker

    # Over the overlay: the marker crosses the bridge only inside WireGuard's UDP.
    secret = f"pv-secret-{secrets.token_hex(8)}"
    cap = BridgeCapture(info.nodes[0].veth)
    send(secret, "10.77.0.1")
    seen = cap.stop()
    assert secret.encode() not in seen and (51820).to_bytes(2, "big") in seen
    # Control: over the underlay the same capture sees it in the clear.
    plain = f"pv-plain-{secrets.token_hex(8)}"
    cap = BridgeCapture(info.nodes[0].veth)
    send(plain, info.nodes[0].address)
    assert plain.encode() in cap.stop()
