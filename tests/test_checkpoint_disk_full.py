"""A full disk during a checkpoint: the checkpoint fails cleanly on every rank, the previous one
stays intact (not pruned, still what a resume takes), and the next checkpoint works once there is
room again. The disk is a real 1 MiB tmpfs filled to the last byte (root needed to mount it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from vpscluster.train import checkpoint
from vpscluster.train.checkpoint import CheckpointFailed, Collectives


def _payload(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 64, generator=g)}, "note": f"step {step}"}


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "ckpt-test", str(disk)], check=True, timeout=10)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], timeout=10)


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_disk_full_keeps_the_previous_checkpoint(small_disk):
    root = small_disk / "checkpoints"
    checkpoint.save(root, 10, _payload(10), Collectives(), keep=1)
    filler = fill(small_disk)
    with pytest.raises(CheckpointFailed, match="step 20 not written.*No space left"):
        checkpoint.save(root, 20, _payload(20), Collectives(), keep=1)
    assert [p.name for p in root.iterdir()] == ["step-00000010"]  # no torn step 20, no temp files
    assert sorted(p.name for p in (root / "step-00000010").iterdir()) == ["manifest.json", "rank-00000.pt"]
    assert checkpoint.verify_shard(root, 10, 0, 1) is None
    point = checkpoint.find_and_load(root, Collectives())
    assert point.step == 10 and torch.equal(point.payload["model"]["w"], _payload(10)["model"]["w"])
    filler.unlink()  # room again: the next checkpoint is written, and only then the old one pruned
    checkpoint.save(root, 30, _payload(30), Collectives(), keep=1)
    assert [p.name for p in root.iterdir()] == ["step-00000030"]


def _two_ranks(rank: int, roots: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    coll = Collectives(rank, 2, 0, lambda obj: _gather(dist, obj))
    root = Path(roots[rank])
    checkpoint.save(root, 10, _payload(10), coll, keep=1)
    if rank == 1:
        fill(root.parent)
    dist.barrier()
    try:
        checkpoint.save(root, 20, _payload(20), coll, keep=1)
        result = "saved"
    except CheckpointFailed as e:
        result = f"failed: {e}"
    Path(out, f"rank{rank}").write_text(result + "\n" + ",".join(sorted(p.name for p in root.iterdir())))
    dist.destroy_process_group()


def _gather(dist, obj):
    got = [None, None]
    dist.all_gather_object(got, obj)
    return got


def test_one_full_disk_fails_the_checkpoint_on_every_rank(small_disk, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    roots = [str(tmp_path / "rank0-disk" / "checkpoints"), str(small_disk / "checkpoints")]
    mp.spawn(_two_ranks, args=(roots, port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        result, listing = (tmp_path / f"rank{rank}").read_text().split("\n")
        assert result.startswith("failed: checkpoint step 20 not written (rank 1: No space left"), result
        assert listing == "step-00000010"  # rank 0 had room, yet kept step 10 and dropped its step 20
