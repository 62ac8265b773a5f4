"""What `vpscluster provision` leaves on a node, checked for real on one 2-node sandbox whose nodes
have their own filesystem (`--own-root`):

- a rebooted node (`sandbox fault reboot`: processes killed, interfaces deleted, nftables ruleset
  flushed, then the units the node enabled in its own /etc started as a boot would) comes back
  with its firewall and its WireGuard interface, traffic crosses the overlay again, and the
  supervised wireguard-go comes back after it dies;
- the controller (this machine) gets SSH and nothing else;
- the firewall's ICMP echo rate limit holds against a ping flood;
- a cluster-file `workdir` holding an Ansible lookup reaches the node as text and runs nothing here.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from sandbox_fixtures import TEST_PREFIX, sandbox_unavailable_reason, ssh_run

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

STORE_PORT = 29500
# ICMP echo without the ping binary (not on every image): `python3 - DST COUNT GAP_S` sends COUNT
# echo requests GAP_S apart on a raw socket, then prints how many were sent and answered.
PINGER = r"""
import os, socket, struct, sys, time
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b)); s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
dst, count, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
ident = os.getpid() & 0xffff
for seq in range(count):
    s.sendto(struct.pack("!BBHHH", 8, 0, csum(struct.pack("!BBHHH", 8, 0, 0, ident, seq) + b"vpsc"), ident, seq) + b"vpsc",
             (dst, 0))
    time.sleep(gap)
got, end = set(), time.time() + 1.5
s.settimeout(0.2)
while time.time() < end:
    try:
        data = s.recv(2048)
    except socket.timeout:
        continue
    t, _, _, i, q = struct.unpack("!BBHHH", data[(data[0] & 15) * 4:][:8])
    if t == 0 and i == ident:
        got.add(q)
