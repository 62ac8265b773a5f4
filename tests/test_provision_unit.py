"""vpscluster provision without nodes: roles, buffer sizing, the inventory (host keys strict), the
report from Ansible's results, the pinned package list and a re-packed wheel that pip installs;
the playbook ships with the package and ansible-playbook accepts it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
import pytest

from vpscluster.cluster.node import Cluster, Node
from vpscluster.errors import UserError
from vpscluster.provision import parse_roles, playbook_dir
from vpscluster.provision.inventory import build_inventory, tcp_buffer_bytes
from vpscluster.provision.runner import summarize


def test_roles():
    assert parse_roles(None) == ["env", "tcp", "firewall", "overlay"]
    assert parse_roles("firewall,tcp") == ["tcp", "firewall"]
    for bad, msg in [("", "empty"), ("tcp,dns", "unknown role 'dns'")]:
        with pytest.raises(UserError, match=msg):
            parse_roles(bad)


def test_buffers_cover_twice_the_bdp_at_least_16mb():
    assert tcp_buffer_bytes(None) == 16 << 20
    assert tcp_buffer_bytes({"links": [{"bandwidth_mbit": 100, "rtt_ms": 30}]}) == 16 << 20  # 375 kB BDP
    # 1 Gbit/s x 200 ms = 25 MB BDP -> 50 MB -> 64 MB
    assert tcp_buffer_bytes({"links": [{"bandwidth_mbit": 1000, "rtt_ms": 200}, {"bandwidth_mbit": "x"}]}) == 64 << 20
    assert tcp_buffer_bytes({"links": [{"bandwidth_mbit": 10000, "rtt_ms": 500}]}) == 256 << 20


def test_inventory_peers_keys_and_strict_host_keys(tmp_path):
    nodes = (Node("a", "10.0.0.2", identity_file="/k"), Node("b", "10.0.0.3", port=2222, user="deploy"))
    cluster = Cluster(nodes=nodes, head="a", known_hosts=str(tmp_path / "kh"), firewall_allow=(5432,),
                      firewall_ssh_from=("198.51.100.0/24",))
    inv = build_inventory(cluster, {"tcp_buffer_bytes": 1})["all"]["children"]["cluster"]
    a, b = inv["hosts"]["a"], inv["hosts"]["b"]
    assert a["firewall_peers"] == ["10.0.0.3", "10.77.0.2"] and b["firewall_peers"] == ["10.0.0.2", "10.77.0.1"]
    assert (a["overlay_address"], b["overlay_address"]) == ("10.77.0.1", "10.77.0.2")
    assert a["ansible_ssh_private_key_file"] == "/k" and b["ansible_port"] == 2222 and b["ansible_become"] is True
    assert b["firewall_ssh_port"] == 2222
    args = inv["vars"]["ansible_ssh_common_args"]
    assert f"UserKnownHostsFile={tmp_path / 'kh'}" in args and "StrictHostKeyChecking=yes" in args
    assert inv["vars"]["firewall_allow"] == [5432] and inv["vars"]["firewall_ssh_from"] == ["198.51.100.0/24"]
    from dataclasses import replace

    assert "StrictHostKeyChecking=accept-new" in build_inventory(replace(cluster, accept_new_host_keys=True))[
        "all"]["children"]["cluster"]["vars"]["ansible_ssh_common_args"]
    from vpscluster.cluster.inventory import local_cluster

    with pytest.raises(UserError, match="local cluster has nothing to provision"):
        build_inventory(local_cluster())


def test_summary_counts_per_node_and_role():
    doc = {"results": [
        {"host": "a", "role": "tcp", "task": "t", "status": "changed", "changes": ["x: 1 -> 2"],
         "not_settable": {"net.core.default_qdisc": "not here"}},
        {"host": "a", "role": "firewall", "task": "f", "status": "ok"},
        {"host": "b", "role": "tcp", "task": "t", "status": "ok"},
        {"host": "b", "role": "firewall", "task": "f", "status": "failed", "msg": "nft: syntax\nerror here"},
    ]}
    rep = summarize(doc, ["a", "b"], ["tcp", "firewall"], check=False)
    a, b = rep["nodes"]
    assert a["status"] == "changed" and a["roles"]["tcp"]["changed"] == 1 and a["changes"] == ["tcp: t (x: 1 -> 2)"]
    assert a["not_settable"] == {"net.core.default_qdisc": "not here"}
    assert b["status"] == "failed" and b["errors"] == ["firewall: f: error here"]
    assert not rep["ok"] and rep["summary"] == "failed on b"
    quiet = summarize({"results": [{"host": "a", "role": "tcp", "task": "t", "status": "ok"}]}, ["a"], ["tcp"], True)
    assert quiet["ok"] and quiet["summary"] == "no changes would be made"
    missing = summarize({"results": []}, ["a"], ["tcp"], False)
    assert not missing["ok"] and missing["summary"] == "failed on a"


def test_pinned_requirements_are_the_installed_closure():
    from importlib import metadata

    from vpscluster.provision.env import env_hash, pinned_requirements

    reqs = pinned_requirements()
    for name in ("vpscluster", "torch", "numpy", "pyyaml", "pydantic", "asyncssh"):
        assert reqs[name] == metadata.version(name)
    assert "pytest" not in reqs and "hypothesis" not in reqs  # extras are not pinned on nodes
    assert env_hash(reqs) == env_hash(dict(reversed(list(reqs.items())))) and len(env_hash(reqs)) == 16


def test_repacked_wheel_installs_the_same_version(tmp_path):
    from importlib import metadata

    from vpscluster.provision.env import repack

    whl = repack(metadata.distribution("mdurl"), tmp_path)
    assert zipfile.ZipFile(whl).testzip() is None
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    str(whl)], check=True, timeout=120)
    out = subprocess.run([sys.executable, "-c", "import mdurl, importlib.metadata as m; print(mdurl.__file__, m.version('mdurl'))"],
                         env={"PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=60)
    path, version = out.stdout.split()
    assert path.startswith(str(target)) and version == metadata.version("mdurl")


def test_repacked_wheel_name_carries_every_tag_so_pip_finds_it(tmp_path):
    """A wheel whose WHEEL lists `py2-none-any` and `py3-none-any` (locket, here) must be named
    `py2.py3-none-any`: named by its first tag only, pip on a Python 3 node skips it."""
    from importlib import metadata

    from vpscluster.provision.env import repack, wheel_tag

    assert wheel_tag(["py2-none-any", "py3-none-any"]) == "py2.py3-none-any"
    assert wheel_tag(["cp311-cp311-manylinux_2_17_x86_64", "cp311-cp311-manylinux2014_x86_64"]) == \
        "cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64"
    assert wheel_tag(["py3-none-any"]) == "py3-none-any" and wheel_tag([]) == "py3-none-any"
    assert wheel_tag(["cp311-cp311-linux_x86_64", "py2-none-any"]) == "cp311-cp311-linux_x86_64"  # not a product
    whl = repack(metadata.distribution("locket"), tmp_path)
    assert whl.name == f"locket-{metadata.version('locket')}-py2.py3-none-any.whl"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-index", "--no-deps", "--find-links",
                        str(tmp_path), "-d", str(tmp_path / "got"), f"locket=={metadata.version('locket')}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_playbook_ships_and_parses(tmp_path):
    root = playbook_dir()
    for rel in ("site.yml", "library/vpscluster_sysctl.py", "library/vpscluster_venv.py",
                "callback_plugins/vpscluster_json.py", "roles/firewall/templates/firewall.nft.j2",
                "roles/tcp/tasks/main.yml", "roles/env/tasks/main.yml"):
        assert (root / rel).is_file(), rel
    from vpscluster.provision.runner import ansible_playbook

    r = subprocess.run([ansible_playbook(), "--syntax-check", "-i", "localhost,", str(root / "site.yml")],
                       capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "ANSIBLE_LIBRARY": str(root / "library"),
                            "ANSIBLE_ROLES_PATH": str(root / "roles"), "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
