"""Timestamps the GPU takes itself, for steps replayed as CUDA graphs (mgpu.train.graphs): a timed
CUDA event cannot be recorded into a graph, and an event recorded by every replay would be read
by a host that is steps ahead of it, always unfinished. So a replayed step's graph holds a
one-thread kernel that writes the GPU's global nanosecond timer into a ring of device memory, at
the slot of a step counter the graph advances itself; the host copies the ring out when an
interval closes and reads the copy an interval later (HostCopy), with no wait on the GPU.

Owns: the ring, its counter, the kernel (Triton, which ships with torch's CUDA builds), and the
reading: the time between a step's two stamps, summed over the steps the interval replayed.
The reducer stamps where its timed events would have been (mgpu.comm.reducer: backward's end and
the compute stream's wait for the last reduction), so the figure is the exposed communication
that telemetry reports for steps launched from Python (mgpu.telemetry.timing).
"""

from __future__ import annotations

import torch

from mgpu.telemetry.lagged import HostCopy

RING = 4096  # steps kept: an interval of more replayed steps is measured by its last RING


def available(device: torch.device) -> bool:
    """Whether the GPU can stamp: a CUDA device and Triton to build the kernel with."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_KERNEL = None


def _stamp_kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def stamp(ring_ptr, count_ptr, which: tl.constexpr, size: tl.constexpr):
            step = tl.load(count_ptr)
            # %globaltimer: the GPU's nanosecond clock, one for all its SMs. The step is an
            # operand only so that the reading is an elementwise op of a value (never hoisted).
            now = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l,l", [step], dtype=tl.int64, is_pure=False, pack=1
            )
            tl.store(ring_ptr + (step % size) * 2 + which, now)

        _KERNEL = stamp
    return _KERNEL


class GraphStamps:
    """Two stamps per replayed step, `begin` and `end`, each on the stream current where it is
    called (inside a capture: recorded into the graph); `end` moves to the next step's slot.

    Stream rules: the stamps and the counter's increment are queued on the compute stream of the
    step they time, in that order, so a step's slot is written before the counter moves on;
    `snapshot` copies counter and ring behind the work queued so far on the current stream."""

    def __init__(self, device: torch.device):
        self.ring = torch.zeros(RING, 2, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.kernel = _stamp_kernel()
        self.read_upto = 0  # the steps whose time an earlier snapshot's reading has counted
        # Both stamps built (one kernel each) and launched once now, outside any capture:
        # recording must not compile one.
        self._stamp(0)
        self._stamp(1)
        self.ring.zero_()

    def _stamp(self, which: int) -> None:
        self.kernel[(1,)](self.ring, self.count, which, RING)

    def begin(self) -> None:
        self._stamp(0)

    def end(self) -> None:
        """The step's second stamp, and the counter on to the next step's slot."""
        self._stamp(1)
        self.count.add_(1)

    def snapshot(self) -> StampRange:
        """The stamps so far, on their way to the host (read them an interval later)."""
        return StampRange(self, HostCopy(torch.cat([self.count, self.ring.flatten()])))


class StampRange:
    """A snapshot's reading: the replayed steps since the previous snapshot's, and their time.
    Snapshots are read in the order they were taken (metrics publishes intervals in order)."""

    def __init__(self, stamps: GraphStamps, copy: HostCopy):
        self.stamps = stamps
        self.copy = copy
        self.read: tuple[float, int] | None = None

    def total_ms(self) -> float:
        """Milliseconds between begin and end, summed over the steps since the last reading."""
        if self.read is None:  # once: the reading moves the stamps' read_upto on
            self.read = span_total_ms(self.copy.read(), self.stamps.read_upto)
            self.stamps.read_upto += self.read[1]
        return self.read[0]


def span_total_ms(data: torch.Tensor, read_upto: int) -> tuple[float, int]:
    """(milliseconds summed over the steps stamped since `read_upto`, how many steps) from a
    snapshot's host copy: [counter, ring of RING (begin, end) pairs in ns]. Steps whose slots
    the ring has since overwritten are counted at the mean of the RING kept."""
    count = int(data[0])
    ring = data[1:].view(-1, 2)
    steps = count - read_upto
    if steps <= 0:
        return 0.0, 0
    kept = min(steps, ring.shape[0])
    slots = torch.arange(count - kept, count) % ring.shape[0]
    spans = (ring[slots, 1] - ring[slots, 0]).double()
    return float(spans.mean()) * steps / 1e6, steps
