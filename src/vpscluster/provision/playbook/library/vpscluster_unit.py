#!/usr/bin/python
"""Ansible module: a systemd unit enabled at boot (and, where systemd runs, started now).

    vpscluster_unit:
      name: nftables.service
      enabled: true            # `systemctl enable` (links into the unit's [Install] WantedBy=)
      started: false           # also start it now when systemd is the init (not for nftables:
                               # its /etc/nftables.conf may hold rules of the node's own)
      restarted: false         # restart it now (its unit file changed), where systemd runs

`systemctl enable` works without a running systemd (it only writes the .wants links), so a node
whose init is not systemd (a container, vpscluster's sandbox) still gets the links a real boot
would follow; starting is then left to that boot, and a note says so. Idempotent
(`systemctl is-enabled` / `is-active` first); check mode reports what would change.
"""

from __future__ import annotations

import os
import subprocess

from ansible.module_utils.basic import AnsibleModule


def systemctl(module, *args, check=True, timeout=60):
    argv = ["systemctl", *args]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, FileNotFoundError) as e:
        module.fail_json(msg=f"`{' '.join(argv)}`: {e}")
    if check and p.returncode != 0:
        module.fail_json(msg=f"`{' '.join(argv)}` failed: {(p.stderr or p.stdout).strip()[-400:]}")
    return p


def systemd_runs() -> bool:
    """systemd is this machine's init (what sd_booted(3) checks)."""
    return os.path.isdir("/run/systemd/system")


def main():
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "required": True},
            "enabled": {"type": "bool", "default": True},
            "started": {"type": "bool", "default": False},
            "restarted": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    name = module.params["name"]
    changes, notes = [], []
    running = systemd_runs()
    if module.params["enabled"] and systemctl(module, "is-enabled", name, check=False).stdout.strip() != "enabled":
        changes.append(f"{name}: enabled at boot")
        if not module.check_mode:
            systemctl(module, "enable", name)
            if not running:
                notes.append(f"systemd is not this node's init: {name} is enabled for the next boot, not started now")
    if running and (module.params["started"] or module.params["restarted"]):
        if not module.check_mode:
            systemctl(module, "daemon-reload")
        active = systemctl(module, "is-active", name, check=False).stdout.strip() == "active"
        if module.params["restarted"] or not active:
            changes.append(f"{name}: {'restarted' if active else 'started'}")
            if not module.check_mode:
                systemctl(module, "restart", name)
    module.exit_json(changed=bool(changes), changes=changes, notes=notes, values={"name": name, "systemd": running})


if __name__ == "__main__":
    main()
