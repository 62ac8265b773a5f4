"""Sandbox nodes with their own filesystem (`sandbox up --own-root`): a node's writes stay on
its own disk (not on another node, not on the host), it still reaches the host's tools through
the lower layer, and `sandbox down` leaves no mount behind anywhere on the machine.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from sandbox_fixtures import TEST_PREFIX, sandbox_unavailable_reason, ssh_run

pytestmark = [pytest.mark.sandbox]


@pytest.fixture(scope="module")
def own_root2():
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.sandbox import rootfs

    why = sandbox_unavailable_reason() or rootfs.supported()
    if why:
        pytest.skip(f"sandbox unavailable: {why}")
    name = f"{TEST_PREFIX}pv-{secrets.token_hex(3)}"
    try:
        yield sandbox.up(name, nodes=2, bandwidth="1gbit", own_root=True)
    finally:
        sandbox.down(name)


def test_a_file_written_on_one_node_is_on_no_other_node_nor_the_host(own_root2):
    marker = f"pv-marker-{secrets.token_hex(4)}"
    path = f"/srv/{marker}"
    try:
        r = ssh_run(own_root2, "node-1", f"echo from-$(hostname) > {path} && cat {path} && hostname && cat /etc/hostname")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["from-node-1", "node-1", "node-1"]
        other = ssh_run(own_root2, "node-2", f"test ! -e {path} && echo absent")
        assert other.returncode == 0 and other.stdout.strip() == "absent", (other.stdout, other.stderr)
        assert not Path(path).exists()
        # It landed in node-1's upper layer: that is the node's disk.
        upper = Path(own_root2.state_dir) / "nodes" / "node-1" / "rootfs" / "upper" / "srv" / marker
        assert upper.read_text() == "from-node-1\n"
        # The host's tools are there (lower layer), the node's /etc is its own.
        r = ssh_run(own_root2, "node-2", "python3 -c 'print(6*7)' && echo 10.0.0.9 extra >> /etc/hosts && grep -c extra /etc/hosts")
        assert r.stdout.split() == ["42", "1"], r.stderr
        assert "10.0.0.9 extra" not in Path("/etc/hosts").read_text()
    finally:
        Path(path).unlink(missing_ok=True)  # only if the test failed the way it checks


def test_down_leaves_no_mounts_and_no_files():
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.sandbox import rootfs

    why = sandbox_unavailable_reason() or rootfs.supported()
    if why:
        pytest.skip(f"sandbox unavailable: {why}")
    name = f"{TEST_PREFIX}pv-{secrets.token_hex(3)}"
    try:
        info = sandbox.up(name, nodes=1, own_root=True)
        assert info.own_root and sandbox.status(name)[0]["state"] == "up"
        assert ssh_run(info, "node-1", "echo x > /opt/pv-x").returncode == 0
        assert rootfs.host_mounts(info.state_dir), "the node's overlay should be mounted while it is up"
    finally:
        removed = sandbox.down(name)
    assert removed
    state_dir = str(Path("/var/lib/vpscluster/sandboxes") / name)
    assert rootfs.host_mounts(state_dir) == []
    assert not Path(state_dir).exists()


def test_provision_refuses_sandbox_nodes_that_share_this_machines_files(cli):
    """Without --own-root a node's /etc is the host's: provision must not write there."""
    from vpscluster.cluster import sandbox
    from vpscluster.cluster.sandbox import rootfs

    why = sandbox_unavailable_reason() or rootfs.supported()
    if why:
        pytest.skip(f"sandbox unavailable: {why}")
    name = f"{TEST_PREFIX}pv-{secrets.token_hex(3)}"
    try:
        info = sandbox.up(name, nodes=1)
        r = cli("provision", "--cluster", info.cluster_file, "--only", "tcp", timeout=120)
    finally:
        sandbox.down(name)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "shares this machine's filesystem" in lines[0] and "--own-root" in lines[0]


def test_the_cluster_files_python_runs_on_own_root_nodes(own_root2):
    """The sandbox's cluster file names this machine's interpreter; own-root nodes see the host's
    files except their own /root, /tmp and /run, where a venv or the Python behind it (pyenv)
    may live: those folders are lent, read-only, so the interpreter runs there with its torch."""
    import sys

    import yaml

    from vpscluster.cluster.sandbox import rootfs

    python = yaml.safe_load(Path(own_root2.cluster_file).read_text())["defaults"]["python"]
    assert python == sys.executable
    for n in own_root2.nodes:
        r = ssh_run(own_root2, n.name, f"{python} -c 'import sys, torch; print(sys.prefix)'")
        assert r.returncode == 0 and r.stdout.split() == [sys.prefix], (r.stdout, r.stderr[-1500:])
    for lent in rootfs.lent_dirs():  # read-only there, and nothing of it reaches the host's own folders
        r = ssh_run(own_root2, "node-1", f"touch {lent}/pv-probe")
        assert r.returncode != 0 and "Read-only file system" in r.stderr, (r.stdout, r.stderr)
        assert not Path(lent, "pv-probe").exists()
