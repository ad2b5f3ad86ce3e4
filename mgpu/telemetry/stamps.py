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

import logging

import torch

from mgpu.telemetry.lagged import HostCopy

log = logging.getLogger(__name__)

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


def build(device: torch.device) -> GraphStamps | None:
    """The stamps, or None where the GPU cannot stamp (available) or their kernel cannot be
    built here (a Triton that cannot compile: no C compiler, another GPU maker's build): said
    once, and the replayed steps' exposed communication is then not measured (telemetry only;
    the run goes on)."""
    if not available(device):
        return None
    try:
        return GraphStamps(device)
    except Exception as err:
        log.warning("telemetry: replayed steps' exposed communication not measured (%s)", err)
        return None


class GraphStamps:
    """Two stamps per replayed step, `begin` and `end`, each on the stream current where it is
    called (inside a capture: recorded into the graph); `end` moves to the next step's slot.

    Stream rules: the stamps and the counter's increment are queued on the compute stream of the
    step they time, in that order, so a step's slot is written before the counter moves on;
    `snapshot` copies counter and ring behind the work queued so far on the current stream, and
    then, on the device in the same order, keeps the counter as the next snapshot's start."""

    def __init__(self, device: torch.device):
        self.ring = torch.zeros(RING, 2, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.since = torch.zeros(1, dtype=torch.int64, device=device)  # the last snapshot's count
        self.kernel = _stamp_kernel()
        # Both stamps built (one kernel each) and launched once now, outside any capture:
        # recording must not compile one.
        self._stamp(0)
        self._stamp(1)
        self.ring.zero_()

    def _stamp(self, which: int) -> None:
        self.kernel[(1,)](self.ring, self.count, which, RING, num_warps=1)

    def begin(self) -> None:
        self._stamp(0)

    def end(self) -> None:
        """The step's second stamp, and the counter on to the next step's slot."""
        self._stamp(1)
        self.count.add_(1)

    def snapshot(self) -> StampRange:
        """The steps stamped since the last snapshot, on their way to the host (read them an
        interval later): each snapshot holds its own range, read or not."""
        data = torch.cat([self.since, self.count, self.ring.flatten()])
        self.since.copy_(self.count)
        return StampRange(HostCopy(data))


class StampRange:
    """A snapshot's reading: the replayed steps since the previous snapshot, and their time."""

    def __init__(self, copy: HostCopy):
        self.copy = copy
        self._read: tuple[float, int] | None = None

    def reading(self) -> tuple[float, int]:
        """(milliseconds between begin and end summed over the range's steps, its steps)."""
        if self._read is None:
            self._read = span_total_ms(self.copy.read())
        return self._read

    def total_ms(self) -> float:
        return self.reading()[0]


def span_total_ms(data: torch.Tensor) -> tuple[float, int]:
    """(milliseconds summed over a snapshot's steps, how many steps) from its host copy: [the
    previous snapshot's counter, the counter, a ring of RING (begin, end) pairs in ns]. Steps
    whose slots the ring has since overwritten are counted at the mean of the RING kept."""
    since, count = int(data[0]), int(data[1])
    ring = data[2:].view(-1, 2)
    steps = count - since
    if steps <= 0:
        return 0.0, 0
    kept = min(steps, ring.shape[0])
    slots = torch.arange(count - kept, count) % ring.shape[0]
    spans = (ring[slots, 1] - ring[slots, 0]).double()
    return float(spans.mean()) * steps / 1e6, steps
