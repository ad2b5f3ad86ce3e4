"""Nested batches: tensors found, mapped and moved through the dicts, lists, tuples, namedtuples
and dataclasses a Dataset may yield, and the device transform applied to a batch's inputs."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mgpu.config.checks import ConfigError

Transform = Callable[[torch.Tensor], torch.Tensor]


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`batch` with `fn` applied to each tensor in it, through dicts, lists, tuples, namedtuples
    and dataclasses (their types kept); anything else passes through untouched."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        out = copy.copy(batch)  # keeps the dict's own type (OrderedDict, defaultdict, ...)
        for key, value in batch.items():
            out[key] = map_tensors(value, fn)
        return out
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [map_tensors(v, fn) for v in batch])
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        # A shallow copy with fields replaced: __init__/__post_init__ do not run again, and
        # object.__setattr__ works for frozen dataclasses too.
        out = copy.copy(batch)
        for f in dataclasses.fields(batch):
            object.__setattr__(out, f.name, map_tensors(getattr(batch, f.name), fn))
        return out
    return batch


def _rebuild(seq: list | tuple, items: list) -> Any:
    return type(seq)(*items) if hasattr(seq, "_fields") else type(seq)(items)  # namedtuple


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested batch (the structures `map_tensors` walks)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from tensors(getattr(batch, f.name))


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) batch to `device`; anything else passes through.

    non_blocking only overlaps when the source is pinned; from pageable memory it is a plain copy.
    A tensor already on `device` is returned as it is.
    """
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def transform_inputs(batch: Any, fn: Transform) -> Any:
    """`fn` applied to the inputs of an (inputs, targets, ...) batch; the rest is untouched."""
    if isinstance(batch, (list, tuple)) and len(batch) > 0:
        return _rebuild(batch, [fn(batch[0]), *batch[1:]])
    # A config error (exit 2, one line on every rank, at the first batch they agree on)
    why = "a device transform applies to the inputs of an (inputs, targets) batch, but this "
    why += f"batch is a {type(batch).__name__}; set data.device_transform=none or yield "
    raise ConfigError("data.device_transform", "auto", why + "(inputs, targets)")
