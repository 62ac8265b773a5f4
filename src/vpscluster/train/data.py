"""Training data: byte-level tokens, a train/validation split, and horizontal partitioning.

- Tokenizer: every byte is a token (vocabulary 0..255); nothing is downloaded and any text
  (any language, any encoding) round-trips exactly.
- Corpus: the bundled King James Bible (`vpscluster/data/kjv.txt.gz`, see data/README.md) or
  the user's `--data` file or folder (every text file under it, in sorted path order, joined).
- Split: the last `val_fraction` of the byte stream is validation, the rest is training, so the
  two never overlap.
- Samples: fixed windows of `seq_len + 1` bytes at stride `seq_len` (input = first seq_len,
  target = last seq_len).
- Partitioning (what `DistributedSampler.set_epoch` does): every epoch the sample indices are
  permuted by a generator seeded from (seed, epoch), identically on every rank; shard `i` of `k`
  takes positions i, i+k, i+2k, ... of that permutation. Shards are disjoint and together cover
  every sample; each epoch reshuffles deterministically. A rank's position in its stream
  (epoch, index) is checkpointed, so a resumed run reads exactly the batches an uninterrupted
  one would have.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from vpscluster.errors import UserError

BUNDLED = "kjv.txt.gz"


def read_corpus(path: str | None) -> bytes:
    """All bytes of the corpus: the bundled one when `path` is None."""
    if path is None:
        with resources.files("vpscluster.data").joinpath(BUNDLED).open("rb") as f:
            return gzip.decompress(f.read())
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = [f for f in sorted(p.rglob("*")) if f.is_file() and _looks_like_text(f)]
        if not files:
            raise UserError(f"--data {path}: the folder holds no text files; point it at .txt files")
    else:
        raise UserError(f"--data {path}: no such file or folder")
    chunks = []
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError as e:
            raise UserError(f"--data {f}: cannot read it ({e.strerror}); check its permissions") from None
        chunks.append(gzip.decompress(raw) if f.suffix == ".gz" else raw)
    return b"\n".join(chunks)


def _looks_like_text(f: Path) -> bool:
    """Skip binaries in a data folder: a NUL byte in the first 8 KiB means not text."""
    try:
        with f.open("rb") as fh:
            head = fh.read(8192)
    except OSError:
        return True  # let read_corpus report the error with its reason
    return f.suffix == ".gz" or b"\0" not in head


@dataclass
class Dataset:
    """Token arrays for training and validation plus the window length."""

    train: np.ndarray  # uint8
    val: np.ndarray  # uint8
    seq_len: int

    @property
    def num_train_samples(self) -> int:
        return (len(self.train) - 1) // self.seq_len

    @property
    def num_val_samples(self) -> int:
        return (len(self.val) - 1) // self.seq_len

    def window(self, tokens: np.ndarray, index: int) -> np.ndarray:
        start = index * self.seq_len
        return tokens[start : start + self.seq_len + 1]

    def val_batches(self, num_batches: int, batch_size: int):
        """The same `num_batches` validation batches on every rank, spread evenly over the split."""
        import torch

        n = self.num_val_samples
        wanted = min(num_batches * batch_size, n)
        idx = np.linspace(0, n - 1, wanted).round().astype(np.int64)
        for i in range(0, wanted, batch_size):
            yield _to_xy(torch, np.stack([self.window(self.val, j) for j in idx[i : i + batch_size]]))


def load_dataset(path: str | None, seq_len: int, val_fraction: float) -> Dataset:
    data = np.frombuffer(read_corpus(path), dtype=np.uint8)
    n_val = int(len(data) * val_fraction)
    where = path or "the bundled corpus"
    # Each split needs at least two windows so that train and validation both exist.
    need = 2 * (seq_len + 1)
    if n_val < need or len(data) - n_val < need:
        raise UserError(
            f"--data {where}: {len(data)} bytes are too few for seq_len {seq_len} with "
            f"val_fraction {val_fraction}; give at least {int(need / min(val_fraction, 1 - val_fraction)) + 1} bytes"
        )
    return Dataset(train=data[: len(data) - n_val], val=data[len(data) - n_val :], seq_len=seq_len)


def shard_indices(num_samples: int, shard: int, num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """Sample indices of `shard` (of `num_shards`) in `epoch`: a slice of one shared permutation."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    # One generator per (seed, epoch): independent of how many epochs ran before (resume-safe).
    perm = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(num_samples)
    return perm[shard::num_shards]


