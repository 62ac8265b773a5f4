"""Stop everything a launch started, on every node, and check that nothing is left.

Killing torchrun's process group is not enough: the elastic agent starts each worker in a new
session (`start_new_session=True`), so a worker outlives an agent killed before it could pass
the signal on — the classic orphaned training process holding a GPU after Ctrl-C. Every process
a launch starts carries `VPSC_LAUNCH_ID=<rendezvous id>` in its environment (workers inherit
it), so the node finds them all in /proc whatever the process tree: SIGTERM, a grace period,
SIGKILL for the rest, and a final look that must come back empty (`vpscluster.nodeside.reap`,
run with the node's own Python).
"""

from __future__ import annotations

import asyncio
import json
import shlex
from dataclasses import dataclass

from vpscluster import nodeside
from vpscluster.launch.commands import LAUNCH_ID_ENV


NODE_LOCK = "launch.lock"


def guarded(python: str, launch_id: str, shell_line: str, grace_s: float = 5.0, lock_path: str | None = None) -> str:
    """The node command line running `shell_line` under the node-side guard (`reap.py guard`),
    with the node's `python`: a launcher that dies, even by SIGKILL, leaves nothing running.
    `lock_path` (the run's folder on the node / NODE_LOCK): one launch of the run at a time there.

    `exec`: the guard replaces the shell the executor starts, so its parent is the launcher's
    process (local) or the SSH wrapper, and it leads the process group they signal."""
    lock = ["--lock", lock_path] if lock_path else []
    argv = nodeside.command(python, "reap", "guard", LAUNCH_ID_ENV, launch_id, "%g" % grace_s, *lock,
                            "/bin/sh", "-c", shell_line)
    return "exec " + shlex.join(argv)


@dataclass
class ReapResult:
    node: str
    found: list[int]  # tagged processes still running when teardown began
    left: list[int]  # still running at the end (must be empty)
    error: str | None = None

    @property
    def clean(self) -> bool:
        return self.error is None and not self.left


async def reap_node(executor, launch_id: str, grace_s: float = 6.0, kill_wait_s: float = 3.0,
                    timeout_s: float | None = None, this_node_only: bool = False) -> ReapResult:
    """Stop the launch's processes on the node. `this_node_only`: those started for this node alone
    (their VPSC_NODE), where nodes may share a /proc (a sandbox) and the others' must live on."""
    node = executor.node
    timeout_s = timeout_s if timeout_s is not None else grace_s + kill_wait_s + 25.0
    also = [f"VPSC_NODE={node.name}"] if this_node_only else []
    result = await executor.run(
        nodeside.command(node.python, "reap", LAUNCH_ID_ENV, launch_id, str(grace_s), str(kill_wait_s), *also),
        timeout_s=timeout_s,
    )
    if not result.ok:
        why = result.reason()
        why = why[len(node.name) + 2:] if why.startswith(f"{node.name}: ") else why
        return ReapResult(node.name, [], [], error=why)
    try:
        doc = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return ReapResult(node.name, [], [], error=f"unreadable answer {result.stdout[-200:]!r}")
    return ReapResult(node.name, doc["found"], doc["left"])


async def teardown(executors, handles, launch_id: str, grace_s: float = 6.0) -> list[ReapResult]:
    """Stop the started processes and verify, on every node in parallel."""
    results = await asyncio.gather(*(reap_node(ex, launch_id, grace_s=grace_s) for ex in executors))
    # The agents are gone now; this closes the channels (and kills the group if a node's /proc
    # was unreadable to us).
    await asyncio.gather(*(h.stop(grace_s=1.0) for h in handles if h is not None), return_exceptions=True)
    return list(results)
