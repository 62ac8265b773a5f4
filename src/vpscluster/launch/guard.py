"""Node-side guard: a launch's processes stop when the launcher is gone (standalone, stdlib only).

Every node command of a launch runs under this guard:

    python -c <this file> LAUNCH_ID GRACE_S COMMAND...

The guard starts COMMAND as its child and waits for it, exiting as it exits (same status, same
signal). It stops the whole launch on its node when
- the launcher is gone: the guard's parent changes (the launcher's process on the local
  cluster, the SSH wrapper on a remote node, was killed: SIGKILL, a closed laptop); checked
  every POLL_S seconds;
- it receives SIGTERM, SIGHUP or SIGINT: the SSH wrapper's watchdog sends SIGTERM to the
  command's group as soon as the channel closes (a killed launcher, a cut connection).
Stopping means: SIGTERM to every process of the node carrying VPSC_LAUNCH_ID=LAUNCH_ID in its
environment (torchrun's workers run in sessions of their own, so a process group is not
enough), GRACE_S seconds for them to finish cleanly, then SIGKILL. A launcher SIGKILLed
mid-run therefore leaves nothing running on any node after about POLL_S + GRACE_S + 1 s.

It is sent as source text (`python -c`), so a node needs no vpscluster installed to run it.
`wrap()` builds that command line on the launcher's side.
"""

import os
import signal
import subprocess
import sys
import time

ENV = "VPSC_LAUNCH_ID"
POLL_S = 0.5


def tagged(launch_id):
    """Live processes of this machine carrying ENV=launch_id (zombies excluded), not this one."""
    tag = ("%s=%s" % (ENV, launch_id)).encode()
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open("/proc/%s/environ" % d, "rb") as f:
                env = f.read().split(b"\0")
            with open("/proc/%s/stat" % d) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if tag in env and state != "Z":
            out.append(int(d))
    return out


def stop_launch(launch_id, grace_s):
    """SIGTERM (and SIGCONT, for a stopped one) every tagged process, then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 3.0)):
        pids = tagged(launch_id)
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, sig)
                if sig == signal.SIGTERM:
                    os.kill(p, signal.SIGCONT)
            except OSError:
                pass
        end = time.time() + wait_s
        while time.time() < end and tagged(launch_id):
            time.sleep(0.1)


def main(argv):
    launch_id, grace_s, command = argv[0], float(argv[1]), argv[2:]
    parent = os.getppid()
    told = []
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: told.append(signum))
    child = subprocess.Popen(command)
    while True:
        try:
            status = child.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if told or os.getppid() != parent:
            why = ("signal %d" % told[0]) if told else "the launcher is gone"
            try:  # the launcher reading our stderr may be gone: a broken pipe must not stop us
                sys.stderr.write("vpscluster guard: %s; stopping launch %s on this node\n" % (why, launch_id))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            stop_launch(launch_id, grace_s)
            try:
                status = child.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                child.kill()
                status = child.wait()
            break
    if status < 0:  # died of a signal: so does the guard, so the caller sees the same thing
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        time.sleep(1.0)
    return status if status >= 0 else 128 - status


def wrap(python, launch_id, shell_line, grace_s=5.0):
    """The node command line running `shell_line` under the guard, with the node's `python`."""
    import shlex

    with open(__file__) as f:
        source = f.read()
    # `exec`: the guard replaces the shell the executor starts, so its parent is the launcher's
    # process (local) or the SSH wrapper, and it leads the process group they signal.
    return "exec " + shlex.join([python, "-c", source, launch_id, "%g" % grace_s, "/bin/sh", "-c", shell_line])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
