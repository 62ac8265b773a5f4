"""Code and data to the nodes: copy only what differs, by content hash, through the executor.

rsync decides by size and modification time; a fresh `git clone` or a `pip install` on the
launching machine changes every time stamp and nothing else, so we compare SHA-256 hashes
instead. The node hashes its copy with `vpscluster.nodeside.tree_hash`, run by its own
interpreter (no extra tools needed on the node); the changed files travel as one tar archive (one
round trip on a high-latency link, whatever the number of files) and are unpacked in place by
`vpscluster.nodeside.unpack`.

Where the node already sees the same content at the same absolute path (the launching machine
itself, a shared file system, the sandbox), nothing is copied and that path is used as is.

What is never shipped: build output, caches, environments, version control and earlier runs
(`EXCLUDED_DIRS`, `EXCLUDED_SUFFIXES`), and files that usually hold secrets (`SECRET_DIRS`,
`is_secret`: SSH keys `id_*`, `*.pem`, `*.key`, `.env`, `.ssh/`, ...), so running from a home
or project folder does not copy its keys to every node. `scan` says what goes and what was
left out, and why, in one line (`LocalFiles.summary`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import posixpath
import tarfile
import tempfile
from dataclasses import dataclass

from vpscluster import nodeside
from vpscluster.errors import RemoteError, UserError
from vpscluster.nodeside.tree_hash import file_hash

# Never shipped: build output, caches, environments, version control, previous runs.
EXCLUDED_DIRS = {".git", ".hg", "__pycache__", ".venv", "venv", "node_modules", ".pytest_cache",
                 ".mypy_cache", ".ruff_cache", "runs", ".tox", "build", "dist"}
EXCLUDED_SUFFIXES = (".pyc", ".pyo", ".egg-info")
# Never shipped either: what usually holds credentials. A script that needs one on the nodes
# gets it there another way (the node's own secret store, an environment variable).
SECRET_DIRS = {".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".password-store"}
SECRET_FILES = ("*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", ".env", ".env.*", "*.env",
                ".netrc", ".pgpass", ".git-credentials", ".pypirc", "credentials.json", "*.kdbx")
# Where every launcher puts this package on a node, under its workdir: torchrun's ranks (train and
# run), Dask's workers, the exporters, the vertical split's stages and the controller all import it
# from there (PYTHONPATH=<workdir>/code/src), one copy per node, synced by content hash.
PACKAGE_ON_NODE = "code/src/vpscluster"


def package_dir() -> str:
    """This package's folder on this machine: what goes to PACKAGE_ON_NODE."""
    import vpscluster

    return os.path.dirname(os.path.abspath(vpscluster.__file__))


MAX_FILES = 20_000
MAX_BYTES = 8 * 2**30

@dataclass
class SyncResult:
    node: str
    local_path: str
    remote_path: str  # where the content is on the node (== local_path when shared)
    files: int
    changed: int
    bytes_sent: int
    shared: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def is_secret(name: str) -> bool:
    """A file name that usually holds a credential. `id_*` is an SSH key's name (`id_ed25519`,
    `id_rsa.pub`, `id_work`): one without an extension or ending `.pub`, so `id_map.py` is code."""
    if name.startswith("id_") and ("." not in name or name.endswith(".pub")):
        return True
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in SECRET_FILES)


@dataclass
class LocalFiles:
    """A folder as it is shipped: the manifest, and what was left out."""

    root: str
    manifest: dict[str, str]  # relative posix path -> sha256
    size_bytes: int
    secrets: list[str]  # relative paths never sent (a folder ends in "/")
    skipped: list[str]  # caches, version control, environments, earlier runs (folders end in "/")

    def summary(self, label: str) -> str:
        """One line: what goes to the nodes, what was left out and why."""
        n = len(self.manifest)
        line = f"{label} {self.root}: {n} file{'' if n == 1 else 's'} ({_size(self.size_bytes)}) to the nodes"
        if self.secrets:
            line += f"; left out as possible secrets: {_some(self.secrets)}"
        if self.skipped:
            line += f"; left out as caches, version control or runs: {_some(self.skipped)}"
        return line


