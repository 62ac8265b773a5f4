"""Which node hangs: after a launch fails by a time-out, look for stopped processes of the launch.

A worker that is stopped (SIGSTOP, a frozen VM) keeps its TCP connections open, so its peers
only see a collective time out, and the first node to fail is one of the healthy ones. Before
teardown, each node is asked (in parallel, with a short time-out) for processes of the launch
in state T; a node with some, or one that does not answer at all, is the one to blame.
"""

from __future__ import annotations

import asyncio
import json

from vpscluster.launch.commands import LAUNCH_ID_ENV

# argv: launch id, node name. Prints {"stopped": [pids in state T or t]}. The node's name is
# checked too: where nodes share one kernel (the sandbox, the local cluster), /proc shows them all.
_STOPPED = r"""
import json, os, sys
tag = ("%s=" + sys.argv[1]).encode()
own = ("VPSC_NODE=" + sys.argv[2]).encode()
out = []
for d in os.listdir('/proc'):
    if not d.isdigit():
        continue
    try:
        with open('/proc/%%s/environ' %% d, 'rb') as f:
            env = f.read().split(b'\0')
        with open('/proc/%%s/stat' %% d) as f:
            state = f.read().rsplit(')', 1)[1].split()[0]
    except (OSError, IndexError):
        continue
    if tag in env and own in env and state in ('T', 't'):
        out.append(int(d))
print(json.dumps({"stopped": sorted(out)}))
""" % LAUNCH_ID_ENV


async def _ask(executor, launch_id: str, timeout_s: float) -> tuple[str, str | None]:
    node = executor.node
    try:
        result = await asyncio.wait_for(executor.run([node.python, "-c", _STOPPED, launch_id, node.name], timeout_s=timeout_s),
                                        timeout_s + 5)
    except asyncio.TimeoutError:
        result = None
    if result is None or result.timed_out:
        return node.name, f"node {node.name} does not answer within {timeout_s:.0f} s (hung or unreachable)"
    if not result.ok:
        return node.name, None  # unreachable for another reason: the launch's own error says more
    try:
        stopped = json.loads(result.stdout.strip().splitlines()[-1])["stopped"]
    except (ValueError, KeyError, IndexError):
        return node.name, None
    if stopped:
        return node.name, (f"node {node.name} hangs: its processes {', '.join(map(str, stopped[:5]))} are stopped "
                           f"(state T, e.g. SIGSTOP), so the other nodes timed out waiting for it")
    return node.name, None


async def find_hung(executors, launch_id: str, timeout_s: float = 10.0) -> tuple[str, str] | None:
    """(node, one-line reason) for the first node found hanging, or None when every node looks alive."""
    answers = await asyncio.gather(*(_ask(ex, launch_id, timeout_s) for ex in executors), return_exceptions=True)
    for a in answers:
        if isinstance(a, tuple) and a[1]:
            return a
    return None
