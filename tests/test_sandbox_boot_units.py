"""The sandbox's minimal init (cluster/sandbox/boot.py) without a sandbox: which units a node
enabled on its own disk, in what order, and the shell a boot runs for them (oneshot in turn;
simple in the background, restarted in a loop when the unit says Restart=)."""

from __future__ import annotations

import shlex
import subprocess

from vpscluster.cluster.sandbox import boot

NFTABLES = """[Unit]
Description=nftables
Before=network-pre.target
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/sbin/nft -f /etc/nftables.conf
[Install]
WantedBy=sysinit.target
"""
OVERLAY = """[Unit]
After=network-online.target nftables.service
[Service]
Type=simple
Environment=A=1 "B=two words"
ExecStartPre=-/bin/sh -c 'ip link delete vpsc0'
ExecStart=/bin/sh -c 'exec sleep 30'
ExecStartPost=/bin/sh -c 'echo up'
Restart=always
RestartSec=2
"""


def make_root(tmp_path):
    root, upper = tmp_path / "merged", tmp_path / "upper"
    (root / "lib/systemd/system").mkdir(parents=True)
    (root / "lib/systemd/system/nftables.service").write_text(NFTABLES)
    (root / "lib/systemd/system/ssh.service").write_text("[Service]\nExecStart=/usr/sbin/sshd -D\n")
    (root / "etc/systemd/system/aaa-overlay.service.d").mkdir(parents=True)
    (root / "etc/systemd/system/aaa-overlay.service").write_text(OVERLAY)
    (root / "etc/systemd/system/aaa-overlay.service.d/late.conf").write_text("[Service]\nRestartSec=3\n")
    # Enabled on the node's own disk; ssh.service only in the lower (host) layer: not the node's.
    for target, unit in (("sysinit.target.wants", "nftables.service"), ("multi-user.target.wants", "aaa-overlay.service")):
        (upper / "etc/systemd/system" / target).mkdir(parents=True, exist_ok=True)
        (upper / "etc/systemd/system" / target / unit).symlink_to(f"/lib/systemd/system/{unit}")
    (root / "etc/systemd/system/multi-user.target.wants").mkdir(parents=True)
    (root / "etc/systemd/system/multi-user.target.wants/ssh.service").symlink_to("/lib/systemd/system/ssh.service")
    return root, upper


def test_enabled_units_are_the_nodes_own_in_boot_order(tmp_path):
    root, upper = make_root(tmp_path)
    assert boot.enabled_units(upper, root) == ["nftables.service", "aaa-overlay.service"]
    unit = boot.load_unit(root, "aaa-overlay.service")
    assert unit["Service"]["RestartSec"] == ["2", "3"] and unit["Service"]["Type"] == ["simple"]


def test_unit_scripts_run_as_a_boot_would(tmp_path):
    root, upper = make_root(tmp_path)
    names, script = boot.boot_script(root, upper)
    lines = script.splitlines()
    nft = next(line for line in lines if "nftables.service" in line)
    assert nft.startswith("if ( /usr/sbin/nft -f /etc/nftables.conf || exit 1; true )")
    overlay = next(line for line in lines if "aaa-overlay.service" in line)
    assert overlay.startswith("setsid sh -c ") and overlay.endswith("& echo aaa-overlay.service started")
    inner = shlex.split(overlay)[3]  # setsid sh -c SCRIPT ...
    for part in ("export A=1", "export 'B=two words'", "while :;", "sleep 3", "exec sleep 30", "|| kill $p"):
        assert part in inner, (part, inner)
    # The shell accepts every line (syntax only; nothing runs).
    r = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr


def test_oneshot_failure_is_reported_and_dash_ignores_one(tmp_path):
    log = tmp_path / "log"
    ok = boot.unit_script("a.service", {"Service": {"Type": ["oneshot"], "ExecStartPre": ["-/bin/false"],
                                                    "ExecStart": ["/bin/true"]}})
    bad = boot.unit_script("b.service", {"Service": {"Type": ["oneshot"], "ExecStart": ["/bin/false", "/bin/true"]}})
    script = (ok + "\n" + bad).replace(boot.LOG, str(log))
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10)
    assert r.stdout.split("\n")[:2] == ["a.service started", "b.service failed"], r.stdout
