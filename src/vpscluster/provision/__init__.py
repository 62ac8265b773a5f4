"""Provisioning: from bare rented machines to identical, tuned, firewalled nodes (Ansible).

    provision(cluster, roles=None, check=False, timeout_s=900, probe=None) -> dict

runs the playbook shipped in `vpscluster/provision/playbook/` (site.yml, one role per concern:
env, tcp, firewall, overlay) with ansible-core's `ansible-playbook` against an inventory generated from the
cluster file (inventory.py), and returns what happened per node and role:

    {"check": false, "roles": ["env", "tcp", "firewall", "overlay"], "changed": 0, "failed": 0, "summary": "no changes",
     "nodes": [{"name", "status", "ok", "changed", "failed", "skipped", "unreachable",
                "roles": {"tcp": {"ok", "changed", "failed", "skipped"}}, "changes": [...],
                "not_settable": {...}, "errors": [...]}], "notes": [...]}

Idempotent: a second run reports "no changes". `check=True` is Ansible's check mode with diffs:
what would change, nothing changed. The playbook is plain Ansible and may be run by hand
(`playbook_dir()`), e.g. `ansible-playbook -i inventory.json site.yml --check --diff`.
What provision sets up survives a reboot: the firewall role writes /etc/vpscluster/firewall.nft,
includes it from /etc/nftables.conf and enables nftables.service; the overlay role writes the
mesh's peers and a unit (vpscluster-overlay.service) that brings the interface up at boot and,
where the kernel has no WireGuard, runs wireguard-go under systemd (Restart=always). The
controller gets SSH only: its address is the cluster file's `firewall: {controller: [...]}`, and
only where `ssh_from` limits SSH and that key is unset, each node's SSH_CLIENT (a note says so).
Inventory values are tagged `!unsafe`: cluster-file text is never an Ansible template.
Safety (refusing public launches without an overlay) is in `netsafety.py`. After the overlay
role ran on every node, `report["overlay"]` holds each node's private address and the record
(cluster/overlay.py) from which train, run and batch bind to the mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from vpscluster.cluster.node import Cluster
from vpscluster.errors import UserError

ROLES = ("env", "tcp", "firewall", "overlay")  # in the order the playbook runs them
FUTURE_ROLES: dict[str, str] = {}
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
              progress: Callable[[str], None] | None = None, env_packages: Sequence[str] | None = None,
              wheelhouse: Path | None = None) -> dict:
    """Run the roles on every node; the report (see the module's docstring).

    `env_packages` narrows the env role to these installed packages (default: vpscluster and its
    whole run-time closure); `wheelhouse` is where the controller keeps the wheels.
    """
    from vpscluster.provision.inventory import build_inventory, tcp_buffer_bytes
    from vpscluster.provision.runner import run_playbook, summarize

    say = progress or (lambda _m: None)
    chosen = parse_roles(roles)
    refuse_shared_filesystem_sandbox(cluster)
    extra: dict = {"tcp_buffer_bytes": tcp_buffer_bytes(probe)}
    if "env" in chosen:
        extra.update(env_vars(env_packages, wheelhouse, say))
    inventory = build_inventory(cluster, extra)
    raw = run_playbook(playbook_dir() / "site.yml", inventory, tags=chosen, check=check, timeout_s=timeout_s,
                       progress=progress)
    report = summarize(raw, [n.name for n in cluster.nodes], chosen, check)
    report["tcp_buffer_bytes"] = extra["tcp_buffer_bytes"]
    if "firewall" in chosen and cluster.firewall_ssh_from and not cluster.firewall_controller:
        for n in report["nodes"]:  # said out loud: the fallback that sudo may clear and NAT may share
            n["notes"].append("firewall: SSH is limited to firewall.ssh_from, and this machine's address was taken "
                              "from the node's SSH_CLIENT; set firewall.controller in the cluster file")
    if "overlay" in chosen and not check:
        report["overlay"] = record_overlay(cluster, report)
    if "env" in chosen:
        add_gpu_checks(cluster, report, timeout_s=min(timeout_s, 120.0))
        report["env"] = {"hash": extra["env_hash"], "python": extra["env_python_version"],
                         "packages": extra["env_requirements"]}
        if not check:
            record_venvs(cluster, report)
    return report


def record_venvs(cluster: Cluster, report: dict) -> None:
    """Record each provisioned node's venv, so launches run it (cluster/venv.py) without the
    cluster file being edited; say so per node."""
    from vpscluster.cluster import venv

    by_name = {n.name: n for n in cluster.nodes}
    done = {r["name"]: venv_python(by_name[r["name"]]) for r in report["nodes"]
            if r["name"] in by_name and r["status"] != "failed"}
    if not done:
        return
    path = venv.save(cluster, done)
    report["env"]["record"] = str(path)
    for r in report["nodes"]:
        if r["name"] in done:
            r["notes"].append(f"launches on {r['name']} now run {done[r['name']]} (recorded in {path}; "
                              "a `python:` you write for it in the cluster file later wins)")


def venv_python(node) -> str:
    """The interpreter of the node's provisioned venv (the env role's `<workdir>/venv`)."""
    return f"{node.workdir.rstrip('/')}/venv/bin/python"


def gpu_check_command(node) -> str:
    """The node's CUDA/driver pairing, with the provisioned venv's Python where there is one."""
    import shlex

    from vpscluster import nodeside
    from vpscluster.launch.commands import shell_path

    argv = nodeside.command("PY", "facts", "--gpu-check")[1:]
    return (f"p={shell_path(venv_python(node))}; [ -x \"$p\" ] || p={shlex.quote(node.python)}; "
            f"exec \"$p\" {shlex.join(argv)}")


def add_gpu_checks(cluster: Cluster, report: dict, timeout_s: float) -> None:
    """Each node's NVIDIA driver against the installed torch's CUDA build (`gpu_check` per node:
    "no GPU" on CPU nodes). A node whose torch cannot use its GPU with that driver fails."""
    import asyncio

    from vpscluster import nodeside
    from vpscluster.cluster.inventory import open_executors

    async def gather() -> dict[str, dict]:
        async with open_executors(cluster) as executors:
            async def one(ex):
                r = await ex.run(gpu_check_command(ex.node), timeout_s=timeout_s)
                doc = nodeside.parse_json_output(r.stdout) if r.stdout else None
                return ex.node.name, doc or {"status": "unknown", "message": f"gpu check failed: {r.reason()}"}
            return dict(await asyncio.gather(*(one(ex) for ex in executors)))

    checks = asyncio.run(gather())
    for n in report["nodes"]:
        g = checks.get(n["name"])
        if g is None:
            continue
        n["gpu_check"] = g
        if g.get("status") in ("mismatch", "driver error"):
            n["errors"].append(f"env: CUDA/driver: {g.get('message')}")
            n["status"] = "failed"
        elif g.get("gpu"):
            n["notes"].append(f"CUDA/driver: {g.get('message')}")
    bad = [n["name"] for n in report["nodes"] if n.get("gpu_check", {}).get("status") in ("mismatch", "driver error")]
    if bad:
        report["ok"] = False
        report["summary"] += f"; torch's CUDA build does not fit the driver on {', '.join(bad)}"


def record_overlay(cluster: Cluster, report: dict) -> dict | None:
    """After the overlay role ran on every node: record it, so launches bind to it (cluster/overlay.py).
    A failed run records nothing and forgets an older record (the mesh may be half made)."""
    from vpscluster.cluster import overlay
    from vpscluster.provision.inventory import OVERLAY_INTERFACE, OVERLAY_SUBNET, overlay_addresses

    if not report.get("ok"):
        overlay.forget(cluster)
        return None
    addresses = overlay_addresses(cluster)
    path = overlay.save(cluster, OVERLAY_INTERFACE, addresses, OVERLAY_SUBNET)
    return {"interface": OVERLAY_INTERFACE, "subnet": OVERLAY_SUBNET, "addresses": addresses, "record": str(path)}


def refuse_shared_filesystem_sandbox(cluster: Cluster) -> None:
    """Sandbox nodes without --own-root share this machine's files: provisioning them would write
    this machine's /etc (sysctl.d, nftables.conf). Refused, with the fix."""
    from vpscluster.cluster.sandbox import state

    for n in cluster.nodes:
        name = n.labels.get("sandbox")
        if not name:
            continue
        try:
            info = state.load_info(state.check_name(name))
        except UserError:
            continue
        if info is not None and not info.own_root and any(x.address == n.host for x in info.nodes):
            raise UserError(f"provision: node {n.name} is a node of sandbox {name!r}, which shares this machine's "
                            "filesystem: provisioning it would change this machine's /etc; rebuild it with "
                            f"`vpscluster sandbox down --name {name} && vpscluster sandbox up --name {name} --own-root`")


def env_vars(packages: Sequence[str] | None, wheelhouse: Path | None, say: Callable[[str], None]) -> dict:
    """The env role's inventory variables: the pinned list, its hash, the wheels (made here once)."""
    from vpscluster.provision import env

    if packages is None:
        reqs = env.pinned_requirements()
    else:
        from importlib import metadata

        reqs = {}
        for name in packages:
            try:
                reqs[env.canonical(name)] = metadata.version(name)
            except metadata.PackageNotFoundError:
                raise UserError(f"provision env: {name} is not installed on this machine; install it here first") from None
    say(f"wheelhouse: {len(reqs)} packages")
    directory = env.build_wheelhouse(reqs, wheelhouse, say)
    wheels = {n: str(env._have_wheel(directory, n, v)) for n, v in reqs.items()}
    return {"env_requirements": reqs, "env_hash": env.env_hash(reqs), "env_python_version": env.python_version(),
            "env_wheels": wheels}
