"""Refusing launches over public addresses: the address classification, the rule, and the one
line `vpscluster run`/`train` print (before any connection is tried)."""

from __future__ import annotations

import pytest

from vpscluster.cluster.inventory import local_cluster
from vpscluster.cluster.netsafety import classify, require_safe_network
from vpscluster.cluster.node import Cluster, Node
from vpscluster.errors import UserError


@pytest.mark.parametrize("address,kind", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"), ("0.0.0.0", "loopback"),
    ("10.0.0.5", "private"), ("10.231.7.2", "private"), ("172.16.0.1", "private"), ("172.31.255.254", "private"),
    ("192.168.1.20", "private"), ("100.64.0.1", "private"), ("100.127.255.1", "private"),
    ("169.254.10.1", "private"), ("fd12:3456::1", "private"), ("fe80::1", "private"), ("fe80::1%eth0", "private"),
    ("::ffff:10.1.2.3", "private"), ("::ffff:8.8.8.8", "public"),
    ("8.8.8.8", "public"), ("172.32.0.1", "public"), ("172.15.255.255", "public"), ("100.128.0.1", "public"),
    ("11.0.0.1", "public"), ("203.0.113.10", "public"), ("198.51.100.7", "public"), ("2001:db8::1", "public"),
    ("2a01:4f8::1", "public"), ("192.169.0.1", "public"),
])
def test_classify(address, kind):
    assert classify(address) == kind


def cluster_of(*hosts: str, insecure: bool = False) -> Cluster:
    nodes = tuple(Node(name=f"n{i}", host=h) for i, h in enumerate(hosts))
    return Cluster(nodes=nodes, head="n0", source="c.yaml", insecure_network=insecure)


def test_private_loopback_and_local_clusters_pass():
    require_safe_network(cluster_of("10.231.4.2", "10.231.4.3"))  # the sandbox's bridge
    require_safe_network(cluster_of("127.0.0.1", "localhost"))
    require_safe_network(local_cluster())


def test_a_public_node_is_refused_in_one_line_naming_why_and_the_fix():
    with pytest.raises(UserError) as e:
        require_safe_network(cluster_of("10.0.0.2", "203.0.113.10"))
    msg = str(e.value)
    assert "\n" not in msg and "n1 (203.0.113.10)" in msg and "n0" not in msg
    assert "no authentication" in msg and "vpscluster provision --cluster c.yaml" in msg and "--insecure-network" in msg


def test_insecure_network_opt_in_allows_it():
    require_safe_network(cluster_of("203.0.113.10", insecure=True))


def test_cluster_file_key_and_cli_refusal(tmp_path, cli):
    from vpscluster.cluster.inventory import load_cluster

    key = tmp_path / "k"
    key.write_text("x")
    (tmp_path / "c.yaml").write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n")
    (tmp_path / "ok.yaml").write_text(f"insecure_network: true\ndefaults: {{identity_file: {key}}}\n"
                                      "nodes:\n  - {name: a, host: 192.0.2.50}\n")
    assert load_cluster(tmp_path / "ok.yaml").insecure_network is True
    assert load_cluster(tmp_path / "c.yaml").insecure_network is False
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    r = cli("run", "--cluster", str(tmp_path / "c.yaml"), "--sync", str(tmp_path), "--", "python", "s.py",
            timeout=60, cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to launch over public addresses: a (192.0.2.50)" in lines[0], lines
    assert "vpscluster provision" in lines[0] and not (tmp_path / "runs").exists()
    # A dry run exposes nothing and stays allowed.
    r = cli("run", "--cluster", str(tmp_path / "c.yaml"), "--dry-run", "--sync", str(tmp_path), "--", "python", "s.py",
            timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr


def test_batch_is_refused_on_public_addresses_too(tmp_path, cli):
    key = tmp_path / "k"
    key.write_text("x")
    (tmp_path / "c.yaml").write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n")
    (tmp_path / "in.jsonl").write_text('{"x": 1}\n')
    r = cli("batch", "--cluster", str(tmp_path / "c.yaml"), "--fn", "json:dumps", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out"), timeout=60, cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to launch over public addresses: a (192.0.2.50)" in lines[0], lines
    assert "Dask's scheduler" in lines[0] and "--insecure-network" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing was created


def public_cluster_file(tmp_path) -> str:
    key = tmp_path / "k"
    key.write_text("x")
    (tmp_path / "c.yaml").write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n  - {{name: a, host: 192.0.2.50}}\n")
    return str(tmp_path / "c.yaml")


@pytest.mark.parametrize("argv,what", [
    (["monitor", "up"], "Prometheus and the node exporters"),
    (["probe", "--quick"], "the probe's link-test servers"),
    (["exec", "--", "hostname"], "what the command starts there"),
])
def test_monitor_probe_and_exec_refuse_public_addresses_in_one_line(tmp_path, cli, argv, what):
    """They skipped the check: `monitor up` put unauthenticated Prometheus on the head's public
    address, `probe` ran its link servers and torch.distributed sweep there. Refused before any
    node is reached (192.0.2.50 answers nothing, so a connection attempt would time out instead)."""
    cluster = public_cluster_file(tmp_path)
    r = cli(*argv[:2 if argv[0] == "monitor" else 1], "--cluster", cluster, *argv[2 if argv[0] == "monitor" else 1:],
            timeout=60, cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "over public addresses: a (192.0.2.50)" in lines[0], lines
    assert what in lines[0] and "vpscluster provision --cluster" in lines[0] and "--insecure-network" in lines[0]


def test_a_public_node_whose_firewall_is_not_up_is_refused_by_pre_flight():
    """The probe's `firewall_up` never blocked a launch. Pre-flight now asks every public node for
    provision's nftables table: here through a real executor on this machine, which has none."""
    import asyncio

    from vpscluster.cluster.local import LocalExecutor
    from vpscluster.cluster.netsafety import require_firewall

    cluster = cluster_of("10.0.0.2", "203.0.113.10")
    here = [LocalExecutor(Node(name=n.name, host="127.0.0.1", local=True)) for n in cluster.nodes]
    with pytest.raises(UserError) as e:
        asyncio.run(require_firewall(cluster, here, timeout_s=30))
    msg = str(e.value)
    assert "\n" not in msg and "the firewall is not up on n1 (203.0.113.10)" in msg and "n0" not in msg, msg
    assert "vpscluster provision --cluster c.yaml --only overlay,firewall" in msg and "--insecure-network" in msg
    # Private nodes alone, or the explicit opt-in: nothing is asked.
    asyncio.run(require_firewall(cluster_of("10.0.0.2", "10.0.0.3"), here, timeout_s=30))
    asyncio.run(require_firewall(cluster_of("10.0.0.2", "203.0.113.10", insecure=True), here, timeout_s=30))