class ShardSampler:
    """An endless stream of batches from this rank's shard, epoch after epoch."""

    def __init__(self, dataset: Dataset, shard: int, num_shards: int, seed: int, batch_size: int) -> None:
        if dataset.num_train_samples < num_shards:
            raise UserError(
                f"the training data has {dataset.num_train_samples} samples, fewer than the "
                f"{num_shards} ranks reading it; use more data or fewer ranks"
            )
        self.dataset = dataset
        self.shard, self.num_shards = shard, num_shards
        self.seed, self.batch_size = seed, batch_size
        self.epoch, self.index = 0, 0
        self._order = shard_indices(dataset.num_train_samples, shard, num_shards, seed, 0)

    def next_batch(self):
        """(inputs, targets) int64 tensors of shape (batch_size, seq_len)."""
        import torch

        rows = []
        for _ in range(self.batch_size):
            if self.index >= len(self._order):
                self._set_epoch(self.epoch + 1)
            rows.append(self.dataset.window(self.dataset.train, int(self._order[self.index])))
            self.index += 1
        return _to_xy(torch, np.stack(rows))

    def _set_epoch(self, epoch: int) -> None:
        self.epoch, self.index = epoch, 0
        self._order = shard_indices(self.dataset.num_train_samples, self.shard, self.num_shards, self.seed, epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "shard": self.shard, "num_shards": self.num_shards}

    def load_state_dict(self, state: dict[str, Any], recut: bool = False) -> None:
        """Continue where the checkpoint stood. With `recut` (a checkpoint of another number of
        ranks, or another rank's shard) the shards are re-cut: every rank of the old run had
        read `index` samples of the epoch, i.e. the permutation's first index × W, so this rank
        skips its share of that prefix and reads on — nothing twice, nothing skipped."""
        old_shards = int(state["num_shards"])
        if not recut and (old_shards, int(state["shard"])) != (self.num_shards, self.shard):
            raise UserError(
                f"checkpoint was taken with data shard {state['shard']}/{state['num_shards']}, this rank "
                f"reads {self.shard}/{self.num_shards}; resume each rank from its own shard"
            )
        self._set_epoch(int(state["epoch"]))
        index = int(state["index"])
        if recut:
            consumed = index * old_shards
            index = max(0, -(-(consumed - self.shard) // self.num_shards))
        self.index = index


def _to_xy(torch, windows: np.ndarray):
    t = torch.from_numpy(windows.astype(np.int64))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class GlobalBatchSampler:
    """One global stream of micro-batches, the same on every rank; each rank reads its share.

    For uneven shares (`train/shares.py`): every epoch the samples are permuted by a generator
    seeded from (seed, epoch), as `shard_indices(..., 0, 1, ...)`. A step consumes the next
    `total * batch_size` samples of that stream, cut into `total` micro-batches in order;
    rank r takes micro-batches offsets[r] .. offsets[r] + shares[r] - 1. Which samples a step
    uses, and in which order, does not depend on the shares, so every sample is used once per
    epoch and a balanced run sees exactly the batches an even one does. Every rank advances the
    same position (checkpointed) whatever its share.
    """

    def __init__(self, dataset: Dataset, seed: int, batch_size: int) -> None:
        self.dataset, self.seed, self.batch_size = dataset, seed, batch_size
        self.epoch, self.index = 0, 0
        self._order = shard_indices(dataset.num_train_samples, 0, 1, seed, 0)

    def _next_index(self) -> int:
        if self.index >= len(self._order):
            self._set_epoch(self.epoch + 1)
        i = int(self._order[self.index])
        self.index += 1
        return i

    def _set_epoch(self, epoch: int) -> None:
        self.epoch, self.index = epoch, 0
        self._order = shard_indices(self.dataset.num_train_samples, 0, 1, self.seed, epoch)

    def next_step_indices(self, total: int) -> list[list[int]]:
        """The sample indices of the next step's `total` micro-batches (advances the stream)."""
        return [[self._next_index() for _ in range(self.batch_size)] for _ in range(total)]

    def next_step(self, shares: list[int], rank: int) -> list:
        """This rank's (inputs, targets) micro-batches of the next step."""
        import torch

        start = sum(shares[:rank])
        micro = self.next_step_indices(sum(shares))[start : start + shares[rank]]
        return [_to_xy(torch, np.stack([self.dataset.window(self.dataset.train, i) for i in m])) for m in micro]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "shard": 0, "num_shards": 1, "global": True}

    def load_state_dict(self, state: dict[str, Any], recut: bool = False) -> None:
        """The stream is global (the same on every rank), so another world continues it as is."""
        if not state.get("global"):
            raise UserError(
                "checkpoint was taken with per-rank data shards, this run uses shared micro-batches "
                "(--micro-batches); resume with the run's own settings"
            )
        self._set_epoch(int(state["epoch"]))
        self.index = int(state["index"])
