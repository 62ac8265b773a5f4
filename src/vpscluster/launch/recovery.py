"""Going on after a failure: relaunch on the nodes that answer, take returning nodes back.

`train --max-restarts N --min-nodes M` (TrainConfig.recovery), and `run` with the same flags for a
script on the session API (its session resumes from its newest checkpoint). The engines stay what
they are — torchrun on every node, the pipeline's teardown, the session's checkpoints — and
recovery is the launcher's loop around them (launch/supervisor.py, for train and run alike), as
a managed job's controller does it (SkyPilot's managed jobs, torchrun's own `--max-restarts`
for the workers of one node). This module holds its rules and node checks:

1. A launch fails (a node died, hangs, or its link is down: the survivors' collectives time
   out, the pipeline names the node and stops every process it can reach).
2. The nodes the pipeline's teardown could not reach over SSH are out; at least `min_nodes`
   must remain (default: all). The run relaunches on those with `--resume`, and
   each rank resumes from the newest checkpoint, re-cut for the ranks present
   (train/checkpoint.py) — for DiLoCo the outer syncs go on over the nodes present, weighted by
   tokens. The rendezvous moves to the first node that answers when the head is gone.
   A relaunch that fails before training (a node failing its pre-flight or sync, a returning
   node that drops again) leaves out the nodes at fault (`at_fault`: those not `ready`, else
   those its error names), counts a restart and goes on, as a failure in training does.
3. While some node is out, the launcher looks every `rejoin_poll_s` whether it is ready again
   (`wait_for_any`): it answers, and where the cluster runs over the overlay, its interface
   carries the node's address (a rebooted VPS answers, but its wireguard-go died with it). When it is, the run is stopped at a checkpoint (as by Ctrl-C), whatever
   that node still runs of earlier launches is reaped (`reap_left`), and the run relaunches
   with it: the returning node receives the newest checkpoint from a holder over the process
   group and trains again.

At most `max_restarts` relaunches after failures (a rejoin is not a failure and is not
counted); every one is recorded in the report's `recoveries`.

Survival is the default (`policy`): on a cluster file of two or more nodes, with neither flag
given, a failed launch is relaunched up to `default_restarts(N)` times while at least
`default_min_nodes(N)` of the N nodes answer — half of them, rounded up. Half, not a strict
majority: only the launcher decides who takes part, so two halves never train apart, and a
majority would leave a two-node run no survivor. Memory does not raise that floor: every node
holds a whole replica (DDP and DiLoCo alike; vpscluster's trainer shards nothing), so a rank on
fewer nodes needs no more memory than on all of them (plan/memory.py; DiLoCo's int8 buffers
shrink) — each node was checked at the start. `--max-restarts 0` turns it off; the local
cluster (one machine, no node to lose) keeps it off unless `--max-restarts` is given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Sequence


def default_min_nodes(nodes: int) -> int:
    """The fewest nodes a run goes on with when `--min-nodes` is not given: half, rounded up."""
    return max(1, (nodes + 1) // 2)


def default_restarts(nodes: int) -> int:
    """Relaunches after failures when `--max-restarts` is not given: two per node, at least 3."""
    return max(3, 2 * nodes)


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a run does after a failure: `max_restarts` relaunches while `min_nodes` of `nodes` answer."""

    max_restarts: int
    min_nodes: int
    nodes: int
    by_default: bool  # neither --max-restarts nor --min-nodes came from the user
    local: bool = False

    @property
    def on(self) -> bool:
        return self.max_restarts > 0

    def line(self) -> str:
        """One line for the start of the run (and the dry run)."""
        if not self.on:
            if self.local and self.by_default:
                return ("recovery: off (the local cluster has no node to lose; --max-restarts N relaunches "
                        "from the last checkpoint after a failure)")
            if self.nodes < 2 and self.by_default:
                return "recovery: off (one node: none to lose; --max-restarts N relaunches it after a failure)"
            return "recovery: off (--max-restarts 0: the first failure ends the run)"
        floor = f"at least {self.min_nodes} of {self.nodes} node{'s' if self.nodes != 1 else ''} remain"
        how = " (half, rounded up; --min-nodes M sets it)" if self.by_default else ""
        return (f"recovery: on (after a failure the run relaunches from the last checkpoint on the nodes that "
                f"answer while {floor}{how}, up to {self.max_restarts} restart{'s' if self.max_restarts != 1 else ''}; "
                "--max-restarts 0 turns it off)")


