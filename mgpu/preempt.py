"""Preemption: SIGTERM and SIGUSR1 only set a flag; every step, the ranks agree on the flags of
all ranks through one small collective, so that all of them stop after the same step, save one
checkpoint together and exit with PREEMPTED_EXIT_CODE ("preempted, resumable").

The agreement costs no per-step host stall: each step issues an asynchronous all_reduce(MAX) of
this rank's flag and reads the result of the exchange issued LAG steps earlier, which the GPU
finished long ago, so the host may still run a step ahead of the GPU. A signal that arrives
during step s is in step s's exchange and is acted on after step s+LAG, on every rank at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections import deque
from types import FrameType

import torch
import torch.distributed as tdist

from mgpu.dist import Runtime

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL: a temporary failure, try again. A preempted run saved a checkpoint and
# resumes from it when started again with the same command (ckpt.resume=auto).
PREEMPTED_EXIT_CODE = 75
# Steps between issuing an exchange and reading it. With 1 the host would wait every step for
# the previous step's GPU work; with 2 that work is a step older and done in practice.
LAG = 2
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised out of the training loop after every rank saved at the step they agreed on."""

    def __init__(self, step: int, signum: int | None):
        name = signal.Signals(signum).name if signum else "another rank's signal"
        super().__init__(f"preempted ({name}) after step {step}")
        self.step = step


class Preemption:
    """Install the handlers with `with Preemption(rt) as p:` (previous handlers come back on
    exit); call `p.poll()` once per training step on every rank.

    A handler can only run on the main thread, between Python bytecodes: a rank stuck inside a
    collective or a long C call acts on the signal only once that returns (dist.timeout_s bounds
    a hung collective); until then torchrun's shutdown timeout (30 s) is what ends it.
    """

    def __init__(self, rt: Runtime, signals: tuple[signal.Signals, ...] = SIGNALS):
        self.rt, self.signals = rt, signals
        self.signum: int | None = None  # the first signal this process received
        self._previous: dict[signal.Signals, object] = {}
        # Exchanges in flight, oldest first; each has its own flag buffers, reused after it is read.
        self._pending: deque[tuple[tdist.Work, torch.cuda.Event | None, torch.Tensor, torch.Tensor]]
        self._pending = deque()
        self.distributed = rt.has_process_group and rt.world_size > 1
        self.nccl = rt.backend == "nccl"
        self._device = rt.device if self.nccl else torch.device("cpu")
        # The agreed flag comes back to pinned host memory by an async copy, on a stream of its
        # own: waiting for the all_reduce there leaves the compute stream unstalled.
        self._side = torch.cuda.Stream(self._device) if self.nccl else None
        self._free: list[tuple[torch.Tensor, torch.Tensor]] = []  # buffers of read exchanges

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving here would run in the middle of whatever the main thread was doing,
        # possibly a collective, and other ranks would not know.
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        else:
            log.warning("not on the main thread: SIGTERM/SIGUSR1 keep their default action")
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        self._pending.clear()  # exchanges left unread: their peers may be gone, do not wait

    def poll(self) -> bool:
        """Whether to stop after this step: True on every rank at the same step, once any rank
        had a signal LAG steps earlier. A collective: every rank calls it every step."""
        if not self.distributed:
            return self.signum is not None
        agreed = False
        if len(self._pending) == LAG:
            agreed = self._read(self._pending.popleft())
        flag, host = self._free.pop() if self._free else self._buffers()
        flag.fill_(int(self.signum is not None))
        work = tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, async_op=True)
        copied = None
        if self.nccl:
            with torch.cuda.stream(self._side):
                work.wait()  # the side stream waits for the all_reduce; nothing else does
                host.copy_(flag, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._side)
        self._pending.append((work, copied, flag, host))
        return agreed

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        flag = torch.zeros(1, dtype=torch.int32, device=self._device)
        host = torch.zeros(1, dtype=torch.int32, pin_memory=self.nccl)
        return flag, host

    def _read(self, exchange) -> bool:
        work, copied, flag, host = exchange
        if copied is None:
            work.wait()  # gloo, on the host: an exchange every rank issued LAG steps ago
            agreed = bool(flag.item())
        else:
            copied.synchronize()  # sync point, on an exchange LAG steps old: long finished
            agreed = bool(host.item())
        self._free.append((flag, host))  # its all_reduce and copy are done: reusable
        return agreed

    def settle(self) -> None:
        """Wait for the exchanges still in flight, which every rank issued; before leaving the
        loop without an error, so that no collective is running when the process group goes."""
        while self._pending:
            self._read(self._pending.popleft())
