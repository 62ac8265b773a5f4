"""Refuse the unsafe default: training traffic on public addresses.

torch.distributed's rendezvous store (TCPStore) and gloo accept anyone who connects: no
authentication, no encryption. On a private network (RFC 1918, carrier-grade NAT space, IPv6
unique-local, link-local) or the loopback that is the network's business; on a public address
it is anyone's. So a launch whose nodes talk over public addresses is refused, unless the
cluster runs over an encrypted overlay or the user says `--insecure-network` (or
`insecure_network: true` in the cluster file) and takes the risk knowingly.

    classify(address) -> "loopback" | "private" | "public"
    require_safe_network(cluster)       raises UserError (one line: why, and how to fix)
    require_firewall(cluster, executors, timeout_s)   pre-flight: every public node's firewall is up

An overlay record only says what `provision` set up: the launches' pre-flight checks on each node
that the interface carries the address (launch/preflight.py `check_endpoint`) before anything
listens there. And over public addresses the overlay alone is not enough: services bind to the
overlay's addresses, but the firewall (provision's nftables table) is what keeps every other
port closed to the internet, so a public node whose firewall is not loaded is refused too.

The sandbox (10.231.X.0/24 on a bridge) and the local cluster (127.0.0.1) are private/loopback
and never refused. A host name is resolved (with a time-out); one that does not resolve is
left to the launch's own connection errors rather than refused here.
"""

from __future__ import annotations

import ipaddress
import socket
import threading

from vpscluster.errors import UserError

PRIVATE_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # RFC 1918
    "100.64.0.0/10",  # carrier-grade NAT (RFC 6598): a provider's internal network
    "169.254.0.0/16",  # IPv4 link-local
    "fc00::/7",  # IPv6 unique local
    "fe80::/10",  # IPv6 link-local
))
RESOLVE_TIMEOUT_S = 5.0


def classify(address: str) -> str:
    """"loopback", "private" or "public" for an IP address (IPv4-mapped IPv6 as its IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified:
        return "loopback"  # 0.0.0.0 / :: reach this machine
    if any(ip in net for net in PRIVATE_NETWORKS if net.version == ip.version):
        return "private"
    return "public"


def resolve(host: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> list[str]:
    """The addresses of `host` (itself when it is one); [] when it does not resolve in time."""
    try:
        return [str(ipaddress.ip_address(host.split("%", 1)[0]))]
    except ValueError:
        pass
    found: list[str] = []

    def lookup() -> None:
        try:
            found.extend(sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}))
        except (socket.gaierror, UnicodeError, OSError):
            pass

    t = threading.Thread(target=lookup, daemon=True)  # getaddrinfo has no time-out of its own
    t.start()
    t.join(timeout_s)
    return list(found)


def public_nodes(cluster) -> list[tuple[str, str]]:
    """(node name, public address) for every node reached over a public address."""
    out = []
    for n in cluster.nodes:
        if getattr(n, "local", False):
            continue
        for address in resolve(n.host):
            if classify(address) == "public":
                out.append((n.name, address))
                break
    return out


TORCH = "torch.distributed's rendezvous store and gloo accept"
DASK = "Dask's scheduler and workers (plain TCP) accept"
PROBE = "the probe's link-test servers and all-reduce sweep (plain TCP, torch.distributed) accept"
MONITOR = "Prometheus and the node exporters (plain HTTP) answer"
EXEC = "what the command starts there (servers, workers) answers"


def require_safe_network(cluster, who: str = TORCH, action: str = "launch") -> None:
    """Refuse (UserError) a launch over public addresses without an overlay or an explicit opt-in.
    `who`: what listens unauthenticated (TORCH for train/run, DASK for batch, PROBE, MONITOR,
    EXEC); `action`: what is refused ("launch", "run `exec`", ...)."""
    if getattr(cluster, "insecure_network", False):
        return
    from vpscluster.cluster import overlay

    if overlay.load(cluster) is not None:  # traffic goes over the provisioned WireGuard mesh
        return
    exposed = public_nodes(cluster)
    if not exposed:
        return
    shown = ", ".join(f"{name} ({addr})" for name, addr in exposed[:3]) + (" ..." if len(exposed) > 3 else "")
    where = f" --cluster {cluster.source}" if getattr(cluster, "source", None) else ""
    raise UserError(
        f"refusing to {action} over public addresses: {shown}; {who} "
        f"anyone who connects (no authentication, no encryption). Fix: `vpscluster provision{where}` (a WireGuard "
        "overlay that launches then use by themselves, and a firewall to the cluster's peers), or pass --insecure-network "
        "(cluster file: insecure_network: true) to accept the risk")


FIREWALL_TABLE = "inet vpscluster"  # provision's firewall role (nodeside/facts.py reads the same table)
# One line on the node: "firewall: up" when the table is loaded (as root, else through sudo -n),
# "firewall: down" when it is not or cannot be read (no nft, no permission).
FIREWALL_CHECK = (f"PATH=$PATH:/usr/sbin:/sbin; if nft list table {FIREWALL_TABLE} >/dev/null 2>&1 || "
                  f"sudo -n nft list table {FIREWALL_TABLE} >/dev/null 2>&1; then echo 'firewall: up'; "
                  "else echo 'firewall: down'; fi")


async def require_firewall(cluster, executors, timeout_s: float) -> None:
    """Pre-flight: every node reached over a public address has provision's firewall loaded, else
    UserError (one line naming the nodes and the fix). Private and loopback nodes (the sandbox,
    the local cluster) and `insecure_network` are not checked."""
    import asyncio

    if getattr(cluster, "insecure_network", False):
        return
    exposed = dict(public_nodes(cluster))
    checked = [ex for ex in executors if ex.node.name in exposed]
    if not checked:
        return
    results = await asyncio.gather(*(ex.run(FIREWALL_CHECK, timeout_s=timeout_s) for ex in checked))
    down = [ex.node.name for ex, r in zip(checked, results) if "firewall: up" not in (r.stdout or "")]
    if down:
        raise UserError(firewall_down_message(down, exposed, getattr(cluster, "source", None)))


def firewall_down_message(down: list[str], exposed: dict[str, str], source: str | None) -> str:
    shown = ", ".join(f"{n} ({exposed[n]})" for n in down[:3]) + (" ..." if len(down) > 3 else "")
    where = f" --cluster {source}" if source else ""
    return (f"pre-flight: the firewall is not up on {shown} (no nftables table {FIREWALL_TABLE}), so every port "
            f"there is open to the internet; bring it up with `vpscluster provision{where} --only overlay,firewall`, "
            "or pass --insecure-network to accept the risk")
