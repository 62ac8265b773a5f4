"""Checkpoints: atomic shards with checksums, manifests, fallback from a torn/corrupt latest."""

from __future__ import annotations

import hashlib
import io
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
            other[20] = ("rank 1 shard checksum mismatch", 2)
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


def _save_world(root, step, world):
    """A checkpoint of `world` ranks on one disk, laid out as `checkpoint.save` on each rank would."""
    payloads = [dict(_payload(step), rank_local=torch.full((4,), float(r))) for r in range(world)]
    checkpoint.step_dir(root, step).mkdir(parents=True)
    shas = {}
    for r, p in enumerate(payloads):
        buf = io.BytesIO()
        torch.save({"format": checkpoint.FORMAT, "step": step, "rank": r, "world_size": world, **p}, buf)
        checkpoint.shard_path(root, step, r).write_bytes(buf.getvalue())
        shas[str(r)] = hashlib.sha256(buf.getvalue()).hexdigest()
    manifest = {"step": step, "world_size": world, "sha256": shas}
    (checkpoint.step_dir(root, step) / "manifest.json").write_text(json.dumps(manifest))
    return payloads


def test_a_checkpoint_of_three_ranks_resumes_on_two_and_on_four(tmp_path):
    payloads = _save_world(tmp_path, 20, 3)
    for r in range(3):
        assert checkpoint.verify_shard(tmp_path, 20, r, 3) is None
    # Two ranks (a node gone): each loads its own old shard, the step is not thrown away.
    for rank in (0, 1):
        point = checkpoint.find_and_load(tmp_path, Collectives(rank, 2, rank, lambda o: [o, o]), warn=pytest.fail)
        assert (point.step, point.world_size, point.shard) == (20, 3, rank)
        assert torch.equal(point.payload["rank_local"], payloads[rank]["rank_local"])
    # A fourth rank has no shard of its own: it takes an intact one held here.
    point = checkpoint.find_and_load(tmp_path, Collectives(3, 4, 3, lambda o: [o] * 4), warn=pytest.fail)
    assert (point.step, point.world_size, point.shard) == (20, 3, 0)
    # Its own shard corrupt: the next intact one instead.
    checkpoint.shard_path(tmp_path, 20, 1).write_bytes(b"garbage")
    point = checkpoint.find_and_load(tmp_path, Collectives(1, 2, 1, lambda o: [o, o]), warn=pytest.fail)
    assert (point.step, point.shard) == (20, 2)


def test_a_step_absent_on_another_node_is_left_in_place(tmp_path):
    _save_steps(tmp_path, [10, 20])

    def gather(obj):  # the peer's disk has step 10 only (say a node that came back from older state)
        if isinstance(obj, dict):
            return [obj, {k: v for k, v in obj.items() if k != 20}]
        return [obj, obj]

    warnings = []
    point = checkpoint.find_and_load(tmp_path, Collectives(0, 1, 0, gather), warn=warnings.append)
    assert point.step == 10
    assert "missing on a node" in warnings[0] and "left in place" in warnings[0]
    assert checkpoint.step_dir(tmp_path, 20).exists()  # intact here: copy it over and resume again


def test_nodes_disagreeing_on_the_world_size_skip_the_step(tmp_path):
    _save_steps(tmp_path, [10, 20])

    def gather(obj):
        if isinstance(obj, dict):
            return [obj, {**obj, 20: (None, 5)}]
        return [obj, obj]

    warnings = []
    point = checkpoint.find_and_load(tmp_path, Collectives(0, 1, 0, gather), warn=warnings.append)
    assert point.step == 10 and "disagree on its world size" in warnings[0]


def test_a_rank_without_the_step_receives_it_from_a_holder(tmp_path):
    # Rank 1's disk (a node back from an outage) holds step 10 only; rank 0 holds 10 and 20. With
    # a broadcast, both resume from 20: rank 1 receives rank 0's shard. Without, both take 10.
    holder, back = tmp_path / "holder", tmp_path / "back"
    _save_steps(holder, [10, 20])
    _save_steps(back, [10])
    holder_view = {10: (None, 1), 20: (None, 1)}  # what rank 0 reports: both intact, taken with 1 rank
    sent = []

    def gather(obj):
        return [holder_view, obj] if isinstance(obj, dict) else [obj, obj]

    def broadcast(obj, src):
        assert src == 0 and obj == (None, None)  # the receiver sends nothing
        sent.append(src)
        return checkpoint.shard_path(holder, 20, 0).read_bytes(), 0

    point = checkpoint.find_and_load(back, Collectives(1, 2, 0, gather, broadcast), warn=pytest.fail)
    assert (point.step, point.shard, point.world_size, point.received, point.recut) == (20, 0, 1, True, True)
    assert torch.equal(point.payload["model"]["w"], _payload(20)["model"]["w"]) and sent == [0]
    assert checkpoint.step_dir(back, 10).exists()  # nothing moved aside: the step is fine, just not here
    point = checkpoint.find_and_load(back, Collectives(1, 2, 0, gather))  # rank 1: rank 0 warns
    assert (point.step, point.received) == (10, False)


class _RunsCode:
    """Pickles as a call to exec: what a hostile shard would hold."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_shard_that_would_run_code_is_refused_in_one_line_and_nothing_runs(tmp_path):
    marker = tmp_path / "code-ran"
    # A consistent checkpoint (manifest and sha256 match): whoever wrote the shard wrote both.
    checkpoint.save(tmp_path / "ck", 4, {"model": {"w": torch.zeros(2)}, "x": _RunsCode(marker)}, Collectives(), keep=3)
    with pytest.raises(checkpoint.UnsafeCheckpoint) as e:
        checkpoint.find_and_load(tmp_path / "ck", Collectives())
    assert not marker.exists()
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "rank-00000.pt: refused, it names exec" in msg, msg
    # the same refusal where a shard is received from another rank (bytes, not a file)
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="received from rank 1"):
        checkpoint.load_shard(checkpoint.shard_path(tmp_path / "ck", 4, 0).read_bytes(),
                              "step 4, rank 0's shard (received from rank 1)")
    assert not marker.exists()


def test_plain_state_and_numpy_random_state_load_with_weights_only(tmp_path):
    """What the strategies save (PowerSGD keeps a numpy RandomState's state, an ndarray of
    uint32) loads under weights_only."""
    import numpy as np

    rng = np.random.RandomState(3)
    payload = {"model": {"w": torch.randn(3)}, "rng": {"torch": torch.get_rng_state()},
               "strategy": {"powersgd": {"iter": 5, "rng": rng.get_state(), "error_dict": {0: torch.ones(4)}}},
               "totals": {"tokens": 12, "loss": 1.5, "name": "x", "none": None}, "recent": [1.0, 2.0], "t": (1, 2)}
    checkpoint.save(tmp_path, 2, payload, Collectives(), keep=3)
    got = checkpoint.find_and_load(tmp_path, Collectives()).payload
    again = np.random.RandomState()
    again.set_state(got["strategy"]["powersgd"]["rng"])
    assert again.randint(0, 2**31, 5).tolist() == rng.randint(0, 2**31, 5).tolist()
    assert got["totals"] == payload["totals"] and got["t"] == (1, 2) and torch.equal(got["model"]["w"], payload["model"]["w"])
