"""Sandbox nodes with their own filesystem (`sandbox up --own-root`).

Without it every node sees the host's files. With it each node's sshd runs in a private mount
namespace whose root is an overlay of the host's `/`:

    lowerdir  /                                    (read-only view of the host)
    upperdir  <state>/nodes/<node>/rootfs/upper    (everything the node writes: its own disk)
    workdir   <state>/nodes/<node>/rootfs/work     (overlayfs bookkeeping)
    merged    <state>/nodes/<node>/rootfs/merged   (the node's `/`; sshd is chrooted into it)

So a node's /etc, /srv, /opt, its venvs and its workdir are its own; what it installs
or writes never reaches the host or another node, and what the controller wants on a node has
to travel there (SSH, SFTP), as on a rented machine. /proc, /sys and /dev are the node's
namespace views bound in; /run is a fresh tmpfs. /root (a fresh home from /etc/skel, as on a
bare VPS) and /tmp are the node's own directories outside the overlay (rootfs/root, rootfs/tmp):
the host keeps changing its own /root and /tmp (shells, pyenv's rehash lock) while nodes run,
and overlayfs leaves changes to a mounted lower layer undefined — a node could see a file the
host has since deleted. The node's /etc/hosts and /etc/hostname are
written into its own /etc. The folders of this machine's interpreter that would be hidden that
way (a venv or pyenv under /root or /tmp) are bound into every node read-only (`lent_dirs`), so
the cluster file's `python` runs there as on a VPS image with Python preinstalled. sshd's pid file and log are bound back to the host's node directory
so `status` and error messages work as for plain nodes.

The mounts exist only in the mount namespace that `ip netns exec` makes for sshd: they are
never visible on the host, and they vanish when the node's last process dies, which is what
`sandbox down` does before it removes the state directory (upper dirs included). Start-up
costs one mount and a few binds: a node is up in well under a second more than a plain one.

Kept beside sshd.start (not inside it) so the plain path stays as it was; the cgroup view and
the pid-file handshake are the same as there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vpscluster.cluster.sandbox import cgroup as cgroup_mod
from vpscluster.cluster.sandbox import sshd
from vpscluster.cluster.sandbox.system import SSHD, run_tool
from vpscluster.errors import UserError

# The shell that runs inside the node's network + mount namespace; positional args:
#   $1 hostname  $2 rootfs dir  $3 node dir (pid/log)  $4 sshd config  $5 sshd log  $6 sshd binary
#   $7... folders of this machine's interpreter to lend the node, read-only (lent_dirs)
_ENTER = r'''
set -e
hostname "$1"
R="$2"; M="$R/merged"
mount -t overlay overlay -o "lowerdir=/,upperdir=$R/upper,workdir=$R/work" "$M"
mount --rbind /proc "$M/proc"
mount --rbind /sys "$M/sys"
mount --rbind /dev "$M/dev"
mount -t tmpfs -o mode=755 tmpfs "$M/run"
mkdir -p "$R/root" "$R/tmp"
[ -e "$R/root/.profile" ] || cp -a /etc/skel/. "$R/root/"
chmod 700 "$R/root"; chmod 1777 "$R/tmp"
mount --bind "$R/root" "$M/root"
mount --bind "$R/tmp" "$M/tmp"
mkdir -p "$M/run/sshd" "$M/srv"
cp /etc/hosts "$M/etc/hosts"
echo "$1" > "$M/etc/hostname"
for f in sshd.pid sshd.log; do
  : > "$3/$f"; : > "$M$3/$f"; mount --bind "$3/$f" "$M$3/$f"
done
CONFIG="$4"; LOG="$5"; BIN="$6"; shift 6
for p in "$@"; do
  mkdir -p "$M$p"; mount --bind "$p" "$M$p"; mount -o remount,bind,ro "$M$p"
done
CGVIEW
exec chroot "$M" "$BIN" -f "$CONFIG" -E "$LOG"
'''
# The node's own view of its cgroup (as sshd.start makes it), now below the bound /sys: the
# unified hierarchy where /sys/fs/cgroup is cgroup2, else v1's cpu controller.
_CGVIEW = ('if [ "$(stat -f -c %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ]; then '
           '{ mount -t cgroup2 cgroup2 "$M/sys/fs/cgroup"; } >/dev/null 2>&1 || true; else '
           '{ mount -t tmpfs -o mode=755 cgroup "$M/sys/fs/cgroup" && mkdir -p "$M/sys/fs/cgroup/cpu" '
           '&& mount -t cgroup -o cpu cpu "$M/sys/fs/cgroup/cpu"; } >/dev/null 2>&1 || true; fi')


def supported() -> str | None:
    """Why own-root nodes cannot be built here (one line), or None when they can."""
    try:
        if "overlay" not in Path("/proc/filesystems").read_text():
            run_tool(["modprobe", "overlay"], check=False)
            if "overlay" not in Path("/proc/filesystems").read_text():
                return "--own-root needs the kernel's overlayfs (modprobe overlay)"
    except OSError as e:
        return f"--own-root: cannot read /proc/filesystems ({e})"
    return None


# A node's own folders, where the host's files are not seen (see the module's docstring).
_OWN_DIRS = ("/root", "/tmp", "/run")


def lent_dirs() -> list[str]:
    """Folders of the interpreter running vpscluster (the sandbox cluster file's `python`: its
    venv and the Python behind it, e.g. pyenv's under /root) that lie in a node's own folders,
    where the node would not see them. They are lent to every node, read-only, as a VPS image
    with Python preinstalled: otherwise the cluster file's `python` "cannot be run there"."""
    found = []
    for p in dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)):
        for q in dict.fromkeys((os.path.abspath(p), os.path.realpath(p))):
            if any(q == d or q.startswith(d + "/") for d in _OWN_DIRS) and q not in _OWN_DIRS:
                found.append(q)
    found.sort()
    return [q for i, q in enumerate(found) if not any(q.startswith(o + "/") or q == o for o in found[:i])]


