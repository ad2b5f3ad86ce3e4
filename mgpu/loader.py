"""Input pipeline: the dataset built from config, the rank-sharded sampler, the DataLoader, and the
copy of each batch to the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mgpu.config import DataConfig, build_from_target
from mgpu.dist import Runtime


def build_dataset(cfg: DataConfig, split: str) -> Dataset:
    return build_from_target("data", cfg._target_, cfg.dataset_kwargs(), split=split)


class ShardedSampler(Sampler[int]):
    """Each rank's share of the sample indices, reshuffled every epoch from (seed, epoch).

    Training (`even=True`) drops the tail that does not divide by the world size, so every rank
    takes the same number of steps per epoch: ranks that disagree on that would deadlock in the
    gradient all-reduce. Evaluation (`even=False`) gives every sample to exactly one rank, with
    no padded duplicates; ranks then differ by at most one sample.
    """

    def __init__(
        self, num_samples: int, rank: int, world_size: int, *, shuffle: bool, seed: int, even: bool
    ):
        if even and num_samples < world_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than the "
                f"{world_size} processes; use more data or fewer processes"
            )
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.shuffle, self.seed, self.even = shuffle, seed, even
        self.epoch = 0
        self.total = num_samples - num_samples % world_size if even else num_samples

    def set_epoch(self, epoch: int) -> None:
        """Call before iterating an epoch; all ranks must pass the same epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(range(self.rank, self.total, self.world_size))

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_samples, generator=g)[: self.total]
            return iter(order[self.rank :: self.world_size].tolist())
        return iter(range(self.rank, self.total, self.world_size))


def build_loader(
    cfg: DataConfig, dataset: Dataset, rt: Runtime, *, seed: int, train: bool
) -> DataLoader:
    """A DataLoader over this rank's shard; train loaders drop ragged last batches."""
    sampler = ShardedSampler(
        len(dataset), rt.rank, rt.world_size, shuffle=train, seed=seed, even=train
    )
    if train and len(sampler) < cfg.batch_size:
        raise ValueError(
            f"data.batch_size={cfg.batch_size}: each of the {rt.world_size} processes gets only "
            f"{len(sampler)} training samples, less than one batch; lower data.batch_size"
        )
    workers = cfg.num_workers
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=workers,
        # Pinned host memory only helps a copy to a GPU; on CPU there is nothing to pin for.
        pin_memory=cfg.pin_memory and rt.device.type == "cuda",
        drop_last=train,
        # Train loaders run for many epochs: keep their workers instead of forking anew.
        persistent_workers=train and workers > 0,
        generator=torch.Generator().manual_seed(seed + rt.rank),
    )


def epochs(loader: DataLoader) -> Iterator[Any]:
    """Batches forever, epoch after epoch, each with its own shuffle."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        yield from loader
        epoch += 1


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) batch to `device`; anything else passes through.

    non_blocking only overlaps when the source is pinned; from pageable memory it is a plain copy.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
