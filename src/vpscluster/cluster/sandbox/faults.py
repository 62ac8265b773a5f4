"""Faults on demand in a sandbox: what real VPS fleets do to a run, at a chosen moment.

    inject(name, node, kind, seconds=None, rate=None) -> dict   start a fault (and its timer)
    clear(name, node=None) -> list[dict]                        end every active fault (of a node)
    active(name) -> list[dict]                                  the faults now in force

Kinds (`vpscluster sandbox fault --name N --node X KIND ...`):

    kill                SIGKILL every process of the node (its cgroup and its network namespace)
                        except the listening sshd daemon: the node "reboots" at once — all its work
                        and SSH sessions are gone, and it is reachable again (as a VPS back from a
                        reboot). The daemon is kept on purpose, so that rejoin can be tested; use
                        link-down to make a node unreachable as well. Nothing to restore.
    reboot              (nodes with their own root) as kill, then the node's interfaces, nftables
                        ruleset and /run are reset and the units it enabled in its own /etc are
                        started as a boot would (boot.py): what a provisioned node keeps over a
                        real reboot comes back, and what it does not keep stays gone.
    stop SECONDS        SIGSTOP every process of the node except sshd (daemon and sessions), then
                        SIGCONT after SECONDS: a hung process (or a VM frozen by its host) whose
                        TCP connections stay open, so only a time-out can notice it.
    link-down SECONDS   the node's host-side veth down, then up after SECONDS: a cable pulled.
                        Packets are dropped silently (no error reaches the node's processes at once).
    throttle RATE SECONDS  the node's tc rate (both directions) set to RATE, then back to its rate.
    disk-full [SECONDS] the node's workdir filesystem (a tmpfs of its own, see `up`) shrunk to what it
                        holds and the rest filled, so every write there fails with ENOSPC; restored
                        by `clear` (or after SECONDS).

A timed fault is ended by a detached timer process (own session, stdin/stdout closed), so it is
restored even when the CLI that started it exits or is killed; `clear` ends faults at once and
stops their timers. Active faults are recorded in <state dir>/faults.json; restoring is
idempotent, and a second fault of the same kind on the same node is refused until the first ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from vpscluster.cluster.sandbox import cgroup, links, netns, state
from vpscluster.cluster.sandbox.system import require_root, run_tool
from vpscluster.errors import UserError
from vpscluster.units import parse_rate_mbit

KINDS = ("kill", "reboot", "stop", "link-down", "throttle", "disk-full")
TIMED = ("stop", "link-down", "throttle")  # need SECONDS; disk-full takes it optionally
MAX_SECONDS = 7 * 24 * 3600
FILL_NAME = ".vpscluster-disk-full"


# ---------------------------------------------------------------- records


def _faults_file(name: str) -> Path:
    return state.state_dir(name) / "faults.json"


@contextmanager
def _locked(name: str) -> Iterator[list[dict]]:
    """The sandbox's active-fault list, read and written back under a file lock."""
    path = _faults_file(name)
    with open(state.state_dir(name) / ".faults.lock", "w") as lock:
        deadline = time.monotonic() + 30
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(f"sandbox {name}: another fault command held {lock.name} for 30 s; try again") from None
                time.sleep(0.05)
        try:
            faults = json.loads(path.read_text()) if path.exists() else []
        except json.JSONDecodeError:
            faults = []
        yield faults
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(faults, indent=2))
        tmp.replace(path)


def _load(name: str):
    require_root()
    info = state.load_info(state.check_name(name))
    if info is None:
        raise UserError(f"sandbox {name!r} does not exist; bring it up with `vpscluster sandbox up --name {name}`")
    return info


def _node(info, node: str):
    try:
        return info.node(node)
    except KeyError:
        raise UserError(f"sandbox {info.name!r} has no node {node!r}; nodes: {', '.join(n.name for n in info.nodes)}") from None


def active(name: str) -> list[dict]:
    _load(name)
    path = _faults_file(name)
    try:
        return json.loads(path.read_text()) if path.exists() else []
    except json.JSONDecodeError:
        return []


# ---------------------------------------------------------------- processes of a node


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def node_pids(info, n) -> list[int]:
    """Every live process of node `n`: in its cgroup (and below) or in its network namespace."""
    pids: set[int] = set()
    if n.cgroup and Path(n.cgroup).is_dir():
        for d in [Path(n.cgroup), *(p for p in Path(n.cgroup).rglob("*") if p.is_dir())]:
            pids.update(cgroup.tasks(d))
    pids.update(netns.namespace_pids(n.namespace))
    pids.discard(os.getpid())
    return sorted(p for p in pids if netns._alive(p))


