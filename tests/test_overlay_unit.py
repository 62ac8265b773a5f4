"""The overlay record that `provision` leaves and launches read (cluster/overlay.py), and the one
place that decides a launch's addresses from it (launch/preflight.py `node_endpoints`): overlay
addresses and interface once provisioned for exactly these nodes, the cluster file's hosts
otherwise; the public-address refusal lifted by an overlay; the dry run showing it."""

from __future__ import annotations

import json

import pytest

from vpscluster.cluster import overlay
from vpscluster.cluster.inventory import load_cluster
from vpscluster.cluster.netsafety import require_safe_network
from vpscluster.errors import UserError
from vpscluster.launch.preflight import node_endpoints


def cluster_file(tmp_path, hosts=("203.0.113.10", "203.0.113.11"), name="c.yaml"):
    key = tmp_path / "k"
    key.write_text("x")
    nodes = "".join(f"  - {{name: n{i}, host: {h}}}\n" for i, h in enumerate(hosts))
    path = tmp_path / name
    path.write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n{nodes}")
    return path


def test_without_an_overlay_the_cluster_file_hosts_are_used(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path, hosts=("10.1.0.2", "10.1.0.3")))
    assert overlay.load(cluster) is None
    ends = node_endpoints(cluster, {"n0": {"interface": "eth1"}})
    assert [(e.address, e.interface, e.via) for e in ends.values()] == [("10.1.0.2", "eth1", "underlay"),
                                                                         ("10.1.0.3", None, "underlay")]


def test_a_recorded_overlay_gives_its_addresses_interface_and_lifts_the_refusal(tmp_path):
    path = cluster_file(tmp_path)
    cluster = load_cluster(path)
    with pytest.raises(UserError, match="WireGuard overlay"):
        require_safe_network(cluster)
    saved = overlay.save(cluster, "vpsc0", {"n0": "10.77.0.1", "n1": "10.77.0.2"}, "10.77.0.0/24")
    assert saved == tmp_path / ".vpscluster" / "c.overlay.json"
    assert json.loads(saved.read_text())["addresses"] == {"n0": "10.77.0.1", "n1": "10.77.0.2"}
    ends = node_endpoints(load_cluster(path), {"n0": {"interface": "eth0"}})
    assert [(e.address, e.interface, e.via) for e in ends.values()] == [("10.77.0.1", "vpsc0", "overlay"),
                                                                         ("10.77.0.2", "vpsc0", "overlay")]
    require_safe_network(load_cluster(path))  # traffic goes over the mesh: allowed
    overlay.forget(cluster)
    assert overlay.load(cluster) is None


def test_a_record_for_other_nodes_is_ignored(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path))
    overlay.save(cluster, "vpsc0", {"n0": "10.77.0.1", "n1": "10.77.0.2"}, "10.77.0.0/24")
    changed = load_cluster(cluster_file(tmp_path, hosts=("203.0.113.10", "203.0.113.99")))
    assert overlay.load(changed) is None
    assert node_endpoints(changed)["n1"].address == "203.0.113.99"
    third = load_cluster(cluster_file(tmp_path, hosts=("203.0.113.10", "203.0.113.11", "203.0.113.12")))
    assert overlay.load(third) is None


def test_dry_run_binds_rendezvous_and_gloo_to_the_overlay(tmp_path, cli):
    path = cluster_file(tmp_path)
    overlay.save(load_cluster(path), "vpsc0", {"n0": "10.77.0.1", "n1": "10.77.0.2"}, "10.77.0.0/24")
    (tmp_path / "s.py").write_text("print('hi')\n")
    r = cli("run", "--cluster", str(path), "--dry-run", "--json", "--sync", str(tmp_path), "--", "python", "s.py",
            timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for node, address in zip(doc["nodes"], ("10.77.0.1", "10.77.0.2")):
        assert node["address"] == address
        assert node["env"]["GLOO_SOCKET_IFNAME"] == "vpsc0" and node["env"]["NCCL_SOCKET_IFNAME"] == "vpsc0"
        argv = node["argv"]
        assert argv[argv.index("--rdzv-endpoint") + 1].startswith("10.77.0.1:")
        assert argv[argv.index("--local-addr") + 1] == address
    assert any("WireGuard overlay" in n for n in doc["notes"])


def test_provision_records_the_overlay_only_after_a_clean_run(tmp_path):
    from vpscluster.provision import record_overlay

    cluster = load_cluster(cluster_file(tmp_path))
    out = record_overlay(cluster, {"ok": True})
    assert out["addresses"] == {"n0": "10.77.0.1", "n1": "10.77.0.2"} and out["interface"] == "vpsc0"
    assert overlay.load(cluster).addresses == out["addresses"]
    assert record_overlay(cluster, {"ok": False}) is None
    assert overlay.load(cluster) is None  # a failed overlay run: the mesh may be half made
