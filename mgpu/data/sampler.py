"""Which samples each rank takes, and in what order: the rank-sharded sampler, reshuffled every
epoch from (seed, epoch), and the data cursor a checkpoint records, so that a run resumes, on any
number of ranks, with exactly the samples it had not yet seen."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any, NamedTuple

import torch
from torch.utils.data import Sampler


class SampleKey(NamedTuple):
    """What a keyed training sampler hands the dataset instead of a bare index: the sample, and
    the epoch and seed its random augmentation is drawn from (a dataset in a DataLoader worker
    cannot see the sampler's epoch otherwise), and its place in the training order,
    `epoch * num_samples + entry` (its entry in the epoch's permutation): the same for a sample
    whatever the number of ranks, and larger for every sample trained later (stream_position)."""

    index: int
    epoch: int
    seed: int
    position: int = 0


class ShardedSampler(Sampler[int]):
    """Each rank's share of the sample indices, reshuffled every epoch from (seed, epoch).

    Training (`even=True`) drops the tail that does not divide by the world size, so every rank
    takes the same number of steps per epoch: ranks that disagree on that would deadlock in the
    gradient all-reduce. Evaluation (`even=False`) gives every sample to exactly one rank, with
    no padded duplicates; ranks then differ by at most one sample.

    Rank r takes entries r, r + world, ... of the epoch's order, so after k batches of b on
    every rank the samples consumed are exactly the order's first k * b * world entries: a
    DataCursor. `set_epoch(epoch, consumed)` starts an epoch past such a prefix, on any number
    of ranks (resume).

    `keyed=True` yields SampleKey(index, epoch, seed) for datasets that augment per epoch
    (their `sample_keys` attribute); the indices are the same either way.

    `stream_batch=B` (training loaders): iterating yields epoch after epoch without end, each
    cut to whole batches of B (the tail drop_last would leave), so a DataLoader over it makes
    the same batches as one iterated epoch by epoch, with no gap between epochs: its workers
    and the prefetcher run on into the next epoch instead of starting from empty (a new
    iteration waits for a worker's first whole batch before its first step; on a small image
    folder that is every few dozen steps). `len()` and `epoch_keys()` stay one epoch's.
    """

    def __init__(
        self,
        num_samples: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool,
        seed: int,
        even: bool,
        keyed: bool = False,
        stream_batch: int = 0,
    ):
        if even and num_samples < world_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than the "
                f"{world_size} processes; use more data or fewer processes"
            )
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        if stream_batch and not even:
            raise ValueError("only a training sampler (even=True) streams epoch after epoch")
        if stream_batch > num_samples // world_size:  # no whole batch: a stream of nothing
            raise ValueError(
                f"each of the {world_size} processes gets {num_samples // world_size} samples "
                f"an epoch, less than a batch of {stream_batch}; use smaller batches"
            )
        self.shuffle, self.seed, self.even, self.keyed = shuffle, seed, even, keyed
        self.stream_batch = stream_batch
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Call before iterating an epoch; all ranks must pass the same epoch and `consumed`
        (the entries of the epoch's order that earlier steps took, over all ranks)."""
        if consumed and not self.even:
            raise ValueError("only a training sampler (even=True) can start past a prefix")
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(f"consumed={consumed} is outside the {self.num_samples} samples")
        self.epoch, self.consumed = epoch, consumed

    def __len__(self) -> int:
        if self.even:
            return (self.num_samples - self.consumed) // self.world_size
        return len(range(self.rank, self.num_samples, self.world_size))

    def __iter__(self) -> Iterator[int] | Iterator[SampleKey]:
        if self.stream_batch:
            return self._stream(self.epoch, self.consumed)
        return self.epoch_keys()

    def epoch_keys(self) -> Iterator[int] | Iterator[SampleKey]:
        """The epoch set by set_epoch, whole: what iterating yields without stream_batch."""
        return self._keys(self.epoch, self.consumed)

    def _stream(self, epoch: int, consumed: int) -> Iterator[int] | Iterator[SampleKey]:
        """Epochs from (epoch, consumed) on, each cut to whole batches of stream_batch."""
        while True:
            per_rank = (self.num_samples - consumed) // self.world_size
            whole = per_rank // self.stream_batch * self.stream_batch
            yield from islice(self._keys(epoch, consumed), whole)
            epoch, consumed = epoch + 1, 0

    def _keys(self, epoch: int, consumed: int) -> Iterator[int] | Iterator[SampleKey]:
        indices = self._indices(epoch, consumed)
        if not self.keyed:
            return indices
        # rank r takes entries consumed + r, + world, ... of the epoch's order (_indices)
        seed, world = self.seed, self.world_size
        first = epoch * self.num_samples + consumed + self.rank
        return (SampleKey(i, epoch, seed, first + j * world) for j, i in enumerate(indices))

    def _indices(self, epoch: int, consumed: int) -> Iterator[int]:
        if not self.even:
            return iter(range(self.rank, self.num_samples, self.world_size))
        if self.shuffle:
            return iter(
                remaining_indices(
                    self.num_samples, self.seed, epoch, consumed, self.rank, self.world_size
                )
            )
        end = consumed + (self.num_samples - consumed) // self.world_size * self.world_size
        return iter(range(consumed + self.rank, end, self.world_size))


@dataclasses.dataclass(frozen=True)
class DataCursor:
    """Where training stands in the sample stream: all ranks together have consumed the first
    `consumed` entries of epoch `epoch`'s permutation of `num_samples` indices drawn from `seed`.

    Consumed samples are always a prefix of the permutation (ShardedSampler's docstring), so
    the cursor does not depend on the number of ranks that consumed them.
    """

    seed: int
    epoch: int
    consumed: int
    num_samples: int

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("seed", "epoch", "consumed", "num_samples")}

    @classmethod
    def from_dict(cls, d: Mapping) -> DataCursor:
        return cls(int(d["seed"]), int(d["epoch"]), int(d["consumed"]), int(d["num_samples"]))


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The training order of one epoch: a permutation drawn from (seed, epoch) alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g)


