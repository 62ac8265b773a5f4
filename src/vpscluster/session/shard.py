"""`Session.shard`: this rank's part of a map-style dataset, batch by batch.

Any object with `len()` and `[i]` works (a torch `Dataset`, a list of tuples). Every epoch the
sample indices are permuted by a generator seeded from (seed, epoch) — the same on every rank,
independent of how many epochs ran before (`train.data.shard_indices`) — and cut into steps of
`total * batch_size` samples, `total` micro-batches of `batch_size` in order: rank r takes
micro-batches offsets[r] .. offsets[r] + shares[r] - 1 (`train.shares`). A ddp session's
shares (`Session.weighted`) cut each step of `world * batch_size` samples into one batch per rank
of a size that follows its share (`train.shares.batch_sizes`: 48/16 for shares 3/1 and
batch_size 32), and set the rank's gradient weight (`Session._weigh`): the step's gradient is
that of the mean loss over all its samples, as in the even split. With even shares
(one micro-batch per rank) that is a DistributedSampler without padding. Every rank runs the
same number of steps per epoch (the samples of a last, incomplete step are left out, as with
`drop_last`), so their collectives pair up.

The position (epoch, steps started in it, and the first sample of the next step in the epoch's
order) lives in the session and is checkpointed with it: a new `shard(...)` call, or a new `for`
over the same loader, goes on where the last one stopped, and an epoch that ended starts the next
one in a new order. It is kept in samples because a step's size can change mid-epoch: `--strategy
auto` on uneven shares starts as ddp (world x batch_size samples a step) and may switch to diloco
(the shares' micro-batches of batch_size a step, `session/auto.py`); the next step starts at the
sample after the last one read, so within an epoch no sample is skipped or read twice, and an
epoch whose rest holds no whole step of the new size ends at the switch (`settle`). The epoch's last step already
counts as the next epoch's start (`Session.epoch`), so a script resumed from a checkpoint of
that step (`for epoch in range(s.epoch, epochs)`) trains no epoch twice.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from vpscluster.errors import UserError


class ShardLoader:
    def __init__(self, session: Any, dataset: Any, batch_size: int, collate: Callable[[list], Any] | None) -> None:
        if batch_size < 1:
            raise UserError(f"shard(batch_size={batch_size}): give at least 1")
        try:
            self.num_samples = len(dataset)
        except TypeError:
            raise UserError("shard() takes a map-style dataset (with len() and [i]); "
                            f"{type(dataset).__name__} has no len()") from None
        self.session, self.dataset, self.batch_size = session, dataset, batch_size
        self.collate = collate
        self._fits()

    @property
    def weighted(self) -> bool:
        """ddp's shares (`Session.weighted`): a step is world x batch_size samples whatever the split."""
        return bool(getattr(self.session, "weighted", False))

    @property
    def total(self) -> int:
        """Batches of batch_size a step holds, all ranks together (ranks, or micro-batches)."""
        shares = self.session._shares()
        return len(shares) if self.weighted else sum(shares)

    @property
    def step_samples(self) -> int:
        return self.total * self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Steps in a whole epoch at the current step size."""
        return self.num_samples // self.step_samples

    def _fits(self) -> None:
        if self.steps_per_epoch < 1:
            raise UserError(f"the dataset has {self.num_samples} samples, fewer than one step of {self.total} "
                            f"{'ranks' if self.weighted else 'micro-batches'} of {self.batch_size}; use a smaller "
                            f"batch_size or more data")

    def __len__(self) -> int:
        """Batches this rank reads in a whole epoch at the current split."""
        if self.weighted:
            return self.steps_per_epoch
        return self.steps_per_epoch * self.session._shares()[self.session._shard_index()]

    def settle(self) -> None:
        """An epoch whose rest holds no whole step at the current size ends here (its last samples
        are left out, as with drop_last): the position moves to the next epoch's start."""
        pos = self.session._data
        size = self.step_samples
        if "sample" not in pos:  # a checkpoint from before positions were kept in samples: steps of this size
            pos["sample"] = pos["index"] * size
        if self.num_samples - pos["sample"] < size:
            pos["epoch"], pos["index"], pos["sample"] = pos["epoch"] + 1, 0, 0

    def _collate(self, items: list) -> Any:
        if self.collate is not None:
            return self.collate(items)
        from torch.utils.data import default_collate

        return default_collate(items)

    def __iter__(self) -> Iterator[Any]:
        from vpscluster.train.data import shard_indices

        s = self.session
        self._fits()  # a step of the current size (auto's diloco steps are larger than ddp's) fits the data
        self.settle()  # the last epoch ended: a new order
        pos = s._data
        epoch = pos["epoch"]
        order = shard_indices(self.num_samples, 0, 1, s.cfg.seed, epoch)
        shard = s._shard_index()
        b = self.batch_size
        while True:
            if pos["epoch"] != epoch:  # the step size grew past what is left of the epoch (`Session._settle_data`)
                return
            shares = s._shares()  # the same on every rank
            total, weighted = self.total, self.weighted
            step_first = pos["sample"]  # the step's first sample in this epoch's order
            pos["index"] += 1
            pos["sample"] = step_first + total * b
            last = self.num_samples - pos["sample"] < total * b
            if last:  # the epoch's last step: a checkpoint of it resumes at the next epoch (`Session.epoch`)
                pos["epoch"], pos["index"], pos["sample"] = epoch + 1, 0, 0
            if weighted:  # one batch of this rank's size; its gradient weighted by it
                sizes = s._batch_sizes(total * b)
                first = step_first + sum(sizes[:shard])
                s._weigh(sizes)
                yield self._collate([self.dataset[int(j)] for j in order[first: first + sizes[shard]]])
                if last:
                    return
                continue
            n, first = shares[shard], step_first + sum(shares[:shard]) * b
            for i in range(n):
                idx = order[first + i * b: first + (i + 1) * b]
                s._micro = (i, n)
                yield self._collate([self.dataset[int(j)] for j in idx])
            s._micro = (0, 1)
            if last:
                return
