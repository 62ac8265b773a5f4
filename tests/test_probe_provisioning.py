"""The probe's view of provisioning: the node-side reading of what `vpscluster provision` left
(env venv marker and drift, persisted vs live sysctls, overlay interface), the cluster summary,
the overlay's cost against the underlay, and the table row people read."""

from __future__ import annotations

import io
import json
import sys

from vpscluster.cluster.overlay import Overlay
from vpscluster.nodeside import facts as nodefacts
from vpscluster.probe.api import overlay_cost, provisioning_summary


def test_parse_sysctl_conf_skips_comments_and_normalises_spaces():
    text = "# Written by vpscluster\n; old style\nnet.core.rmem_max = 16777216\nnet.ipv4.tcp_rmem=4096  131072\t16777216\n\n"
    assert nodefacts.parse_sysctl_conf(text) == {"net.core.rmem_max": "16777216",
                                                 "net.ipv4.tcp_rmem": "4096 131072 16777216"}


def test_provision_facts_reads_the_env_marker_and_finds_drift(tmp_path, monkeypatch):
    from importlib import metadata

    venv = tmp_path / "wd" / "venv"
    venv.mkdir(parents=True)
    marker = {"env_hash": "abc123", "packages": {"pyyaml": metadata.version("pyyaml"), "rich": "0.0.1"}}
    (venv / "vpscluster-env.json").write_text(json.dumps(marker))
    # Run as that venv's Python would: its prefix is the venv (the packages are this machine's).
    monkeypatch.setattr(sys, "prefix", str(venv))
    p = nodefacts.provision_facts(str(tmp_path / "wd"), "lo")
    assert p["env_hash"] == "abc123" and p["env_venv"] == str(venv)
    assert p["env_drift"] == [f"rich {metadata.version('rich')} (pinned 0.0.1)"]
    assert p["overlay_up"] is True and p["overlay_address"] == "127.0.0.1"  # lo stands in for the mesh
    monkeypatch.undo()
    assert nodefacts.provision_facts(str(tmp_path / "wd"), "lo")["env_drift"] is None  # another Python: no drift check
    bare = nodefacts.provision_facts(str(tmp_path / "none"), "vpsc-absent0")
    assert bare["env_hash"] is None and bare["overlay_up"] is False and bare["overlay_address"] is None


class _C:
    def __init__(self, names):
        self.nodes = [type("N", (), {"name": n})() for n in names]


def test_provisioning_summary_needs_one_hash_and_the_expected_overlay_address():
    mesh = Overlay("vpsc0", "10.77.0.0/24", {"a": "10.77.0.1", "b": "10.77.0.2"})
    base = {"env_drift": [], "tcp_tuned": True, "firewall_up": True, "overlay_interface": "vpsc0", "overlay_up": True}
    facts = {"a": {"reachable": True, "provision": {**base, "env_hash": "h1", "overlay_address": "10.77.0.1"}},
             "b": {"reachable": True, "provision": {**base, "env_hash": "h1", "overlay_address": "10.77.0.2"}}}
    s = provisioning_summary(_C(["a", "b"]), facts, mesh)
    assert s["env_hash_match"] is True and s["env_hash"] == "h1" and s["overlay_up"] is True and s["tcp_tuned"] is True
    facts["b"]["provision"].update(env_hash="h2", overlay_address="10.77.0.9")
    s = provisioning_summary(_C(["a", "b"]), facts, mesh)
    assert s["env_hash_match"] is False and s["env_hash"] is None and s["overlay_up"] is False
    assert [n["overlay_up"] for n in s["nodes"]] == [True, False]
    none = provisioning_summary(_C(["a"]), {"a": {"reachable": True, "provision": {**base, "env_hash": None,
                                                                                  "firewall_up": None}}}, None)
    assert none["env_hash_match"] is False and none["firewall_up"] is None and none["overlay"] is None


def test_overlay_cost_ratios_and_medians():
    links = [{"src": "a", "dst": "b", "bandwidth_mbit": 100.0, "rtt_ms": 1.0},
             {"src": "b", "dst": "a", "bandwidth_mbit": 200.0, "rtt_ms": 1.2}]
    over = [{"src": "a", "dst": "b", "bandwidth_mbit": 90.0, "rtt_ms": 1.5},
            {"src": "b", "dst": "a", "bandwidth_mbit": None, "rtt_ms": None, "error": "b cannot reach a"}]
    c = overlay_cost(links, over)
    assert c["links"][0] == {"src": "a", "dst": "b", "underlay_mbit": 100.0, "overlay_mbit": 90.0, "bandwidth_ratio": 0.9,
                             "underlay_rtt_ms": 1.0, "overlay_rtt_ms": 1.5, "rtt_added_ms": 0.5}
    assert c["links"][1]["bandwidth_ratio"] is None and c["links"][1]["error"] == "b cannot reach a"
    assert c["bandwidth_ratio"] == 0.9 and c["rtt_added_ms"] == 0.5


def test_the_table_shows_each_node_and_the_overlay_cost_row():
    from rich.console import Console

    from vpscluster.probe.report import provisioning_table

    probe = {"provisioning": {"env_hash_match": True, "overlay": {"interface": "vpsc0"}, "nodes": [
        {"name": "a", "env_hash": "h1", "tcp_tuned": True, "firewall_up": True, "overlay_up": True,
         "overlay_interface": "vpsc0", "overlay_address": "10.77.0.1"},
        {"name": "b", "env_hash": "h1", "tcp_tuned": False, "firewall_up": None, "overlay_up": False,
         "overlay_interface": "vpsc0", "overlay_address": None},
        {"name": "c"}]},
        "overlay_cost": {"bandwidth_ratio": 0.87, "rtt_added_ms": 0.31}}
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(provisioning_table(probe))
    text = out.getvalue()
    assert "vpsc0 10.77.0.1" in text and "unreachable" in text
    row = next(line for line in text.splitlines() if "overlay cost" in line)
    assert "bandwidth x0.87, RTT +0.31 ms" in row