def remaining_indices(
    num_samples: int, seed: int, epoch: int, consumed: int, rank: int, world_size: int
) -> list[int]:
    """Rank `rank`'s samples for the rest of an epoch whose first `consumed` permutation entries
    are done: the rest dealt round-robin over `world_size` ranks.

    Tail rule: the last (num_samples - consumed) % world_size entries are dropped so every rank
    takes the same number of steps. With consumed=0 this is ShardedSampler's training shard; at
    the world size that consumed them, it continues that shard exactly.
    """
    if not 0 <= consumed <= num_samples:
        raise ValueError(f"consumed={consumed} is outside the epoch's {num_samples} samples")
    end = consumed + (num_samples - consumed) // world_size * world_size
    return epoch_order(num_samples, seed, epoch)[consumed + rank : end : world_size].tolist()


def advance(cursor: DataCursor, batches: int, *, batch_size: int, world_size: int) -> DataCursor:
    """The cursor after every rank took `batches` more batches (drop_last), rolling into the
    next epoch as the sampler and DataLoader do. Pure: count batches from the step number, not
    from the loader, whose prefetching runs ahead of training."""
    epoch, consumed, n = cursor.epoch, cursor.consumed, cursor.num_samples
    if n // world_size < batch_size:
        raise ValueError(f"{n} samples give no batch of {batch_size} on {world_size} ranks")
    while True:
        left = (n - consumed) // world_size // batch_size  # whole batches left per rank
        take = min(batches, left)
        consumed += take * batch_size * world_size
        batches -= take
        if batches == 0:
            return DataCursor(cursor.seed, epoch, consumed, n)
        epoch, consumed = epoch + 1, 0


def stream_position(start: DataCursor, batches: int, *, batch_size: int, world_size: int) -> int:
    """The place in the training order (SampleKey.position) of the first sample of the batch
    `batches` batches after `start`, on every rank: each sample of it and of every later batch
    has a position at least this, each of an earlier one less."""
    at = advance(start, batches, batch_size=batch_size, world_size=world_size)
    return at.epoch * at.num_samples + at.consumed


def epochs(loader: Any, start: DataCursor | None = None) -> Iterator[Any]:
    """Batches forever, epoch after epoch, each with its own shuffle; from `start` (a resumed
    run's cursor) the first epoch is `start.epoch` past its first `start.consumed` samples."""
    set_epoch = getattr(loader, "set_epoch", None) or loader.sampler.set_epoch  # type: ignore
    epoch, consumed = (start.epoch, start.consumed) if start is not None else (0, 0)
    while True:
        if consumed:
            set_epoch(epoch, consumed)
        else:
            set_epoch(epoch)  # samplers without a prefix (any with set_epoch(epoch)) work too
        yield from loader
        epoch, consumed = epoch + 1, 0
