"""The sandbox's CPU limits on both cgroup hierarchies.

v2 (cpu.max, the unified hierarchy of current distributions) is driven against a fake cgroup tree
in a temp folder, since this machine's kernel mounts v1; the live v1 path is exercised in a real
cgroup here and by the sandbox tests (test_sandbox_cpu.py, test_sandbox_lifecycle.py).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest

from vpscluster.cluster.sandbox import cgroup
from vpscluster.cluster.sandbox.cgroup import Hierarchy
from vpscluster.errors import UserError

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def fake_v2_root(tmp_path: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    root = tmp_path / "cgroup2"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


def v2_mountinfo(root: Path, opts: str = "rw,nosuid,nodev,noexec,relatime") -> str:
    return (f"22 1 0:20 / /proc rw,nosuid - proc proc rw\n"
            f"26 22 0:23 / {root} {opts} shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n")


def test_v1_wins_on_a_hybrid_host():
    h, why = cgroup.detect(HYBRID)
    assert h == Hierarchy("v1", Path("/sys/fs/cgroup/cpu")) and why == ""


def test_v2_detected_from_the_unified_mount(tmp_path):
    root = fake_v2_root(tmp_path)
    h, _ = cgroup.detect(v2_mountinfo(root))
    assert h == Hierarchy("v2", root)
    assert "cpu.max" in h.describe()


@pytest.mark.parametrize("case, expected", [
    ("no cpu controller", "does not offer the cpu controller"),
    ("read-only", "not writable"),
    ("nothing mounted", "no cgroup v1 hierarchy with the cpu controller and no cgroup v2"),
])
def test_no_usable_hierarchy_says_why(tmp_path, case, expected):
    if case == "no cpu controller":
        text = v2_mountinfo(fake_v2_root(tmp_path, controllers="io memory pids"))
    elif case == "read-only":
        text = v2_mountinfo(fake_v2_root(tmp_path), opts="ro,nosuid,nodev,noexec,relatime")
    else:
        text = "22 1 0:20 / /proc rw,nosuid - proc proc rw\n"
    h, why = cgroup.detect(text)
    assert h is None and expected in why


def test_v2_node_cgroups_get_cpu_max_and_the_controller(tmp_path, monkeypatch):
    root = fake_v2_root(tmp_path)
    (root / "cgroup.subtree_control").write_text("cpu io\n")  # as systemd leaves the root
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    h = Hierarchy("v2", root)
    limited = h.create("sb", "node-1", 0.45, sandbox_nodes=2)
    free = h.create("sb", "node-2", None, sandbox_nodes=2)
    assert limited == root / "vpscluster" / "sb" / "node-1"
    assert (limited / "cpu.max").read_text() == "9000 20000"
    assert (free / "cpu.max").read_text() == "max 20000"
    assert h.quota(limited) == pytest.approx(0.45) and h.quota(free) is None
    # Each ancestor hands the cpu controller down; the root already did, so it is left alone.
    assert (root / "cgroup.subtree_control").read_text() == "cpu io\n"
    assert (root / "vpscluster" / "cgroup.subtree_control").read_text() == "+cpu"
    assert (root / "vpscluster" / "sb" / "cgroup.subtree_control").read_text() == "+cpu"
    # Weights in cpu.weight (default 100), the same ratios as v1's cpu.shares (default 1024).
    assert (root / "vpscluster" / "cpu.weight").read_text() == str(100 * 2 * 4)
    assert (root / "vpscluster" / "sb" / "cpu.weight").read_text() == "200"
    assert not list(root.rglob("cpu.cfs_*")) and not list(root.rglob("cpu.shares"))
    # The smallest quota the kernel takes is 1 ms per period.
    assert (h.create("sb", "node-3", 0.01) / "cpu.max").read_text() == "1000 20000"


def test_v2_controller_that_cannot_be_enabled_is_one_line(tmp_path):
    root = fake_v2_root(tmp_path)
    (root / "cgroup.subtree_control").unlink()
    (root / "cgroup.subtree_control").mkdir()  # writing to it fails, as a refused write would
    with pytest.raises(UserError, match=r"cannot enable the cpu controller in .*cgroup.subtree_control") as e:
        Hierarchy("v2", root).create("sb", "node-1", 0.5)
    assert "\n" not in str(e.value)


def test_sandbox_up_without_a_usable_hierarchy_is_one_line_and_creates_nothing(monkeypatch, capsys):
    from sandbox_fixtures import TEST_PREFIX, sandbox_unavailable_reason
    from vpscluster.cli import main
    from vpscluster.cluster.sandbox import state

    if os.geteuid() != 0:
        pytest.skip("needs root: `sandbox up` checks root before cgroups")
    monkeypatch.setattr(cgroup, "_current", (None, "the cgroup v2 hierarchy at /x does not offer the cpu controller"))
    assert sandbox_unavailable_reason() == "the cgroup v2 hierarchy at /x does not offer the cpu controller"
    name = f"{TEST_PREFIX}nocg-{secrets.token_hex(2)}"
    assert main(["sandbox", "up", "--name", name, "--nodes", "1"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot limit CPU: the cgroup v2 hierarchy at /x" in err, err
    assert not state.state_dir(name).exists()


@pytest.mark.sandbox
def test_live_quota_and_the_json_says_which(make_sandbox, cli):
    """In the real kernel: v1 on this project's CI machine (cpu.cfs_quota_us), v2 where it is unified."""
    info = make_sandbox(nodes=2, bandwidth="1gbit", cpu="0.5,none")
    h = cgroup.current()
    assert info.cgroup == h.version and info.to_dict()["cgroup"] == h.version
    n1, n2 = (Path(n.cgroup) for n in info.nodes)
    assert n1.parent.parent == h.parent and n1.is_relative_to(h.root)
    assert cgroup.quota(n1) == pytest.approx(0.5) and cgroup.quota(n2) is None
    if h.version == "v1":
        assert int((n1 / "cpu.cfs_quota_us").read_text()) == 10_000
    else:
        assert (n1 / "cpu.max").read_text().split() == ["10000", "20000"]
    rec = json.loads(cli("sandbox", "status", "--name", info.name, "--json").stdout)["sandboxes"][0]
    assert rec["cgroup"] == h.version
    files = "cpu.cfs_quota_us" if h.version == "v1" else "cpu.max"
    assert f"CPU limits: cgroup {h.version} ({files})" in cli("sandbox", "status", "--name", info.name).stdout
