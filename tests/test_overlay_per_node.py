"""The overlay record matches node by node (cluster/overlay.py): any subset of the provisioned
nodes has the overlay (recovery relaunches on the survivors over it), a node recorded with
another host or SSH port has none, and records written before per-node identities are read as
they always were, then upgraded."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vpscluster.cluster import overlay
from vpscluster.cluster.inventory import load_cluster
from vpscluster.cluster.netsafety import require_safe_network
from vpscluster.errors import UserError
from vpscluster.launch import recovery
from vpscluster.launch.preflight import Endpoint, node_endpoints

HOSTS = ("203.0.113.10", "203.0.113.11", "203.0.113.12")
ADDRESSES = {"n0": "10.77.0.1", "n1": "10.77.0.2", "n2": "10.77.0.3"}


def cluster_file(tmp_path, hosts=HOSTS, ports=None):
    key = tmp_path / "k"
    key.write_text("x")
    ports = ports or [22] * len(hosts)
    nodes = "".join(f"  - {{name: n{i}, host: {h}, port: {p}}}\n" for i, (h, p) in enumerate(zip(hosts, ports)))
    path = tmp_path / "c.yaml"
    path.write_text(f"defaults: {{identity_file: {key}}}\nnodes:\n{nodes}")
    return path


def test_the_survivors_of_a_provisioned_cluster_have_its_overlay(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path))
    overlay.save(cluster, "vpsc0", ADDRESSES, "10.77.0.0/24")
    survivors = recovery.subset(cluster, ["n1", "n2"])
    mesh = overlay.load(survivors)
    assert mesh is not None and mesh.addresses == {"n1": "10.77.0.2", "n2": "10.77.0.3"}
    ends = node_endpoints(survivors)
    assert [(e.address, e.interface, e.via) for e in ends.values()] == [("10.77.0.2", "vpsc0", "overlay"),
                                                                         ("10.77.0.3", "vpsc0", "overlay")]
    require_safe_network(survivors)  # public underlay, but the relaunch runs over the mesh: allowed
    # insecure_network changes nothing: the relaunch still binds to the overlay, never the underlay.
    assert node_endpoints(dataclasses.replace(survivors, insecure_network=True))["n1"].via == "overlay"


def test_a_node_whose_host_or_port_changed_has_no_overlay(tmp_path):
    overlay.save(load_cluster(cluster_file(tmp_path)), "vpsc0", ADDRESSES, "10.77.0.0/24")
    moved = load_cluster(cluster_file(tmp_path, hosts=(HOSTS[0], "203.0.113.99", HOSTS[2])))
    assert overlay.load(recovery.subset(moved, ["n1"])) is None
    assert overlay.load(moved) is None  # a cluster holding it has none either: no half mesh
    assert node_endpoints(moved)["n1"] == Endpoint("203.0.113.99", None, "underlay")
    with pytest.raises(UserError, match="refusing to launch over public addresses: n0"):
        require_safe_network(moved)
    assert overlay.load(recovery.subset(moved, ["n0", "n2"])).addresses == {"n0": "10.77.0.1", "n2": "10.77.0.3"}
    other_port = load_cluster(cluster_file(tmp_path, ports=(22, 2222, 22)))
    assert overlay.load(recovery.subset(other_port, ["n1"])) is None


def test_a_node_not_in_the_record_has_no_overlay(tmp_path):
    overlay.save(load_cluster(cluster_file(tmp_path, hosts=HOSTS[:2])), "vpsc0",
                 {"n0": "10.77.0.1", "n1": "10.77.0.2"}, "10.77.0.0/24")
    grown = load_cluster(cluster_file(tmp_path))
    assert overlay.load(grown) is None and overlay.load(recovery.subset(grown, ["n2"])) is None
    assert overlay.load(recovery.subset(grown, ["n0"])).addresses == {"n0": "10.77.0.1"}


def test_an_older_record_matches_its_whole_set_and_then_its_subsets(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path))
    path = overlay.save(cluster, "vpsc0", ADDRESSES, "10.77.0.0/24")
    old = json.loads(path.read_text())
    del old["nodes"]  # as written before identities were kept per node
    path.write_text(json.dumps(old))
    survivors = recovery.subset(cluster, ["n0", "n2"])
    assert overlay.load(survivors) is None  # a fingerprint of the whole set says nothing per node
    other = load_cluster(cluster_file(tmp_path, hosts=(HOSTS[0], HOSTS[1], "203.0.113.99")))
    assert overlay.load(other) is None and "nodes" not in json.loads(path.read_text())
    assert overlay.load(cluster).addresses == ADDRESSES  # the set it was made for: as before
    assert json.loads(path.read_text())["nodes"]["n2"] == {"host": HOSTS[2], "port": 22}
    assert overlay.load(survivors).addresses == {"n0": "10.77.0.1", "n2": "10.77.0.3"}
