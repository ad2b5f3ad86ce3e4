"""Process groups and streams of mgpu's own for gradient communication: an NCCL communicator
whose kernels may occupy at most dist.nccl_max_ctas SMs, or run on high-priority streams
(dist.nccl_high_priority), and the reducer's stream at that priority."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from mgpu.config.checks import ConfigError
from mgpu.config.schema import DistConfig
from mgpu.runtime.dist import Runtime

# torch.cuda.Stream priorities: lower is higher; 0 is every stream's default (the lowest)
HIGH_PRIORITY = -1


def comm_group(rt: Runtime, cfg: DistConfig) -> tdist.ProcessGroup | None:
    """The default group (None), or with dist.nccl_max_ctas or dist.nccl_high_priority a
    communicator of mgpu's own: its kernels on at most that many SMs, leaving the rest to
    backward's kernels, or on high-priority streams, scheduled before other streams' waiting
    blocks. Creating a group is a collective: every rank wraps its model at the same point."""
    max_ctas, high = cfg.nccl_max_ctas, cfg.nccl_high_priority
    if max_ctas == 0 and not high:
        return None
    if rt.backend != "nccl":
        key, value, off = (
            ("dist.nccl_max_ctas", max_ctas, "0")
            if max_ctas
            else ("dist.nccl_high_priority", high, "false")
        )
        raise ConfigError(key, value, f"needs the nccl backend, not {rt.backend}; set {key}={off}")
    if not rt.distributed:  # a world of one (dist.shard_optimizer): no communicator
        return None
    options = tdist.ProcessGroupNCCL.Options(is_high_priority_stream=high)
    if max_ctas:
        options.config.max_ctas = max_ctas
    return tdist.new_group(backend="nccl", pg_options=options)


def comm_stream(rt: Runtime, cfg: DistConfig) -> torch.cuda.Stream | None:
    """The reducer's stream on a GPU (None on a CPU), at high priority with
    dist.nccl_high_priority. Stream-lifetime rule: one for the reducer's life; one per step
    would leak."""
    if rt.device.type != "cuda":
        return None
    priority = HIGH_PRIORITY if cfg.nccl_high_priority else 0
    return torch.cuda.Stream(device=rt.device, priority=priority)