def _some(paths: list[str], most: int = 6) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def scan(root: str) -> LocalFiles:
    """Every file under `root` that is shipped, hashed, and what is left out (see the module's note)."""
    if not os.path.isdir(root):
        raise UserError(f"{root}: not a directory to sync")
    out: dict[str, str] = {}
    secrets: list[str] = []
    skipped: list[str] = []
    total_bytes = 0
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel = (lambda name: name) if rel_dir == "." else (lambda name: f"{rel_dir}/{name}")
        keep = []
        for d in sorted(dirnames):
            if d in SECRET_DIRS:
                secrets.append(rel(d) + "/")
            elif d in EXCLUDED_DIRS or d.endswith(EXCLUDED_SUFFIXES):
                skipped.append(rel(d) + "/")
            else:
                keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.endswith(EXCLUDED_SUFFIXES) or not os.path.isfile(path):
                continue
            if is_secret(name):
                secrets.append(rel(name))
                continue
            total_bytes += os.path.getsize(path)
            out[rel(name)] = file_hash(path)
            if len(out) > MAX_FILES or total_bytes > MAX_BYTES:
                raise UserError(
                    f"{root} holds more than {MAX_FILES} files or {MAX_BYTES / 2**30:.0f} GiB; "
                    "pass --sync DIR with just the code the run needs"
                )
    return LocalFiles(root, out, total_bytes, sorted(secrets), sorted(skipped))


def local_manifest(root: str) -> dict[str, str]:
    """{relative posix path: sha256} for every file under `root` that is shipped."""
    return scan(root).manifest


def changed_files(local: dict[str, str], remote: dict[str, str]) -> list[str]:
    return sorted(p for p, h in local.items() if remote.get(p) != h)


async def remote_hashes(executor, roots: list[str], paths: list[str], timeout_s: float) -> dict[str, dict[str, str]]:
    node = executor.node
    result = await executor.run(
        nodeside.command(node.python, "tree_hash", json.dumps(roots)), timeout_s=timeout_s, input=json.dumps(paths)
    )
    if not result.ok:
        raise RemoteError(f"node {node.name}: could not hash files for sync: {result.reason()}")
    try:
        return json.loads(result.stdout)
    except ValueError:
        raise RemoteError(f"node {node.name}: sync hash program printed no JSON: {result.stdout[-200:]!r}") from None


async def sync_dir(
    executor, local_root: str, remote_root: str, timeout_s: float = 600.0,
    manifest: dict[str, str] | None = None, detect_shared: bool = True, say=None,
) -> SyncResult:
    """Make `remote_root` on the node hold `local_root`'s files (extra remote files are kept)."""
    node = executor.node
    local_root = os.path.abspath(local_root)
    manifest = local_manifest(local_root) if manifest is None else manifest
    paths = sorted(manifest)
    if getattr(node, "local", False) and detect_shared:
        return SyncResult(node.name, local_root, local_root, len(paths), 0, 0, shared=True)
    roots = [local_root, remote_root] if detect_shared else [remote_root]
    found = await remote_hashes(executor, roots, paths, timeout_s)
    if detect_shared and not changed_files(manifest, found.get(local_root, {})):
        return SyncResult(node.name, local_root, local_root, len(paths), 0, 0, shared=True)
    todo = changed_files(manifest, found.get(remote_root, {}))
    sent = 0
    if todo:
        if say is not None:
            size_mb = sum(os.path.getsize(os.path.join(local_root, p)) for p in todo) / 1e6
            say(f"{node.name}: sending {len(todo)} changed of {len(paths)} files ({size_mb:.1f} MB) to {remote_root}")
        sent = await _ship(executor, local_root, todo, remote_root, timeout_s)
    return SyncResult(node.name, local_root, remote_root, len(paths), len(todo), sent, shared=False)


async def _ship(executor, local_root: str, rel_paths: list[str], remote_root: str, timeout_s: float) -> int:
    node = executor.node
    with tempfile.TemporaryDirectory(prefix="vpsc-sync-") as tmp:
        archive = os.path.join(tmp, "files.tar.gz")
        # In a thread: compressing big data must not stall the other nodes' transfers.
        await asyncio.to_thread(_pack, archive, local_root, rel_paths)
        size = os.path.getsize(archive)
        remote_archive = posixpath.join(posixpath.dirname(remote_root.rstrip("/")) or ".",
                                        f".vpsc-sync-{os.getpid()}-{posixpath.basename(remote_root.rstrip('/'))}.tar.gz")
        try:
            await executor.put(archive, remote_archive, timeout_s=timeout_s)
        except Exception as e:  # the executor names the transport failure
            raise RemoteError(f"node {node.name}: copying {len(rel_paths)} files failed: {e}") from None
    result = await executor.run(nodeside.command(node.python, "unpack", remote_archive, remote_root),
                                timeout_s=timeout_s)
    if not result.ok:
        raise RemoteError(f"node {node.name}: unpacking synced files into {remote_root} failed: {result.reason()}")
    return size


def _pack(archive: str, local_root: str, rel_paths: list[str]) -> None:
    with tarfile.open(archive, "w:gz", compresslevel=1, dereference=True) as t:
        for rel in rel_paths:
            t.add(os.path.join(local_root, rel), arcname=rel, recursive=False)


