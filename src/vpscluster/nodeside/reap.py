"""Stop every process tagged with a launch id on this node, then check that none is left; or
guard a launch's command so that it stops when the launcher is gone.

A launch puts `<VAR>=<launch id>` in the environment of every process it starts (workers
inherit it), so the processes are found in /proc whatever the process tree: SIGTERM, a grace
period, SIGKILL for the rest, a wait for them to go. Processes without the exact tag are never
touched. Standard library only; run with the node's own Python (see `vpscluster.nodeside`).

Usage: python reap.py VAR LAUNCH_ID GRACE_S KILL_WAIT_S [VAR2=VALUE2]
Prints {"found": [pids tagged at the start], "left": [pids still alive at the end, must be []]}.
VAR2=VALUE2: only the tagged processes whose environment holds that entry too (the launch's
processes of one node, `VPSC_NODE=NAME`, where nodes share one /proc: a sandbox).

Usage: python reap.py guard VAR LAUNCH_ID GRACE_S COMMAND...
Every node command of a launch runs under the guard. It starts COMMAND as its child and waits
for it, exiting as it exits (same status, same signal). It reaps the whole launch on its node
(as above) when
- the launcher is gone: the guard's parent changes (the launcher's process on the local
  cluster, the SSH wrapper on a remote node, was killed: SIGKILL, a closed laptop); checked
  every POLL_S seconds;
- it receives SIGTERM, SIGHUP or SIGINT: the SSH wrapper's watchdog sends SIGTERM to the
  command's group as soon as the channel closes (a killed launcher, a cut connection).
torchrun's workers run in sessions of their own, so a process group is not enough: the tag is.
A launcher SIGKILLed mid-run therefore leaves nothing running on any node after about
POLL_S + GRACE_S + 1 s.

Usage: python reap.py guard VAR LAUNCH_ID GRACE_S --lock PATH COMMAND...
One launch per run on this node: PATH (`launch.lock` in the run's folder on the node) records
{"run", "launch_id", "var", "guard_pid", "host", "started"} and the guard holds an exclusive
flock on it for its life. A guard of another launch of the same run is refused (one line on
stderr, exit status LOCKED, COMMAND never started) while the recorded launch's guard holds the
lock or any process tagged with its launch id still lives (workers left behind by a guard that
died); it waits up to LOCK_WAIT_S first, for a launch being torn down to finish going.
"""

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

POLL_S = 0.5
# torchrun's agents: once every worker is gone they have nothing left to save, but after a
# SIGTERM an agent can linger in its shutdown (threads, the rendezvous) for half a minute; the
# grace period is for the workers (a checkpoint), so the agents alone get at most this long.
AGENT_MARKERS = (b"torch.distributed.run", b"torchrun", b"torch.distributed.launch")
AGENT_GRACE_S = 3.0
LOCK_WAIT_S = 5.0
LOCKED = 75  # EX_TEMPFAIL: another launch of this run holds the node


def tagged(tag, me=None, also=None):
    """Pids (not zombies, not `me`) whose environment holds the exact entry `tag` (bytes), and
    `also` (bytes) when given."""
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
        if tag in env and (also is None or also in env) and state != "Z":
            out.append(int(d))
    return out


