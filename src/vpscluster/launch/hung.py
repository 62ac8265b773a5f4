"""Which node hangs: after a launch fails by a time-out, look for stopped processes of the launch.

A worker that is stopped (SIGSTOP, a frozen VM) keeps its TCP connections open, so its peers
only see a collective time out, and the first node to fail is one of the healthy ones. Before
teardown, each node is asked (in parallel, with a short time-out) for processes of the launch
in state T; a node with some, or one that does not answer at all, is the one to blame.
"""

from __future__ import annotations

import asyncio

# Plain POSIX sh (no Python on the node): $1 the launch id, $2 the node's name; prints the pids
# of the launch's processes on this node that are stopped (state T or t), one per line. The
# node's name is checked too: where nodes share one kernel (the sandbox, the local cluster),
# /proc shows them all.
_STOPPED = r"""
for f in $(grep -laF "VPSC_LAUNCH_ID=$1" /proc/[0-9]*/environ 2>/dev/null); do
  d=${f%/environ}
  env=$(tr '\0' '\n' < "$f" 2>/dev/null) || continue
  printf '%s\n' "$env" | grep -qxF "VPSC_LAUNCH_ID=$1" || continue
  printf '%s\n' "$env" | grep -qxF "VPSC_NODE=$2" || continue
  state=$(sed 's/.*) //' "$d/stat" 2>/dev/null | cut -d' ' -f1)
  case "$state" in T|t) echo "${d#/proc/}" ;; esac
done
exit 0
"""


async def _ask(executor, launch_id: str, timeout_s: float) -> tuple[str, str | None]:
    node = executor.node
    try:
        result = await asyncio.wait_for(executor.run(["sh", "-c", _STOPPED, "sh", launch_id, node.name],
                                                     timeout_s=timeout_s), timeout_s + 5)
    except asyncio.TimeoutError:
        result = None
    if result is None or result.timed_out:
        return node.name, f"node {node.name} does not answer within {timeout_s:.0f} s (hung or unreachable)"
    if not result.ok:
        return node.name, None  # unreachable for another reason: the launch's own error says more
    stopped = [int(w) for w in result.stdout.split() if w.isdigit()]
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
