"""How batches reach the training step and evaluation: a DeviceLoader's as they come, a plain
DataLoader's moved to the device and transformed here, in the memory layout the model wants;
and the first batch of a run, read before the first step and agreed on by every rank, so that
bad input found there stops them all alike."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from mgpu.config.checks import ConfigError
from mgpu.data.batches import to_device
from mgpu.data.prefetch import DeviceLoader
from mgpu.runtime.dist import BAD_INPUT, RunStopped, Runtime, all_ok, waiting
from mgpu.train import watchdog


class Feed:
    """Batches for one device. `input_transform` is applied on the device to the inputs of a
    plain DataLoader; a DeviceLoader (what build_loader returns) applies its own, per
    data.device_transform. `channels_last`: 4-D inputs in that memory format."""

    def __init__(
        self,
        device: torch.device,
        channels_last: bool,
        input_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.device, self.channels_last = device, channels_last
        self.input_transform = input_transform

    def prepare(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A device batch in the layout the model wants (a no-op for a DeviceLoader's made with
        that layout). A host batch is moved here (on the current stream; to_device leaves
        tensors already on the device as they are)."""
        inputs, targets = to_device(batch, self.device)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """A DeviceLoader's batches as they come; a plain loader's moved and transformed here."""
        if isinstance(loader, DeviceLoader):
            yield from loader
            return
        for batch in loader:
            inputs, targets = to_device(batch, self.device)
            if self.input_transform is not None:
                inputs = self.input_transform(inputs)
            yield inputs, targets

    def prefetcher(self, loader: DeviceLoader | DataLoader) -> tuple[DeviceLoader, bool]:
        """The loader to train from, and whether this made it (and so the caller must close it)."""
        if isinstance(loader, DeviceLoader):
            return loader, False
        # Inputs in the model's layout, converted on the side stream (prepare's is then a
        # no-op); a DeviceLoader given to fit was built with its memory_format (build_run).
        layout = torch.channels_last if self.channels_last else None
        prefetcher = DeviceLoader(
            loader, self.device, transform=self.input_transform, memory_format=layout
        )
        return prefetcher, True


def first_batch_everywhere(
    batches: Generator[Any, None, None], rt: Runtime, watch: watchdog.Watchdog, step: int
) -> Iterator[Any]:
    """The batches, the first one read before the first step and agreed on: bad input found
    there (an unreadable image under data.bad_files=error) stops every rank, the one that
    read it with its one line and the others quietly, all with exit code 2; not that rank
    alone, leaving the others to fail in the step's collectives with tracebacks.

    `watch` hears of the read and of the agreement as phases of `step` (the first one the loop
    trains), so that a rank stuck in its first batch is the one a stall report names as
    lagging (a GPU's prefetcher reads three batches here, so a loader stuck at step 3 is)."""
    error = None
    watch.beat(step, watchdog.DATA)
    try:
        first = [next(batches)]
        if isinstance(first[0], Mapping):  # unpacked as (inputs, targets), its keys would be
            why = "the data set's batches are dicts, not (inputs, targets) pairs: return a tuple "
            why += "(inputs, target) from its __getitem__, or give it a collate attribute that "
            raise ConfigError("data", sorted(first[0]), why + "makes such batches")
    except StopIteration:
        first = []
    except RunStopped as err:
        error = err
    watch.beat(step, watchdog.FIRST_BATCH)
    with waiting(rt.rank, "agreeing that every rank read its first batch"):
        everywhere = all_ok(error is None, rt)
    if error is not None:
        raise error
    if not everywhere:
        raise PeerInputError("another rank could not read its first batch (it says why)")
    return _prepended(first, batches)


def _prepended(first: list[Any], batches: Generator[Any, None, None]) -> Generator[Any, None, None]:
    """`first`, then `batches`, which closing this closes (fit's end closes its batches)."""
    try:
        yield from first
        yield from batches
    finally:
        batches.close()


class PeerInputError(RunStopped):
    """Another rank found bad input before the first step: it says so; this rank stops with
    it, quietly (in its log) and with the same exit code."""

    exit_code = BAD_INPUT
    level = logging.INFO
