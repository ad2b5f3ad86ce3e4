"""Process groups of mgpu's own for gradient communication: an NCCL communicator whose kernels
may occupy at most dist.nccl_max_ctas SMs (the reducer's, when that is set)."""

from __future__ import annotations

import torch.distributed as tdist

from mgpu.runtime.dist import Runtime


def capped_group(rt: Runtime, max_ctas: int) -> tdist.ProcessGroup | None:
    """The default group (None), or with dist.nccl_max_ctas a communicator whose kernels may
    occupy at most that many SMs, leaving the rest to backward's kernels. Creating a group is a
    collective: every rank wraps its model at the same point."""
    if max_ctas == 0:
        return None
    if rt.backend != "nccl":
        raise ValueError(
            f"dist.nccl_max_ctas={max_ctas} needs the nccl backend, not {rt.backend}; "
            "set dist.nccl_max_ctas=0"
        )
    if not rt.distributed:  # a world of one (dist.shard_optimizer): no communicator
        return None
    options = tdist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    return tdist.new_group(backend="nccl", pg_options=options)
