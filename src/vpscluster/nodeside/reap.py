"""Stop every process tagged with a launch id on this node, then check that none is left.

A launch puts `<VAR>=<launch id>` in the environment of every process it starts (workers
inherit it), so the processes are found in /proc whatever the process tree: SIGTERM, a grace
period, SIGKILL for the rest, a wait for them to go. Processes without the exact tag are never
touched. Standard library only; run with the node's own Python (see `vpscluster.nodeside`).

Usage: python reap.py VAR LAUNCH_ID GRACE_S KILL_WAIT_S
Prints {"found": [pids tagged at the start], "left": [pids still alive at the end, must be []]}.
"""

import json
import os
import signal
import sys
import time


def tagged(tag, me=None):
    """Pids (not zombies, not `me`) whose environment holds the exact entry `tag` (bytes)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open("/proc/%s/environ" % d, "rb") as f:
                env = f.read().split(b"\0")
            with open("/proc/%s/stat" % d) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag in env and state != "Z":
            out.append(int(d))
    return out


def reap(tag, grace_s, kill_wait_s):
    me = os.getpid()

    def signal_all(sig):
        for p in tagged(tag, me):
            try:
                os.kill(p, sig)
            except OSError:
                pass

    def wait_gone(seconds):
        end = time.time() + seconds
        while time.time() < end and tagged(tag, me):
            time.sleep(0.2)

    found = tagged(tag, me)
    if found:
        signal_all(signal.SIGTERM)
        wait_gone(grace_s)
        signal_all(signal.SIGKILL)
        wait_gone(kill_wait_s)
    return {"found": found, "left": tagged(tag, me)}


def main(argv):
    if len(argv) != 5 or not argv[1] or not argv[2]:
        print("usage: reap.py VAR LAUNCH_ID GRACE_S KILL_WAIT_S", file=sys.stderr)
        return 2
    tag = ("%s=%s" % (argv[1], argv[2])).encode()
    print(json.dumps(reap(tag, float(argv[3]), float(argv[4]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
