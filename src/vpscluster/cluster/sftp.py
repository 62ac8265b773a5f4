"""File and tree copies over SFTP with exact-destination semantics.

`put_tree(sftp, "run/", "~/vpscluster/run")` makes the remote path a copy of the local one (a
file, or a tree merged into the destination), creating parent directories, just as
`local.copy_path` does on this machine. asyncssh's own recursive copy puts a tree *inside* an
existing destination directory instead, so the walk is done here. Remote `~` is the login
directory (SFTP paths are relative to it).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import stat
from pathlib import Path

# Outstanding file transfers per tree: enough to hide round trips on a far-away node.
_PARALLEL_FILES = 8


def sftp_path(path: str) -> str:
    """`~/x` -> `x` (relative to the login directory), `~` -> `.`."""
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


async def put_tree(sftp, local_path: str, remote_path: str) -> None:
    src, dst = Path(local_path).expanduser(), sftp_path(remote_path)
    if not src.exists():
        raise FileNotFoundError(2, f"no such local file or directory: {src}")
    parent = posixpath.dirname(dst.rstrip("/"))
    if parent:
        await sftp.makedirs(parent, exist_ok=True)
    if not src.is_dir():
        await sftp.put(str(src), dst, preserve=True)
        return
    files: list[tuple[str, str]] = []
    for root, dirs, names in os.walk(src):
        rel = os.path.relpath(root, src)
        remote_dir = dst if rel == "." else posixpath.join(dst, *Path(rel).parts)
        await sftp.makedirs(remote_dir, exist_ok=True)
        files += [(os.path.join(root, n), posixpath.join(remote_dir, n)) for n in names]
    await _bounded(sftp.put, files)


async def get_tree(sftp, remote_path: str, local_path: str) -> None:
    src, dst = sftp_path(remote_path), Path(local_path).expanduser()
    attrs = await sftp.stat(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not stat.S_ISDIR(attrs.permissions or 0):
        await sftp.get(src, str(dst), preserve=True)
        return
    files: list[tuple[str, str]] = []
    pending = [(src, dst)]
    while pending:
        remote_dir, local_dir = pending.pop()
        local_dir.mkdir(parents=True, exist_ok=True)
        for entry in await sftp.readdir(remote_dir):
            if entry.filename in (".", ".."):
                continue
            r, loc = posixpath.join(remote_dir, entry.filename), local_dir / entry.filename
            if stat.S_ISDIR(entry.attrs.permissions or 0):
                pending.append((r, loc))
            else:
                files.append((r, str(loc)))
    await _bounded(sftp.get, files)


async def _bounded(copy, pairs: list[tuple[str, str]]) -> None:
    gate = asyncio.Semaphore(_PARALLEL_FILES)

    async def one(src: str, dst: str) -> None:
        async with gate:
            await copy(src, dst, preserve=True)

    await asyncio.gather(*(one(s, d) for s, d in pairs))
