"""Provisioning: from bare rented machines to identical, tuned, firewalled nodes (Ansible).

    provision(cluster, roles=None, check=False, timeout_s=900, probe=None) -> dict

runs the playbook shipped in `vpscluster/provision/playbook/` (site.yml, one role per concern:
tcp, firewall) with ansible-core's `ansible-playbook` against an inventory generated from the
cluster file (inventory.py), and returns what happened per node and role:

    {"check": false, "roles": ["tcp", "firewall"], "changed": 0, "failed": 0, "summary": "no changes",
     "nodes": [{"name", "status", "ok", "changed", "failed", "skipped", "unreachable",
                "roles": {"tcp": {"ok", "changed", "failed", "skipped"}}, "changes": [...],
                "not_settable": {...}, "errors": [...]}], "notes": [...]}

Idempotent: a second run reports "no changes". `check=True` is Ansible's check mode with diffs:
what would change, nothing changed. The playbook is plain Ansible and may be run by hand
(`playbook_dir()`), e.g. `ansible-playbook -i inventory.json site.yml --check --diff`.
Safety (refusing public launches without an overlay) is in `netsafety.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from vpscluster.cluster.node import Cluster
from vpscluster.errors import UserError

ROLES = ("tcp", "firewall")  # in the order the playbook runs them
FUTURE_ROLES = {"env": "a pinned venv pushed from the controller", "overlay": "a WireGuard mesh"}
DEFAULT_TIMEOUT_S = 900.0


def playbook_dir() -> Path:
    return Path(__file__).resolve().parent / "playbook"


def parse_roles(text: str | Sequence[str] | None) -> list[str]:
    """`--only tcp,firewall` -> ["tcp", "firewall"] (playbook order); None: every role."""
    if text is None:
        return list(ROLES)
    items = text.split(",") if isinstance(text, str) else list(text)
    wanted = [r.strip() for r in items if r.strip()]
    if not wanted:
        raise UserError(f"provision: --only is empty; name roles from {', '.join(ROLES)}")
    for r in wanted:
        if r in FUTURE_ROLES:
            raise UserError(f"provision: role {r!r} ({FUTURE_ROLES[r]}) is not built yet; "
                            f"available: {', '.join(ROLES)}")
        if r not in ROLES:
            raise UserError(f"provision: unknown role {r!r} in --only; choose from {', '.join(ROLES)}")
    return [r for r in ROLES if r in wanted]


def provision(cluster: Cluster, roles: Sequence[str] | str | None = None, check: bool = False,
              timeout_s: float = DEFAULT_TIMEOUT_S, probe: dict | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    from vpscluster.provision.inventory import build_inventory, tcp_buffer_bytes
    from vpscluster.provision.runner import run_playbook, summarize

    chosen = parse_roles(roles)
    extra = {"tcp_buffer_bytes": tcp_buffer_bytes(probe)}
    inventory = build_inventory(cluster, extra)
    raw = run_playbook(playbook_dir() / "site.yml", inventory, tags=chosen, check=check, timeout_s=timeout_s,
                       progress=progress)
    report = summarize(raw, [n.name for n in cluster.nodes], chosen, check)
    report["tcp_buffer_bytes"] = extra["tcp_buffer_bytes"]
    return report