print(count, len(got))
"""


def ping_here(address: str, count: int, gap_s: float) -> tuple[int, int]:
    import sys

    r = subprocess.run([sys.executable, "-", address, str(count), str(gap_s)], input=PINGER, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    sent, got = r.stdout.split()
    return int(sent), int(got)


def ping_from(info, node: str, address: str, count: int, gap_s: float) -> tuple[int, int]:
    r = ssh_run(info, node, f"cat > /tmp/rb-ping.py <<'EOF'\n{PINGER}EOF\npython3 /tmp/rb-ping.py {address} {count} {gap_s}",
                timeout_s=60)
    assert r.returncode == 0, r.stderr
    sent, got = r.stdout.split()
    return int(sent), int(got)


@pytest.fixture(scope="module")
def provisioned():
    """2 own-root nodes, provisioned with the overlay and the firewall; the controller's address
    (this machine, the sandbox's gateway) written in the cluster file as firewall.controller."""
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.cluster.sandbox import rootfs
    from vpscluster.provision import provision

    missing = [t for t in ("wg", "wireguard-go", "nft") if not shutil.which(t)]
    why = sandbox_unavailable_reason() or rootfs.supported() or (f"missing {', '.join(missing)}" if missing else None)
    if why:
        pytest.skip(f"sandbox unavailable: {why}")
    name = f"{TEST_PREFIX}rb-{secrets.token_hex(3)}"
    try:
        info = sandbox.up(name, nodes=2, bandwidth="1gbit", own_root=True)
        doc = yaml.safe_load(Path(info.cluster_file).read_text())
        doc["firewall"] = {"controller": [info.gateway]}
        path = Path(info.state_dir) / "cluster-fw.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        report = provision(load_cluster(str(path)), roles=["overlay", "firewall"])
        assert report["ok"], json.dumps(report)[-3000:]
        yield info, str(path)
    finally:
        sandbox.down(name)


def listen_on(info, node: str, port: int, seconds: int = 60) -> None:
    code = ("import socket,time\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('0.0.0.0', {port})); s.listen(8); time.sleep({seconds})\n")
    r = ssh_run(info, node, f"cat > /tmp/rb-listen-{port}.py <<'EOF'\n{code}EOF\n"
                            f"nohup python3 /tmp/rb-listen-{port}.py >/dev/null 2>&1 &")
    assert r.returncode == 0, r.stderr


def connects_from_node(info, node: str, address: str, port: int, within_s: float = 0.0) -> bool:
    code = (f"import socket,time\nt=time.time()+{within_s}\nwhile True:\n"
            f" try: socket.create_connection(({json.dumps(address)}, {port}), timeout=2).close(); break\n"
            f" except OSError:\n  if time.time() > t: raise\n  time.sleep(0.3)\n")
    r = ssh_run(info, node, f"python3 -c '{code}'", timeout_s=within_s + 30)
    return r.returncode == 0


def connects_from_here(address: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def node_state(info, node: str) -> dict:
    """The node's firewall table, its overlay address, and its wireguard-go processes (nodes share
    the host's pid namespace: processes are told apart by their network namespace)."""
    r = ssh_run(info, node, "nft list table inet vpscluster >/dev/null 2>&1 && echo nft; "
                            "ip -o -4 addr show dev vpsc0 2>/dev/null")
    pids = subprocess.run(["ip", "netns", "pids", info.node(node).namespace], capture_output=True, text=True,
                          timeout=10).stdout.split()
    wg = []
    for p in pids:
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() == "wireguard-go":
                wg.append(int(p))
        except OSError:
            pass
    return {"nft": "nft" in r.stdout.split(), "vpsc0": re.findall(r"inet (10\.77\.0\.\d+)/", r.stdout), "wireguard-go": wg}


def test_a_rebooted_node_comes_back_with_its_firewall_and_overlay(provisioned, cli):
    info, _ = provisioned
    # What a boot follows: enabled in the node's own /etc (never the host's).
    r = ssh_run(info, "node-2", "ls /etc/systemd/system/sysinit.target.wants/ /etc/systemd/system/multi-user.target.wants/;"
                                " grep -c include /etc/nftables.conf")
    assert "nftables.service" in r.stdout and "vpscluster-overlay.service" in r.stdout, r.stdout + r.stderr
    assert not Path("/etc/systemd/system/multi-user.target.wants/vpscluster-overlay.service").exists()
    before = node_state(info, "node-2")
    assert before["nft"] and before["vpsc0"] == ["10.77.0.2"] and before["wireguard-go"], before

    out = cli("sandbox", "fault", "--name", info.name, "--node", "node-2", "reboot", "--json", timeout=180)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert set(before["wireguard-go"]) & set(record["killed"]), record  # its TUN device went with it
    assert record["units"] == {"nftables.service": "started", "vpscluster-overlay.service": "started"}, record

    # Back: the ruleset, the interface (a new wireguard-go), and traffic across the overlay both ways.
    deadline = time.monotonic() + 20
    while (after := node_state(info, "node-2"))["vpsc0"] != ["10.77.0.2"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.5)
    assert after["nft"] and after["wireguard-go"] and not set(after["wireguard-go"]) & set(before["wireguard-go"])
    listen_on(info, "node-2", STORE_PORT)
    assert connects_from_node(info, "node-1", "10.77.0.2", STORE_PORT, within_s=20)
    assert ping_from(info, "node-2", "10.77.0.1", 3, 0.3)[1] == 3
    # The firewall is the provisioned one: a stranger's port stays closed (this machine is not a peer).
    assert not connects_from_here(info.nodes[1].address, STORE_PORT)

    # Supervised: wireguard-go killed on its own comes back (Restart=always), with its peers.
    ssh_run(info, "node-2", f"kill -9 {' '.join(map(str, after['wireguard-go']))}")
    deadline = time.monotonic() + 20
    while not ((again := node_state(info, "node-2"))["wireguard-go"] and again["vpsc0"] == ["10.77.0.2"]
               and not set(again["wireguard-go"]) & set(after["wireguard-go"])):
        assert time.monotonic() < deadline, again
        time.sleep(0.5)
    # The new instance makes a fresh handshake as soon as it has something to send.
    assert ping_from(info, "node-2", "10.77.0.1", 10, 0.3)[1] >= 5


def test_the_controller_gets_ssh_and_nothing_else(provisioned):
    """This machine is the sandbox's controller (its gateway, firewall.controller): SSH is open to
    it, a cluster port with a listener is not (peers still reach it)."""
    info, _ = provisioned
    node1 = info.nodes[0].address
    listen_on(info, "node-1", STORE_PORT + 1)
    assert connects_from_node(info, "node-2", node1, STORE_PORT + 1, within_s=20)
    assert connects_from_here(node1, 22)
    assert not connects_from_here(node1, STORE_PORT + 1)
    r = ssh_run(info, "node-1", "nft list table inet vpscluster")
    assert all("dport" in line for line in r.stdout.splitlines() if info.gateway in line), r.stdout


def test_icmp_echo_is_rate_limited_for_non_peers(provisioned):
    """A ping flood from this machine (not a peer: the ICMP rule applies) gets about the burst (10)
    plus 5/s answered; a peer's flood is answered in full."""
    info, _ = provisioned
    node1 = info.nodes[0].address

    sent, got = ping_here(node1, 200, 0.005)
    assert sent == 200 and 5 <= got <= 30, (sent, got)  # burst 10 + 5/s over ~1 s, with slack
    sent, got = ping_from(info, "node-2", node1, 200, 0.005)
    assert got >= 190, (sent, got)


def test_cluster_file_text_is_never_templated_by_ansible(provisioned, tmp_path, monkeypatch):
    """A workdir holding a lookup that would create a file here: a real ansible-playbook run
    (the env role, which uses the workdir) leaves no such file and makes the literal directory."""
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.provision import provision

    info, cluster_file = provisioned
    marker = tmp_path / f"rb-pwned-{secrets.token_hex(3)}"
    workdir = f"/srv/rb-{{{{ lookup('pipe', 'touch {marker}') }}}}"
    doc = yaml.safe_load(Path(cluster_file).read_text())
    doc["nodes"] = doc["nodes"][:1]
    doc["nodes"][0]["workdir"] = workdir
    path = tmp_path / "cluster-lookup.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: the wheel is re-packed from what is installed here
    report = provision(load_cluster(str(path)), roles=["env"], env_packages=["mdurl"], wheelhouse=tmp_path / "wheels")
    assert not marker.exists(), "the cluster file's text ran as a template on the controller"
    assert report["ok"], json.dumps(report)[-3000:]
    r = ssh_run(info, "node-1", f"ls -d {workdir!r}/venv/bin/python")
    assert r.returncode == 0, r.stdout + r.stderr
