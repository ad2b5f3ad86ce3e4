"""The one way mgpu reads a GPU value on the host inside the training loop: copy it into pinned
host memory behind the work queued so far, and read it a step or a log interval later, when the
GPU has long finished the copy. The agreement's verdicts, the interval's loss and the rank
spread all go through HostCopy."""

from __future__ import annotations

import torch


class HostCopy:
    """`value` as it will be once the GPU reaches this point of its queue, on the host.

    On CUDA the copy is queued now (non_blocking, into pinned memory) and an event marks when it
    has landed; `read()` waits for that event: a sync point, but on a copy that is old by the
    time it is read. On CPU the value is already where the host can read it. `keep`: tensors
    that work queued before the copy reads (a pinned source of a host-to-device copy), held
    until the copy is read so that their memory is not reused under it.
    """

    def __init__(self, value: torch.Tensor, keep: tuple[torch.Tensor, ...] = ()):
        self.copied: torch.cuda.Event | None = None
        self.host = value
        self._keep = keep
        if value.device.type == "cuda":
            self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def read(self) -> torch.Tensor:
        """The host tensor, once the copy has landed (waits for it on CUDA)."""
        if self.copied is not None:
            self.copied.synchronize()  # sync point, on a copy a step or an interval old
        self._keep = ()
        return self.host
