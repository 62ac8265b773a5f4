#!/usr/bin/python
"""Ansible module: this node's side of vpscluster's WireGuard mesh.

    vpscluster_wireguard:
      state: key                       # make the node's key pair (once); return its public key
      key_file: /etc/vpscluster/wireguard.key

    vpscluster_wireguard:
      state: up
      interface: vpsc0
      key_file: /etc/vpscluster/wireguard.key
      address: 10.77.0.2/24
      port: 51820
      peers: [{public_key: ..., endpoint: 10.0.0.3:51820, allowed_ip: 10.77.0.3/32}, ...]

The private key is generated on the node and never leaves it (only the public key is returned).
The interface is the kernel's WireGuard where the kernel has it, else wireguard-go (user space).
Idempotent: compares `wg show <if> dump` and the interface's address with what is asked and
changes only the difference; check mode reports it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ansible.module_utils.basic import AnsibleModule


def run(module, argv, input=None, check=True, timeout=30):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout,
                           stdin=None if input is not None else subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, FileNotFoundError) as e:
        module.fail_json(msg=f"`{' '.join(argv)}`: {e}")
    if check and p.returncode != 0:
        module.fail_json(msg=f"`{' '.join(argv)}` failed: {(p.stderr or p.stdout).strip()[-400:]}")
    return p


def ensure_key(module, key_file):
    changed = False
    if not os.path.exists(key_file):
        if module.check_mode:
            return None, True
        os.makedirs(os.path.dirname(key_file), mode=0o700, exist_ok=True)
        private = run(module, ["wg", "genkey"]).stdout.strip()
        fd = os.open(key_file + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(private + "\n")
        os.replace(key_file + ".tmp", key_file)
        changed = True
    with open(key_file) as f:
        private = f.read().strip()
    public = run(module, ["wg", "pubkey"], input=private + "\n").stdout.strip()
    return public, changed


def current(module, interface):
    """(exists, own public key, listen port, {peer key: (endpoint, allowed ips)}, addresses)."""
    if run(module, ["ip", "link", "show", interface], check=False).returncode != 0:
        return False, None, None, {}, set()
    dump = run(module, ["wg", "show", interface, "dump"], check=False).stdout.strip().splitlines()
    own_pub = port = None
    peers = {}
    if dump:
        head = dump[0].split("\t")
        own_pub, port = head[1], int(head[2]) if head[2].isdigit() else None
        for line in dump[1:]:
            f = line.split("\t")
            peers[f[0]] = (f[2], f[3])
    addrs = set()
    for line in run(module, ["ip", "-o", "addr", "show", "dev", interface], check=False).stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            addrs.add(parts[parts.index("inet") + 1])
    return True, own_pub, port, peers, addrs


def main():
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "choices": ["key", "up"], "default": "up"},
            "interface": {"type": "str", "default": "vpsc0"},
            "key_file": {"type": "path", "required": True},
            "address": {"type": "str"},
            "port": {"type": "int", "default": 51820},
            "peers": {"type": "list", "elements": "dict", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    if p["state"] == "key":
        public, changed = ensure_key(module, p["key_file"])
        module.exit_json(changed=changed, public_key=public,
                         changes=[f"{p['key_file']}: generated"] if changed else [])

    public, key_changed = ensure_key(module, p["key_file"])
    iface = p["interface"]
    exists, own_pub, port, peers, addrs = current(module, iface)
    wanted_peers = {x["public_key"]: (x["endpoint"], x["allowed_ip"]) for x in p["peers"] if x.get("public_key")}
    changes = []
    if not exists:
        changes.append(f"{iface}: created")
    if own_pub != public or port != p["port"]:
        changes.append(f"{iface}: key/port set (port {p['port']})")
    for k, v in wanted_peers.items():
        if peers.get(k) != v:
            changes.append(f"{iface}: peer {v[1]} at {v[0]}")
    for k in peers:
        if k not in wanted_peers:
            changes.append(f"{iface}: stale peer removed")
    if p["address"] not in addrs:
        changes.append(f"{iface}: address {p['address']}")
    if changes and not module.check_mode:
        if not exists:
            made = run(module, ["ip", "link", "add", iface, "type", "wireguard"], check=False)
            if made.returncode != 0:
                if not shutil.which("wireguard-go"):
                    module.fail_json(msg="this kernel has no WireGuard and wireguard-go is not installed "
                                         "(apt-get install wireguard-go wireguard-tools)")
                run(module, ["wireguard-go", iface], timeout=30)
        run(module, ["wg", "set", iface, "private-key", p["key_file"], "listen-port", str(p["port"])])
        for k in peers:
            if k not in wanted_peers:
                run(module, ["wg", "set", iface, "peer", k, "remove"])
        for k, (endpoint, allowed) in wanted_peers.items():
            if peers.get(k) != (endpoint, allowed):
                run(module, ["wg", "set", iface, "peer", k, "endpoint", endpoint, "allowed-ips", allowed,
                             "persistent-keepalive", "25"])
        for a in addrs - {p["address"]}:
            run(module, ["ip", "addr", "del", a, "dev", iface])
        if p["address"] not in addrs:
            run(module, ["ip", "addr", "add", p["address"], "dev", iface])
        run(module, ["ip", "link", "set", iface, "up"])
    module.exit_json(changed=bool(changes), changes=changes, public_key=public,
                     values={"interface": iface, "address": p["address"]})


if __name__ == "__main__":
    main()