def _sshd_daemon(info, n) -> int | None:
    try:
        return int((Path(info.state_dir) / "nodes" / n.name / "sshd.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _signal(pids: list[int], sig: int) -> list[int]:
    done = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            done.append(pid)
        except ProcessLookupError:
            pass
    return done


def _kill(info, n) -> dict:
    keep = _sshd_daemon(info, n)
    killed: set[int] = set()
    for _ in range(5):  # a process may fork while we kill; go round until none is left
        victims = [p for p in node_pids(info, n) if p != keep]
        if not victims:
            break
        netns.kill_pids(victims, timeout_s=3.0)
        killed.update(victims)
    # Only what was signalled survived: a process started after the last round is a new SSH login
    # through the kept daemon (a launcher reconnecting to the "rebooted" node), not a survivor.
    left = [p for p in node_pids(info, n) if p != keep and p in killed]
    if left:
        raise UserError(f"sandbox {info.name}: {n.name}: processes {left} survived SIGKILL")
    return {"killed": sorted(killed)}


def _stop(info, n) -> dict:
    stopped: set[int] = set()
    for _ in range(3):  # stopped processes cannot fork; one more round catches a fork in flight
        victims = [p for p in node_pids(info, n) if not _comm(p).startswith("sshd") and p not in stopped]
        if not victims:
            break
        stopped.update(_signal(victims, signal.SIGSTOP))
    return {"stopped": sorted(stopped)}


# ---------------------------------------------------------------- the workdir filesystem


def _mount_of(path: str) -> dict | None:
    """The mount whose mount point is `path` (from /proc/mounts), or None."""
    real = os.path.realpath(path)
    found = None
    with open("/proc/mounts") as f:
        for line in f:
            dev, point, fstype, opts = line.split()[:4]
            point = point.replace("\\040", " ")
            if point == real:
                found = {"device": dev, "point": point, "fstype": fstype, "options": opts.split(",")}
    return found


def _disk_full(info, n) -> dict:
    mount = _mount_of(n.workdir)
    if mount is None or mount["fstype"] != "tmpfs":
        raise UserError(f"sandbox {info.name}: {n.name}'s workdir {n.workdir} is not a filesystem of its own "
                        f"(sandboxes made before disk-full existed); recreate the sandbox to use disk-full")
    size_opt = next((o for o in mount["options"] if o.startswith("size=")), None)
    st = os.statvfs(n.workdir)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    # Shrink the tmpfs to what it holds plus a little, then fill that little: no memory is spent.
    new_kib = used // 1024 + 64
    run_tool(["mount", "-o", f"remount,size={new_kib}k", n.workdir])
    fill = Path(n.workdir) / FILL_NAME
    with open(fill, "wb", buffering=0) as f:  # unbuffered: nothing is left to flush (and fail) at close
        chunk = b"\0" * (64 * 1024)
        try:
            while f.write(chunk):
                pass
        except OSError:
            pass
        try:  # the last bytes, page by page
            while f.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    return {"size_option": size_opt, "fill_file": str(fill)}


def _undo_disk_full(info, n, fault: dict) -> None:
    try:
        os.unlink(fault.get("fill_file") or Path(n.workdir) / FILL_NAME)
    except FileNotFoundError:
        pass
    size = fault.get("size_option") or "size=50%"
    if _mount_of(n.workdir) is not None:
        run_tool(["mount", "-o", f"remount,{size}", n.workdir])


# ---------------------------------------------------------------- inject / restore


def _check_seconds(kind: str, seconds) -> float | None:
    if seconds is None:
        if kind in TIMED:
            raise UserError(f"fault {kind}: needs SECONDS, e.g. `{kind} {'1mbit ' if kind == 'throttle' else ''}10`")
        return None
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        raise UserError(f"fault {kind}: {seconds!r} is not a number of seconds") from None
    if not 0 < s <= MAX_SECONDS:
        raise UserError(f"fault {kind}: {s:g} s is outside 0-{MAX_SECONDS} s")
    return s


def inject(name: str, node: str, kind: str, seconds: float | str | None = None, rate: str | None = None) -> dict:
    """Start fault `kind` on `node`; timed ones end by themselves after `seconds`. Returns its record."""
    if kind not in KINDS:
        raise UserError(f"fault: unknown kind {kind!r}; choose one of {', '.join(KINDS)} (or clear)")
    info = _load(name)
    n = _node(info, node)
    if kind in ("kill", "reboot") and seconds is not None:
        raise UserError(f"fault {kind}: takes no SECONDS (the node's processes are gone; nothing comes back by itself)")
    secs = _check_seconds(kind, seconds)
    rate_mbit = None
    if kind == "throttle":
        if rate is None:
            raise UserError("fault throttle: needs RATE and SECONDS, e.g. `throttle 1mbit 60`")
        rate_mbit = parse_rate_mbit(rate, "throttle RATE")
    with _locked(name) as faults:
        if kind not in ("kill", "reboot") and any(f["node"] == node and f["kind"] == kind for f in faults):
            raise UserError(f"sandbox {name}: {node} already has a {kind} fault; end it first with "
                            f"`vpscluster sandbox fault --name {name} --node {node} clear`")
        record = {"id": secrets.token_hex(4), "node": node, "kind": kind, "started": time.time(),
                  "seconds": secs, "until": time.time() + secs if secs else None}
        if kind == "kill":
            record.update(_kill(info, n))
            return record  # nothing to restore: not recorded as active
        if kind == "reboot":
            from vpscluster.cluster.sandbox import boot

            record.update(boot.reboot(info, n, _kill))
            return record
        if kind == "stop":
            record.update(_stop(info, n))
        elif kind == "link-down":
            run_tool(["ip", "link", "set", n.veth, "down"])
        elif kind == "throttle":
            record["rate_mbit"] = rate_mbit
            record["restore_mbit"] = n.bandwidth_mbit
            links.shape(info, n, port_mbit=rate_mbit)  # its per-pair rates stay, capped by RATE
        elif kind == "disk-full":
            record.update(_disk_full(info, n))
        if secs:
            record["timer_pid"] = _start_timer(name, record["id"], secs)
        faults.append(record)
    return record


def _restore(info, fault: dict) -> None:
    n = _node(info, fault["node"])
    kind = fault["kind"]
    if kind == "stop":
        _signal(fault.get("stopped", []), signal.SIGCONT)
    elif kind == "link-down":
        run_tool(["ip", "link", "set", n.veth, "up"], check=False)
    elif kind == "throttle":
        links.shape(info, n, port_mbit=fault.get("restore_mbit") or n.bandwidth_mbit)
    elif kind == "disk-full":
        _undo_disk_full(info, n, fault)


def end(name: str, fault_id: str) -> dict | None:
    """End one fault (the timer's call); None when it has already ended."""
    info = state.load_info(name)
    if info is None:
        return None
    with _locked(name) as faults:
        for f in list(faults):
            if f["id"] == fault_id:
                _restore(info, f)
                faults.remove(f)
                return f
    return None


def clear(name: str, node: str | None = None) -> list[dict]:
    """End every active fault of sandbox `name` (only `node`'s when given) at once; their records."""
    info = _load(name)
    if node is not None:
        _node(info, node)
    ended = []
    with _locked(name) as faults:
        for f in list(faults):
            if node is not None and f["node"] != node:
                continue
            _stop_timer(f.get("timer_pid"))
            _restore(info, f)
            faults.remove(f)
            ended.append(f)
    return ended


# ---------------------------------------------------------------- the detached timer


def _start_timer(name: str, fault_id: str, seconds: float) -> int:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vpscluster.cluster.sandbox.faults", "end-after", name, fault_id, repr(seconds)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, cwd="/",
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    return proc.pid


def _stop_timer(pid: int | None) -> None:
    if not pid:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"vpscluster.cluster.sandbox.faults" in cmdline:  # never a recycled pid of something else
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _timer_main(argv: list[str]) -> int:
    _, name, fault_id, seconds = argv
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    deadline = time.monotonic() + float(seconds)
    home = state.state_dir(name)
    while time.monotonic() < deadline:
        if not home.exists():  # the sandbox is gone (down): nothing to restore
            return 0
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    end(name, fault_id)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "end-after":
        sys.exit(_timer_main(sys.argv[1:]))
    sys.exit("usage: python -m vpscluster.cluster.sandbox.faults end-after NAME FAULT_ID SECONDS")