def policy(recovery_cfg, nodes: int, local: bool) -> Policy:
    """The run's recovery: `recovery_cfg` (TrainConfig.recovery) as given, its defaults filled in
    for a cluster of `nodes` (`local`: this machine's local cluster)."""
    given = recovery_cfg.max_restarts
    restarts = given if given is not None else (0 if local or nodes < 2 else default_restarts(nodes))
    return Policy(max_restarts=restarts, min_nodes=recovery_cfg.min_nodes or default_min_nodes(nodes), nodes=nodes,
                  by_default=given is None and not recovery_cfg.min_nodes, local=local)


def subset(cluster, names: Sequence[str]):
    """The cluster with only `names` (in the file's order); the head stays where it was when it is
    among them, else the first of them hosts the rendezvous."""
    keep = tuple(n for n in cluster.nodes if n.name in set(names))
    if not keep:
        raise ValueError("no node left")
    head = cluster.head if any(n.name == cluster.head for n in keep) else keep[0].name
    return dataclasses.replace(cluster, nodes=keep, head=head)


async def ready(cluster, names: Sequence[str], timeout_s: float | None = None) -> list[str]:
    """The nodes among `names` that can take part in a launch now (in the file's order): they run a
    command over SSH and, when `cluster` runs over the provisioned overlay, its interface carries
    their overlay address. `cluster`: the whole cluster of the run, whose overlay record decides."""
    from vpscluster.cluster import overlay
    from vpscluster.cluster.inventory import open_executors
    from vpscluster.launch.netif import interface_for_address

    if not names:
        return []
    mesh = overlay.load(cluster)
    part = subset(cluster, names)
    timeout_s = timeout_s or cluster.connect_timeout_s + 5.0
    async with open_executors(part) as executors:
        results = await asyncio.gather(*(ex.run("ip -o addr" if mesh else ["true"], timeout_s=timeout_s)
                                         for ex in executors), return_exceptions=True)  # an error: not ready
    return [ex.node.name for ex, r in zip(executors, results) if not isinstance(r, BaseException) and r.ok and (
        mesh is None or interface_for_address(r.stdout, mesh.addresses[ex.node.name]) == mesh.interface)]


async def at_fault(cluster, names: Sequence[str], error: BaseException) -> list[str]:
    """The nodes to leave out after a relaunch on `names` failed before it trained (pre-flight,
    sync): those not `ready`, else (a node's own error) the ones its message names; [] when
    neither points at a node."""
    from vpscluster.errors import RemoteError

    out = [n for n in names if n not in await ready(cluster, names)]
    if out or not isinstance(error, RemoteError):
        return out
    return [n for n in names if re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w-])", str(error))]


async def wait_for_any(cluster, names: Sequence[str], poll_s: float) -> list[str]:
    """Return (the ones that are ready) once any of `names` is `ready` again; polls every `poll_s`."""
    while True:
        back = await ready(cluster, names)
        if back:
            return back
        await asyncio.sleep(poll_s)


async def reap_left(cluster, names: Sequence[str], launch_ids: Sequence[str], grace_s: float) -> list[str]:
    """Stop what earlier launches left on these nodes (a node cut off could not be torn down);
    the problems, as lines (empty: nothing left)."""
    from vpscluster.cluster.inventory import open_executors
    from vpscluster.launch.teardown import reap_node

    if not names or not launch_ids:
        return []
    problems = []
    async with open_executors(subset(cluster, names)) as executors:
        for launch_id in launch_ids:
            results = await asyncio.gather(*(reap_node(ex, launch_id, grace_s=grace_s) for ex in executors))
            problems += [f"{r.node}: {r.error or f'pids {r.left} still running'}" for r in results if not r.clean]
    return problems
