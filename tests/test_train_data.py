"""Data: byte tokens, the split, horizontal shards, per-epoch reshuffle, checkpointable position."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from vpscluster.errors import UserError
from vpscluster.train.data import ShardSampler, load_dataset, read_corpus, shard_indices


@pytest.mark.parametrize("n,k", [(100, 1), (101, 2), (103, 4), (7, 3)])
def test_shards_disjoint_and_cover(n, k):
    for epoch in range(3):
        shards = [shard_indices(n, i, k, seed=11, epoch=epoch) for i in range(k)]
        together = np.concatenate(shards)
        assert len(together) == n == len(set(together.tolist()))
        assert sorted(together.tolist()) == list(range(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_reshuffle_deterministic_per_epoch_and_differs_across_epochs():
    a0 = shard_indices(500, 1, 4, seed=3, epoch=0)
    assert np.array_equal(a0, shard_indices(500, 1, 4, seed=3, epoch=0))
    a1 = shard_indices(500, 1, 4, seed=3, epoch=1)
    assert not np.array_equal(a0, a1)
    assert not np.array_equal(a0, shard_indices(500, 1, 4, seed=4, epoch=0))
    # the same samples are shuffled among the shards, not a fixed subset per rank
    assert set(a0.tolist()) != set(a1.tolist())


def test_bundled_corpus_split():
    ds = load_dataset(None, seq_len=128, val_fraction=0.05)
    total = len(ds.train) + len(ds.val)
    assert total > 1_000_000
    assert abs(len(ds.val) / total - 0.05) < 1e-3
    assert ds.train.dtype == np.uint8
    assert b"In the beginning God created" in ds.train[:2000].tobytes()


def test_sampler_stream_covers_epoch_and_resumes_exactly():
    ds = load_dataset(None, seq_len=64, val_fraction=0.05)
    small = type(ds)(train=ds.train[: 64 * 40 + 1], val=ds.val, seq_len=64)  # 40 samples
    samplers = [ShardSampler(small, r, 2, seed=1, batch_size=4) for r in range(2)]
    seen = []
    for s in samplers:
        for _ in range(5):  # 5 batches x 4 = 20 samples = this shard's epoch
            x, y = s.next_batch()
            assert x.shape == (4, 64) and y.shape == (4, 64)
            assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())  # targets are inputs shifted by one
            seen.extend(bytes(row.tolist()) for row in x)
    assert len(set(seen)) == 40  # together the two shards read every sample exactly once
    # resume: a fresh sampler loaded with the state continues identically (across an epoch boundary)
    a = ShardSampler(small, 1, 2, seed=1, batch_size=3)
    for _ in range(6):
        a.next_batch()
    b = ShardSampler(small, 1, 2, seed=1, batch_size=3)
    b.load_state_dict(a.state_dict())
    for _ in range(10):
        xa, _ = a.next_batch()
        xb, _ = b.next_batch()
        assert np.array_equal(xa.numpy(), xb.numpy())
    assert a.epoch >= 2


def test_sampler_refuses_another_ranks_shard_in_the_same_world():
    ds = load_dataset(None, seq_len=64, val_fraction=0.05)
    state = ShardSampler(ds, 1, 2, seed=1, batch_size=2).state_dict()
    with pytest.raises(UserError, match="its own shard"):
        ShardSampler(ds, 0, 2, seed=1, batch_size=2).load_state_dict(state)


@pytest.mark.parametrize("old, new", [(3, 2), (2, 3), (4, 1), (2, 2)])
def test_sampler_reshards_at_the_global_position(old, new):
    # A run of `old` ranks read 5 batches each; resumed on `new` ranks, the epoch goes on over
    # the samples nobody read yet: none twice, and none skipped beyond the last partial row.
    ds = load_dataset(None, seq_len=32, val_fraction=0.05)
    n, bs, steps = ds.num_train_samples, 2, 5
    perm = list(np.random.Generator(np.random.PCG64([1, 0])).permutation(n))
    readers = [ShardSampler(ds, r, old, seed=1, batch_size=bs) for r in range(old)]
    for r in readers:
        for _ in range(steps):
            r.next_batch()
    consumed = {int(i) for r in readers for i in r._order[: r.index]}
    assert consumed == set(int(i) for i in perm[: steps * bs * old])
    resumed = [ShardSampler(ds, r, new, seed=1, batch_size=bs) for r in range(new)]
    for r in resumed:
        r.load_state_dict(readers[r.shard % old].state_dict(), recut=True)
    following = [int(i) for r in resumed for i in r._order[r.index : r.index + 4]]
    assert not consumed & set(following)
    assert set(following) == set(int(i) for i in perm[steps * bs * old : steps * bs * old + 4 * new])


def test_val_batches_identical_and_from_val_split():
    ds = load_dataset(None, seq_len=64, val_fraction=0.05)
    a = [x for x, _ in ds.val_batches(3, 4)]
    b = [x for x, _ in ds.val_batches(3, 4)]
    assert len(a) == 3 and all((p == q).all() for p, q in zip(a, b))
    val_bytes = ds.val.tobytes()
    assert bytes(a[1][0].tolist()) in val_bytes


def test_data_folder_sorted_text_only(tmp_path):
    (tmp_path / "b.txt").write_text("second ")
    (tmp_path / "a.txt").write_text("first ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt.gz").write_bytes(gzip.compress(b"third"))
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2binary")
    assert read_corpus(str(tmp_path)) == b"first \nsecond \nthird"


def test_data_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        read_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no text files"):
        read_corpus(str(tmp_path / "empty"))
    (tmp_path / "tiny.txt").write_text("hello world")
    with pytest.raises(UserError, match="too few"):
        load_dataset(str(tmp_path / "tiny.txt"), seq_len=128, val_fraction=0.05)