def is_agent(pid):
    """Whether `pid` is a torchrun elastic agent (by its command line)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(m in arg for arg in argv[:6] for m in AGENT_MARKERS)


def reap(tag, grace_s, kill_wait_s, also=None):
    me = os.getpid()

    def signal_all(sig):
        for p in tagged(tag, me, also):
            try:
                os.kill(p, sig)
            except OSError:
                pass

    def wait_gone(seconds):
        end = time.time() + seconds
        while time.time() < end and tagged(tag, me, also):
            time.sleep(0.2)

    def wait_workers_gone(seconds):
        """Wait up to `seconds` for every tagged process to go, but only AGENT_GRACE_S once
        nothing but torchrun agents is left."""
        end = time.time() + seconds
        agents_only_since = None
        while time.time() < end:
            left = tagged(tag, me, also)
            if not left:
                return
            if all(is_agent(p) for p in left):
                agents_only_since = agents_only_since or time.time()
                if time.time() - agents_only_since >= min(AGENT_GRACE_S, seconds):
                    return
            else:
                agents_only_since = None
            time.sleep(0.2)

    found = tagged(tag, me, also)
    if found:
        signal_all(signal.SIGTERM)
        signal_all(signal.SIGCONT)  # a stopped process (SIGSTOP) acts on SIGTERM only once it runs
        wait_workers_gone(grace_s)
        signal_all(signal.SIGKILL)
        wait_gone(kill_wait_s)
    return {"found": found, "left": tagged(tag, me, also)}


def take_lock(path, var, launch_id):
    """The run's node lock for this launch: the open fd (held until the guard exits), or the
    refusal line when another launch of the run is alive here."""
    path = os.path.expanduser(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    end = time.time() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except OSError:
            held = True
        prev = _read_record(fd)
        other = prev.get("launch_id") if prev.get("launch_id") != launch_id else None
        alive = tagged(("%s=%s" % (prev.get("var") or var, other)).encode(), os.getpid()) if other else []
        if not held and not alive:
            break
        if time.time() >= end:
            os.close(fd)
            who = "its guard (pid %s) holds the lock" % prev.get("guard_pid", "?") if held else \
                "%d of its processes live (pids %s)" % (len(alive), " ".join(map(str, alive[:5])))
            return None, ("vpscluster guard: run %s already runs on this node (launch %s: %s); refusing a second launch "
                          "of it: stop the first (`vpscluster stop RUN_DIR` on its launcher's machine, or wait for it) "
                          "and resume after" % (prev.get("run") or "?", other or "?", who))
        if not held:
            fcntl.flock(fd, fcntl.LOCK_UN)
        time.sleep(0.2)
    record = {"run": os.path.basename(os.path.dirname(os.path.abspath(path))), "launch_id": launch_id, "var": var,
              "guard_pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd, None


def _read_record(fd):
    try:
        doc = json.loads(os.pread(fd, 65536, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def guard(tag, grace_s, command, lock=None):
    """Run `command`; reap the launch when the launcher is gone or we are told to stop.
    `lock`: (path, var, launch id) of the run's node lock, taken first (see the module)."""
    if lock is not None:
        fd, refused = take_lock(*lock)
        if fd is None:
            sys.stderr.write(refused + "\n")
            sys.stderr.flush()
            return LOCKED
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
                sys.stderr.write("vpscluster guard: %s; stopping launch %s on this node\n" % (why, tag.decode()))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            reap(tag, grace_s, 3.0)
            try:
                status = child.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                child.kill()
                status = child.wait()
            break
    if status < 0:  # died of a signal: so does the guard, so the caller sees the same thing
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot have a handler
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        time.sleep(1.0)
    return status if status >= 0 else 128 - status


def main(argv):
    if len(argv) >= 6 and argv[1] == "guard" and argv[2] and argv[3]:
        tag = ("%s=%s" % (argv[2], argv[3])).encode()
        if argv[5] == "--lock" and len(argv) >= 8:
            return guard(tag, float(argv[4]), argv[7:], lock=(argv[6], argv[2], argv[3]))
        return guard(tag, float(argv[4]), argv[5:])
    also = argv.pop(5).encode() if len(argv) == 6 and "=" in argv[5] else None
    if len(argv) != 5 or not argv[1] or not argv[2]:
        print("usage: reap.py VAR LAUNCH_ID GRACE_S KILL_WAIT_S [VAR2=VALUE2] | reap.py guard VAR LAUNCH_ID GRACE_S [--lock PATH] COMMAND...",
              file=sys.stderr)
        return 2
    tag = ("%s=%s" % (argv[1], argv[2])).encode()
    print(json.dumps(reap(tag, float(argv[3]), float(argv[4]), also)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