def rootfs_dir(node_dir: Path) -> Path:
    return node_dir / "rootfs"


def prepare(node_dir: Path) -> Path:
    root = rootfs_dir(node_dir)
    for sub in ("upper", "work", "merged"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    return root


def start(namespace: str, hostname: str, config: Path, log: Path, cgroup: Path, node_dir: Path) -> int:
    """Like sshd.start, but sshd runs chrooted in the node's own overlay root; returns its pid."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    root = prepare(node_dir)
    own_view = os.path.exists("/proc/self/ns/cgroup")
    script = _ENTER.replace("CGVIEW", _CGVIEW if own_view else "")
    argv = cgroup_mod.enter_argv(cgroup, namespace, [
        "unshare", "--uts", *(["--cgroup"] if own_view else []), "--",
        "sh", "-c", script, "enter-root", hostname, str(root), str(node_dir), str(config), str(log), SSHD,
        *lent_dirs()])
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=sshd.START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise UserError(f"sandbox: sshd for {hostname} (own root) did not start within {sshd.START_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        said = (out.strip() or _tail(log)).splitlines()
        raise UserError(f"sandbox: sshd for {hostname} (own root) failed to start: {said[-1] if said else proc.returncode}")
    return sshd.read_pid(node_dir)


def host_mounts(path: str) -> list[str]:
    """Mounts that name `path` (mount point, source or options such as an overlay's upperdir)
    in any process's mount table on this machine.

    Used to check that a removed sandbox left nothing mounted (its overlay lived only in the
    node's namespaces; a process that outlived `down` would keep it alive). Mount points are
    shown relative to each process's root, so a chrooted node sees its overlay as `/`: the
    overlay is found by its upperdir option instead.
    """
    found: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            text = (proc / "mountinfo").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split()
            if path in line and len(fields) > 4:
                found.add(f"{fields[4]} ({fields[fields.index('-') + 1] if '-' in fields else '?'})")
    return sorted(found)


def _tail(path: Path) -> str:
    try:
        return path.read_text()[-2000:]
    except FileNotFoundError:
        return ""
