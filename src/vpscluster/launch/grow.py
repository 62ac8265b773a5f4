"""Nodes added to a running quorum job: the cluster file, edited while the job runs.

The cluster file is the user's record of the machines (DESIGN.md's contract: no other place
names them), so adding a node to a running `train --quorum` job is adding its entry there, as
for a new run. The launcher looks at the file every `recovery.rejoin_poll_s` (`ClusterFileWatch`:
its size and modification time first, its nodes when either changed) and starts every node
that is new (a name the run does not have) within the running launch (launch/pipeline.py,
`_quorum_rejoin`): the file as a whole still valid (`ClusterFileWatch.new`), the node on the
overlay when the run uses one and no public launch without it (`extended`), its environment
against the others' (`check_env`: the probe's facts and problem rules, the Python and PyTorch
versions among them), then the launch's own pre-flight (reachable, workdir, firewall,
interface), the sync of code and data, and a new replica group with a fresh replica id. One
that fails any of these gets one line and the job goes on; saving the file again retries it.

A node removed from the file is drained (launch/quorum.py `watch`, `Rejoin.drain`): the launcher
creates the drain file in its run dir over SSH (`quorum.DRAIN_FILE`); its replica group finishes
the round it is in, takes part in that round's outer sync, stops heartbeating to the lighthouse
beforehand so the others' next quorum does not wait for it, and exits 0
(train/strategies/quorum_diloco.py says how). The launcher then says "NODE drained at step N:
removed from the cluster file", reaps what the launch left there and forgets the node: the run
records a `quorum_drain` recovery, and a relaunch leaves it out. Put back in the file later, it
joins again as a new node (a fresh replica id). Refused with one line, the node staying
(`removal_refused`): the head (it runs the lighthouse), and a removal that would leave fewer
replica groups than the quorum's minimum (--min-nodes); saving the file again retries it. A node
out of the run already (lost, waiting to be started again) is simply not started again. A node
whose entry changed keeps running as it was started.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from vpscluster.errors import RemoteError, UserError


class ClusterFileWatch:
    """The nodes added to a cluster file since the run started (`new()`, each reported once), and
    the names removed from it (`removed()`, each reported once, taken at the same reading)."""

    def __init__(self, path: str, known: list[str]) -> None:
        self.path = path
        self.known = set(known)
        # None: the first look reads the file, so a node added while the launch started is seen too.
        self._seen: tuple[int, int] | None = None
        self.changed_at: float | None = None  # the file's modification time (Unix) at the last change seen
        self._removed: list[str] = []  # names gone from the file, not yet taken by `removed()`

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def new(self) -> list[Any]:
        """The nodes (cluster.node.Node) in the file whose names the run does not know yet; []
        while the file is unchanged. UserError (one line) when the changed file does not load."""
        from vpscluster.cluster.inventory import load_cluster

        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return []
        self._seen = stamp
        self.changed_at = stamp[0] / 1e9
        cluster = load_cluster(self.path)  # a half-written or broken file: its one line, and the job goes on
        names = {n.name for n in cluster.nodes}
        gone = sorted(self.known - names)
        self.known -= set(gone)
        self._removed += [n for n in gone if n not in self._removed]
        fresh = [n for n in cluster.nodes if n.name not in self.known]
        self.known.update(n.name for n in fresh)
        return fresh

    def removed(self) -> list[str]:
        """The names gone from the file since the last call (each once: put back later, a name
        is a new node again), as `new()` found them."""
        gone, self._removed = self._removed, []
        return gone

    def keep(self, name: str) -> None:
        """`name`'s removal was refused: it stays in the run, and the next change of the file
        that still lacks it reports it again."""
        self.known.add(name)

    def forget(self, name: str) -> None:
        """`name` was not added after all: the next change of the file offers it again."""
        self.known.discard(name)


def removal_refused(node: str, head: str, present: int, min_replicas: int) -> str | None:
    """Why `node`, removed from the cluster file, cannot be drained (one line; it stays), or None.
    `present`: the replica groups training now, `node`'s among them."""
    if node == head:
        return (f"node {node} stays: it is the head (it runs the quorum's lighthouse) and cannot be drained from a "
                f"running job; put it back in the cluster file, or stop the run and start it with another head")
    if present - 1 < min_replicas:
        return (f"node {node} stays: draining it would leave {present - 1} replica group{'s' if present != 2 else ''}, "
                f"fewer than the quorum's minimum of {min_replicas} (--min-nodes); add a node first, or put it back "
                "in the cluster file")
    return None


def extended(cluster, node):
    """`cluster` with `node` added, refused (UserError, one line) where the launch would be unsafe
    or the node off the run's network: a run over the WireGuard overlay needs the node on it (the
    record must hold it), and without one no public address is launched to (cluster/netsafety.py)."""
    from vpscluster.cluster import overlay
    from vpscluster.cluster.netsafety import require_safe_network

    if node.local != cluster.nodes[0].local:
        raise UserError(f"node {node.name}: a local node cannot join a cluster of SSH nodes, nor the reverse")
    grown = dataclasses.replace(cluster, nodes=(*cluster.nodes, node))
    where = f" --cluster {cluster.source}" if cluster.source else ""
    if not cluster.is_local and overlay.load(cluster) is not None and overlay.load(grown) is None:
        raise UserError(f"node {node.name} is not on the run's WireGuard overlay; add it with "
                        f"`vpscluster provision{where} --only overlay,firewall` (the running nodes keep theirs)")
    require_safe_network(grown)
    return grown


async def check_env(cluster, ex, others: list[dict]) -> dict:
    """The added node's facts (a quick probe's), checked with the probe's own rules against the
    running nodes' facts `others`: a node it could not run on, or whose Python or PyTorch differ,
    is refused (RemoteError, one line with the probe's fix). Its facts otherwise."""
    from vpscluster.cluster import overlay
    from vpscluster.probe.api import ProbeSettings
    from vpscluster.probe.facts import gather_one
    from vpscluster.probe.problems import blocking_problems, find_problems

    node = ex.node
    mesh = None if cluster.is_local else overlay.load(cluster)
    facts = await gather_one(node, ex, ProbeSettings.make(quick=True).facts, overlay_interface=mesh.interface if mesh else overlay.DEFAULT_INTERFACE)
    found = blocking_problems({"problems": find_problems({"nodes": [*others, facts]})})
    mine = [p for p in found if node.name in p.get("nodes", [])]
    if mine:
        first = mine[0]
        message = str(first.get("message", "")).strip()
        if message.startswith(f"{node.name}: "):
            message = message[len(node.name) + 2:]
        raise RemoteError(f"pre-flight: {message}; {first.get('fix') or 'fix it'}")
    return facts
