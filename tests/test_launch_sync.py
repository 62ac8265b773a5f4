"""Content-hash sync through an executor: only changed files travel; shared paths are detected."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from vpscluster.cluster.local import LocalExecutor
from vpscluster.cluster.node import Node
from vpscluster.errors import UserError
from vpscluster.launch.sync import changed_files, file_hash, local_manifest, sync_dir


def make_tree(root):
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("print('a')\n")
    (root / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    (root / "data.bin").write_bytes(os.urandom(100_000))
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / "runs").mkdir()
    (root / "runs" / "old.log").write_text("x")
    return root


def executor(name="n1", local=False):
    # local=False: behave like a remote node, so hashing and copying really happen.
    return LocalExecutor(Node(name=name, host="127.0.0.1", local=local, python=sys.executable))


def test_manifest_skips_caches_vcs_and_runs(tmp_path):
    m = local_manifest(str(make_tree(tmp_path / "src")))
    assert sorted(m) == ["data.bin", "pkg/a.py"]
    assert m["pkg/a.py"] == file_hash(str(tmp_path / "src" / "pkg" / "a.py"))


def test_changed_files():
    assert changed_files({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "x"}) == ["b", "c"]


def test_sync_copies_then_only_what_changed(tmp_path):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "node" / "code" / "src"
    ex = executor()
    # This "node" is this machine, so it would see the source at the same path: detection off.
    first = asyncio.run(sync_dir(ex, str(src), str(dest), detect_shared=False))
    assert (first.shared, first.files, first.changed) == (False, 2, 2) and first.bytes_sent > 0
    assert (dest / "pkg" / "a.py").read_text() == "print('a')\n"
    assert file_hash(str(dest / "data.bin")) == file_hash(str(src / "data.bin"))
    assert not (dest / ".git").exists() and not (dest / "runs").exists()
    assert not list((tmp_path / "node" / "code").glob(".vpsc-sync-*"))  # the archive is removed

    again = asyncio.run(sync_dir(ex, str(src), str(dest), detect_shared=False))
    assert (again.changed, again.bytes_sent) == (0, 0)

    # Same size and a touched mtime would fool rsync's quick check; the hash is not fooled.
    (src / "pkg" / "a.py").write_text("print('b')\n")
    third = asyncio.run(sync_dir(ex, str(src), str(dest), detect_shared=False))
    assert third.changed == 1
    assert (dest / "pkg" / "a.py").read_text() == "print('b')\n"


def test_shared_path_is_detected_and_nothing_is_copied(tmp_path):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "elsewhere"
    r = asyncio.run(sync_dir(executor(), str(src), str(dest)))
    assert r.shared and r.remote_path == str(src) and r.changed == 0
    assert not dest.exists()
    # A local node is shared by definition.
    r = asyncio.run(sync_dir(executor(local=True), str(src), str(dest), detect_shared=True))
    assert r.shared


def test_shared_detection_off_copies(tmp_path):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "copy"
    r = asyncio.run(sync_dir(executor(), str(src), str(dest), detect_shared=False))
    assert not r.shared and (dest / "pkg" / "a.py").exists()


def test_single_file_manifest(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello " * 1000)
    (tmp_path / "other.txt").write_text("not sent")
    dest = tmp_path / "node" / "data"
    manifest = {"corpus.txt": file_hash(str(tmp_path / "corpus.txt"))}
    r = asyncio.run(sync_dir(executor(), str(tmp_path), str(dest), manifest=manifest, detect_shared=False))
    assert r.changed == 1 and (dest / "corpus.txt").exists() and not (dest / "other.txt").exists()


def test_not_a_directory(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        local_manifest(str(tmp_path / "missing"))


def test_symlinked_files_travel_as_their_content(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "outside.txt").write_text("real content")
    (src / "link.txt").symlink_to(tmp_path / "outside.txt")
    dest = tmp_path / "node"
    r = asyncio.run(sync_dir(executor(), str(src), str(dest), detect_shared=False))
    assert r.changed == 1
    assert not (dest / "link.txt").is_symlink() and (dest / "link.txt").read_text() == "real content"


def secrets_beside_a_script(root):
    """A project folder as users have them: the script, and keys and env files beside it."""
    root.mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "id_map.py").write_text("IDS = {}\n")  # code named id_*: shipped
    (root / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (root / "id_ed25519.pub").write_text("ssh-ed25519 AAAA\n")
    (root / ".env").write_text("API_TOKEN=s3cret\n")
    (root / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (root / ".ssh").mkdir()
    (root / ".ssh" / "config").write_text("Host *\n")
    (root / "conf").mkdir()
    (root / "conf" / "tls.key").write_text("k")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    return root


def test_secrets_beside_the_script_never_reach_the_node_and_the_line_says_so(tmp_path):
    from vpscluster.launch.sync import scan

    src = secrets_beside_a_script(tmp_path / "proj")
    dest = tmp_path / "node" / "code" / "proj"
    files = scan(str(src))
    r = asyncio.run(sync_dir(executor(), str(src), str(dest), detect_shared=False))
    assert (r.shared, r.files) == (False, 2)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == ["id_map.py", "train.py"]
    line = files.summary("sync code:")
    assert line.splitlines() == [line] and line.startswith(f"sync code: {src}: 2 files (")
    assert "left out as possible secrets: .env, .ssh/, conf/tls.key, id_ed25519, id_ed25519.pub, key.pem" in line
    assert "left out as caches, version control or runs: .git/" in line
