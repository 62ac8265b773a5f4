"""What `vpscluster provision` generates, rendered by Ansible's own templating and compared with
snapshots (regenerate with VPSC_UPDATE_SNAPSHOTS=1, see snapshot_check.py): the nftables ruleset
(the controller gets SSH only; ICMP echo limited ahead of conntrack), the WireGuard unit and
peers file a boot brings the mesh up from, and the inventory, whose every string is `!unsafe`.
Rulesets are also checked by `nft -c`."""

from __future__ import annotations

import subprocess

from snapshot_check import check_snapshot
from vpscluster.cluster.node import Cluster, Node
from vpscluster.provision import playbook_dir
from vpscluster.provision.inventory import build_inventory, inventory_yaml

ROLES = playbook_dir() / "roles"
PEERS = ["10.0.0.3", "10.77.0.2"]
CONTROLLER = "203.0.113.7"


def render(path, variables: dict) -> str:
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar

    templar = Templar(loader=DataLoader(), variables=variables)
    return templar.template(path.read_text(), preserve_trailing_newlines=True, escape_backslashes=False,
                            convert_data=False)


def ruleset(ssh_from: list[str], controller: list[str], ssh_client: str = "") -> str:
    import yaml

    defaults = yaml.safe_load((ROLES / "firewall/defaults/main.yml").read_text())
    variables = {**defaults, "firewall_peers": PEERS, "firewall_allow": [5432], "firewall_ssh_from": ssh_from,
                 "firewall_controller": controller, "firewall_overlay_port": 51820,
                 "vpscluster_controller": {"stdout": ssh_client} if ssh_client else {"skipped": True}}
    return render(ROLES / "firewall/templates/firewall.nft.j2", variables)


CASES = {
    "ssh_open_controller_set": ([], [CONTROLLER], "198.51.100.9"),
    "ssh_limited_controller_set": (["198.51.100.0/24"], [CONTROLLER], "198.51.100.9"),
    "ssh_limited_ssh_client_fallback": (["198.51.100.0/24"], [], CONTROLLER),
}


def test_firewall_ruleset_snapshot_and_the_controller_gets_ssh_only():
    rendered = {case: ruleset(*args) for case, args in CASES.items()}
    check_snapshot("provision_firewall.json", rendered)
    for case, text in rendered.items():
        lines = [line.strip() for line in text.splitlines()]
        # The controller appears only in the SSH rule, never in a rule that opens other ports.
        for line in lines:
            if CONTROLLER in line:
                assert line.endswith("tcp dport 22 accept"), (case, line)
        assert not any(line.startswith("ip saddr 198.51.100.9") for line in lines), case  # SSH_CLIENT unused
        # Echo requests are limited before conntrack could call a one-id flood "established".
        order = [lines.index(x) for x in ("icmp type echo-request limit rate 5/second burst 10 packets accept",
                                          "icmp type echo-request drop", "ct state established,related accept")]
        assert order == sorted(order), (case, order)
    assert "ip saddr { 198.51.100.0/24, 203.0.113.7 } tcp dport 22 accept" in rendered["ssh_limited_controller_set"]
    assert "ip saddr { 198.51.100.0/24, 203.0.113.7 } tcp dport 22 accept" in rendered["ssh_limited_ssh_client_fallback"]
    assert CONTROLLER not in rendered["ssh_open_controller_set"]  # SSH is open anyway: nothing to add


def test_firewall_rulesets_parse(tmp_path):
    for case, args in CASES.items():
        f = tmp_path / f"{case}.nft"
        f.write_text(ruleset(*args))
        r = subprocess.run(["nft", "-c", "-f", str(f)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (case, r.stderr)


def overlay_files(kernel: bool) -> dict:
    import yaml

    defaults = yaml.safe_load((ROLES / "overlay/defaults/main.yml").read_text())
    variables = {**defaults, "overlay_address": "10.77.0.1", "overlay_kernel": kernel,
                 "vpscluster_wg_peers": [{"public_key": "PUB2=", "endpoint": "10.0.0.3:51820", "allowed_ip": "10.77.0.2/32"},
                                         {"public_key": "PUB3=", "endpoint": "10.0.0.4:51820", "allowed_ip": "10.77.0.3/32"}]}
    return {"unit": render(ROLES / "overlay/templates/vpscluster-overlay.service.j2", variables),
            "peers": render(ROLES / "overlay/templates/wireguard-peers.conf.j2", variables)}


def test_overlay_unit_and_peers_snapshot():
    files = {"wireguard-go": overlay_files(kernel=False), "kernel": overlay_files(kernel=True)}
    check_snapshot("provision_overlay.json", files)
    user = files["wireguard-go"]["unit"]
    assert "Restart=always" in user and "wireguard-go --foreground vpsc0" in user  # supervised by systemd
    assert "WantedBy=multi-user.target" in user and "PrivateKey" not in files["kernel"]["peers"]


def test_inventory_strings_are_unsafe_for_ansible():
    """Every string of the inventory file reaches Ansible as unsafe text: templating it (as a
    role does with `{{ vpscluster_workdir }}`) gives the characters, and runs no lookup."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.utils.unsafe_proxy import AnsibleUnsafeText

    lookup = "/srv/{{ lookup('pipe', 'echo pwned') }}"
    cluster = Cluster(nodes=(Node("a", "10.0.0.2", workdir=lookup, user="deploy", identity_file="/k"),
                             Node("b", "10.0.0.3")), head="a", known_hosts="/kh", firewall_controller=(CONTROLLER + "/32",))
    text = inventory_yaml(build_inventory(cluster, {"tcp_buffer_bytes": 1 << 24}))
    check_snapshot("provision_inventory.json", {"inventory.yml": text})
    doc = DataLoader().load(text)
    group = doc["all"]["children"]["cluster"]
    host = group["hosts"]["a"]
    assert isinstance(host["vpscluster_workdir"], AnsibleUnsafeText) and host["vpscluster_workdir"] == lookup
    assert all(isinstance(v, AnsibleUnsafeText) for v in host["firewall_peers"] + group["vars"]["firewall_controller"])
    assert host["ansible_port"] == 22 and group["vars"]["tcp_buffer_bytes"] == 1 << 24  # numbers stay numbers
    templar = Templar(loader=DataLoader(), variables={"vpscluster_workdir": host["vpscluster_workdir"]})
    assert templar.template("{{ vpscluster_workdir }}/venv") == lookup + "/venv"
