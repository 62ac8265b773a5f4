"""Each sandbox node's workdir is a filesystem of its own: a size-capped tmpfs.

A real VPS has its own disk, which can fill up; a sandbox node's workdir on the shared root
filesystem could not (filling it would fill this machine). As a tmpfs, the node's disk can be
made full on demand (`sandbox fault ... disk-full` shrinks it to what it holds and fills the
rest, costing no memory) and every process of the node sees it, whatever its current directory.
The cap is only a ceiling: a tmpfs uses memory for what it holds, as the page cache would.
`down` unmounts it (lazily, should a process still hold it) before removing the state directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from vpscluster.cluster.sandbox.system import run_tool

WORKDIR_SIZE = "4g"


def mount_workdir(path: str, size: str = WORKDIR_SIZE) -> None:
    run_tool(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "vpsc-workdir", path])


def mounts_below(root: Path) -> list[str]:
    """Mount points at or under `root`, deepest first."""
    real = os.path.realpath(root)
    points = []
    try:
        with open("/proc/mounts") as f:
            for line in f:
                point = line.split()[1].replace("\\040", " ")
                if point == real or point.startswith(real + "/"):
                    points.append(point)
    except OSError:
        return []
    return sorted(set(points), key=len, reverse=True)


def unmount_below(root: Path) -> bool:
    """Unmount everything mounted under `root`; whether there was anything."""
    points = mounts_below(root)
    for point in points:
        if run_tool(["umount", point], check=False).returncode != 0:
            run_tool(["umount", "-l", point], check=False)
    return bool(points)
