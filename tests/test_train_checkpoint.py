"""Checkpoints: atomic shards with checksums, manifests, fallback from a torn/corrupt latest."""

from __future__ import annotations

import json

import pytest
import torch

from vpscluster.train import checkpoint
from vpscluster.train.checkpoint import Collectives


def _payload(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 64, generator=g)}, "note": f"step {step}"}


def _save_steps(root, steps, keep=10):
    for s in steps:
        checkpoint.save(root, s, _payload(s), Collectives(), keep)


def test_save_writes_shard_and_manifest_with_checksum(tmp_path):
    d = checkpoint.save(tmp_path, 7, _payload(7), Collectives(), keep=3)
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert checkpoint.verify_shard(tmp_path, 7, 0, 1) is None
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]
    point = checkpoint.find_and_load(tmp_path, Collectives())
    assert point.step == 7 and point.skipped == []
    assert torch.equal(point.payload["model"]["w"], _payload(7)["model"]["w"])


def test_keeps_only_the_last_checkpoints(tmp_path):
    _save_steps(tmp_path, [10, 20, 30, 40], keep=2)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step-00000030", "step-00000040"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest", "bad_manifest", "missing_shard"])
def test_corrupt_latest_falls_back_to_previous_good(tmp_path, damage):
    _save_steps(tmp_path, [10, 20])
    shard = checkpoint.shard_path(tmp_path, 20, 0)
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "no_manifest":
        (shard.parent / "manifest.json").unlink()
    elif damage == "bad_manifest":
        (shard.parent / "manifest.json").write_text("{not json")
    else:
        shard.unlink()
    warnings = []
    point = checkpoint.find_and_load(tmp_path, Collectives(), warn=warnings.append)
    assert point.step == 10
    assert torch.equal(point.payload["model"]["w"], _payload(10)["model"]["w"])
    assert len(warnings) == 1 and "step 20" in warnings[0] and "resuming from step 10" in warnings[0]
    # never deleted: moved aside so that the resumed run cannot overwrite it
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000020.abandoned-")]
    assert len(aside) == 1 and not checkpoint.step_dir(tmp_path, 20).exists()


def test_all_corrupt_starts_from_scratch_without_deleting(tmp_path):
    _save_steps(tmp_path, [10])
    checkpoint.shard_path(tmp_path, 10, 0).write_bytes(b"garbage")
    warnings = []
    point = checkpoint.find_and_load(tmp_path, Collectives(), warn=warnings.append)
    assert point.step is None and point.payload is None
    assert "starting from step 0" in warnings[0]
    assert len(list(tmp_path.iterdir())) == 1


def test_newest_step_valid_on_all_ranks_is_chosen(tmp_path):
    """Rank 0's view says step 20 is fine; rank 1 (simulated through the gather) saw it torn."""
    for step in (10, 20):
        checkpoint.save(tmp_path, step, _payload(step), Collectives(0, 2, 0, lambda o: [o, o]), keep=5)

    def gather(obj):
        if isinstance(obj, dict):
            other = dict(obj)
            other[20] = "rank 1 shard checksum mismatch"
            return [obj, other]
        return [obj, obj]

    warnings = []
    point = checkpoint.find_and_load(tmp_path, Collectives(0, 2, 0, gather), warn=warnings.append)
    assert point.step == 10
    assert "rank 1 shard checksum mismatch" in warnings[0]


def test_state_hash_sensitive_to_values_and_structure():
    a = {"w": torch.zeros(3), "step": torch.tensor(1.0), "groups": [{"lr": 0.1}]}
    b = {"w": torch.zeros(3), "step": torch.tensor(1.0), "groups": [{"lr": 0.1}]}
    assert checkpoint.state_hash(a) == checkpoint.state_hash(b)
    b["w"][1] = 1e-30
    assert checkpoint.state_hash(a) != checkpoint.state_hash(b)
    c = dict(a, groups=[{"lr": 0.2}])
    assert checkpoint.state_hash(a) != checkpoint.state_hash(c)
