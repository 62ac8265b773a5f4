"""The cluster file: a valid file loads with paths resolved; each class of bad input has its own message."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from vpscluster.cluster.inventory import load_cluster, local_cluster
from vpscluster.errors import UserError


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "id_ed25519").write_text("not a real key; the loader only checks that the file exists\n")
    return tmp_path


def write(folder: Path, doc) -> Path:
    path = folder / "cluster.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


def two_nodes(**changes) -> dict:
    doc = {
        "known_hosts": "known_hosts",
        "defaults": {"user": "ubuntu", "identity_file": "id_ed25519", "python": "/opt/venv/bin/python"},
        "nodes": [
            {"name": "node-a", "host": "203.0.113.10", "labels": {"region": "fra", "provider": "hetzner"},
             "advertised_bandwidth": "1gbit", "egress_quota": "20TB/month"},
            {"name": "node-b", "host": "203.0.113.11", "port": 2222, "user": "root", "workdir": "/srv/vpsc"},
        ],
    }
    doc.update(changes)
    return doc


def test_valid_file_loads_with_defaults_and_resolved_paths(folder: Path) -> None:
    cluster = load_cluster(write(folder, two_nodes(head="node-b", connect_timeout_s=3, command_timeout_s=30,
                                                   dead_after_s=12)))
    a, b = cluster.nodes
    assert [n.name for n in cluster.nodes] == ["node-a", "node-b"]
    assert cluster.head == "node-b" and cluster.head_node is b
    assert cluster.known_hosts == str(folder / "known_hosts")  # relative to the file's folder
    assert a.identity_file == str(folder / "id_ed25519")
    assert (a.user, b.user) == ("ubuntu", "root")  # a node's own value beats the defaults
    assert (a.port, b.port) == (22, 2222)
    assert a.python == "/opt/venv/bin/python" and b.workdir == "/srv/vpsc" and a.workdir == "~/vpscluster"
    assert a.labels == {"region": "fra", "provider": "hetzner"}
    assert a.advertised_bandwidth_mbit == 1000.0
    assert a.egress_quota_bytes == 20e12 and a.egress_quota_period_s == 30 * 86400
    assert b.advertised_bandwidth_mbit is None and b.egress_quota_bytes is None
    assert (cluster.connect_timeout_s, cluster.command_timeout_s, cluster.dead_after_s) == (3.0, 30.0, 12.0)
    assert cluster.accept_new_host_keys is False and not cluster.is_local


def test_head_defaults_to_first_node_and_known_hosts_to_home(folder: Path) -> None:
    doc = two_nodes()
    del doc["known_hosts"]
    cluster = load_cluster(write(folder, doc))
    assert cluster.head == "node-a"
    assert cluster.known_hosts == str(Path("~/.ssh/known_hosts").expanduser())


def test_tilde_in_identity_file_expands(folder: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(folder))
    doc = two_nodes()
    doc["defaults"]["identity_file"] = "~/id_ed25519"
    assert load_cluster(write(folder, doc)).nodes[0].identity_file == str(folder / "id_ed25519")


def test_local_cluster_is_one_local_node() -> None:
    cluster = local_cluster()
    (node,) = cluster.nodes
    assert node.local and cluster.is_local and cluster.head == node.name == "local"
    assert node.python == sys.executable and node.workdir == os.getcwd()


def node_b(**fields) -> dict:
    return {"name": "node-b", "host": "203.0.113.11", **fields}


# Each class of bad input, the fragments its message must hold (file, field, the fix).
BAD = {
    "unknown top-level key": (two_nodes(nodez=[]), ["cluster.yaml: unknown key 'nodez'", "valid keys"]),
    "unknown node key": (two_nodes(nodes=[{"name": "a", "host": "h", "hostname": "x"}]),
                         ["nodes[0]: unknown key 'hostname'", "valid keys"]),
    "unknown defaults key": (two_nodes(defaults={"name": "x"}), ["defaults: unknown key 'name'"]),
    "duplicate name": (two_nodes(nodes=[node_b(), node_b(host="203.0.113.12")]),
                       ["nodes[1].name: duplicate node name 'node-b'", "unique"]),
    "duplicate address": (two_nodes(nodes=[node_b(), {"name": "node-c", "host": "203.0.113.11"}]),
                          ["nodes[1].host: duplicate address 203.0.113.11:22", "own host:port"]),
    "missing key file": (two_nodes(nodes=[node_b(identity_file="nope/id_rsa")]),
                         ["nodes[0].identity_file:", "nope/id_rsa does not exist", "ssh-keygen"]),
    "bad rate unit": (two_nodes(nodes=[node_b(advertised_bandwidth="1 gigabit")]),
                      ["nodes[0].advertised_bandwidth: '1 gigabit' is not a rate", "100mbit"]),
    "bad quota": (two_nodes(nodes=[node_b(egress_quota="2TB per month")]),
                  ["nodes[0].egress_quota: '2TB per month' is not a quota", "2TB/month"]),
    "bad quota size": (two_nodes(nodes=[node_b(egress_quota="lots/month")]),
                       ["nodes[0].egress_quota: 'lots' is not a size"]),
    "port out of range": (two_nodes(nodes=[node_b(port=70000)]), ["nodes[0].port: 70000 is not a port (1-65535)"]),
    "port not a number": (two_nodes(nodes=[node_b(port="ssh")]), ["nodes[0].port: 'ssh' is not a port"]),
    "unknown head": (two_nodes(head="node-z"), ["head: 'node-z' is not a node", "node-a, node-b"]),
    "no nodes": (two_nodes(nodes=[]), ["nodes: expected a list with at least one node"]),
    "missing host": (two_nodes(nodes=[{"name": "node-b"}]), ["nodes[0].host: None is not a host"]),
    "bad name": (two_nodes(nodes=[node_b(name="node b")]), ["nodes[0].name: 'node b' is not a node name"]),
    "bad timeout": (two_nodes(connect_timeout_s=0), ["connect_timeout_s: expected a positive number of seconds"]),
    "dead too soon": (two_nodes(dead_after_s=1), ["dead_after_s: 1.0 s is too short", "use 4 or more"]),
    "bad accept flag": (two_nodes(accept_new_host_keys="maybe"), ["accept_new_host_keys: expected true or false"]),
    "not YAML": ("nodes: [name: a\n  host: {", ["cluster file", "not valid YAML", "fix the syntax"]),
    "not a mapping": ("- just\n- a list\n", ["expected a mapping at the top level"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_input_has_its_own_clear_message(folder: Path, case: str) -> None:
    doc, fragments = BAD[case]
    path = write(folder, doc)
    with pytest.raises(UserError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert str(folder) in message or "cluster.yaml" in message, message  # names the file
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in {message!r}"


def test_messages_differ_between_classes(folder: Path) -> None:
    messages = set()
    for case, (doc, _) in BAD.items():
        with pytest.raises(UserError) as info:
            load_cluster(write(folder, doc))
        messages.add(str(info.value).replace(str(folder), ""))
    assert len(messages) == len(BAD)


def test_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such cluster file; pass --cluster"):
        load_cluster(tmp_path / "absent.yaml")


def test_a_folder_is_not_a_cluster_file_and_the_error_says_what_to_pass(tmp_path: Path, cli) -> None:
    with pytest.raises(UserError) as info:
        load_cluster(tmp_path)
    msg = str(info.value)
    assert "is a folder, not a cluster file" in msg and "no such" not in msg
    assert f"--cluster {tmp_path / 'cluster.yaml'}" in msg
    (tmp_path / "prod.yaml").write_text("nodes: []\n")
    r = cli("train", "--cluster", str(tmp_path), "--dry-run", timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{tmp_path} is a folder, not a cluster file (it holds prod.yaml)" in r.stderr
    assert f"--cluster {tmp_path / 'prod.yaml'}" in r.stderr


def test_a_provisioned_venv_is_used_per_node_until_the_file_names_another_python(tmp_path: Path) -> None:
    """After `provision` (env) records each node's venv, load_cluster runs it; a `python:` written
    for a node afterwards wins; a node the record does not know (new host) keeps its own."""
    import yaml

    from vpscluster.cluster import venv

    key = tmp_path / "k"
    key.write_text("x")
    doc = {"defaults": {"identity_file": str(key), "python": "/usr/bin/python3", "workdir": "/srv/w"},
           "nodes": [{"name": "a", "host": "10.0.0.2"}, {"name": "b", "host": "10.0.0.3"}, {"name": "c", "host": "10.0.0.4"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    record = venv.save(load_cluster(path), {"a": "/srv/w/venv/bin/python", "b": "/srv/w/venv/bin/python"})
    assert record == tmp_path / ".vpscluster" / "c.venv.json"
    assert [n.python for n in load_cluster(path).nodes] == ["/srv/w/venv/bin/python"] * 2 + ["/usr/bin/python3"]
    doc["nodes"][1]["python"] = "/opt/mine/bin/python"  # written by the user after provisioning
    doc["nodes"][0]["host"] = "10.0.0.9"  # another machine under the same name
    path.write_text(yaml.safe_dump(doc))
    assert [n.python for n in load_cluster(path).nodes] == ["/usr/bin/python3", "/opt/mine/bin/python", "/usr/bin/python3"]
    # Provisioned again from a cluster already running its venv: the file's own python stays the reference.
    doc["nodes"][1].pop("python")
    doc["nodes"][0]["host"] = "10.0.0.2"
    path.write_text(yaml.safe_dump(doc))
    venv.save(load_cluster(path), {"a": "/srv/w/venv/bin/python"})
    assert venv.load(load_cluster(path))["nodes"]["a"]["file_python"] == "/usr/bin/python3"
    assert [n.python for n in load_cluster(path).nodes][:2] == ["/srv/w/venv/bin/python"] * 2
