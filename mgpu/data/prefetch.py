"""The side-stream prefetcher (DeviceLoader): it puts each batch of a DataLoader on the device
ahead of use, copied (or decoded) and transformed on a CUDA stream of its own, so that input
copies hide behind compute.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mgpu.data.batches import Transform, tensors, to_device, transform_inputs
from mgpu.telemetry.timing import DataWait

# Epochs still running, so that interpreter exit can end them first (below).
_LIVE_EPOCHS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _end_live_epochs() -> None:
    """Exit-time rule: end the epochs a program left running (its `finally` joins the copy
    thread and shuts the DataLoader down) while the interpreter is whole. Left to the
    interpreter's teardown, a daemon copy thread inside a torch call that tries to take the
    GIL back is killed mid-call, which aborts the process ("terminate called without an active
    exception") after its work is done."""
    for epoch in list(_LIVE_EPOCHS):
        epoch.close()


_END = object()  # the end of an epoch, as the copy thread reports it
STOP_POLL_S = 0.05  # how often a waiting copy thread looks for a stop request


def _end_source(source: Iterator[Any] | None, loader: DataLoader) -> None:
    """Stop the workers of an epoch's DataLoader iterator that owns them (not persistent) now.

    Left to garbage collection, an iterator that a worker's exception still references (through
    its traceback) stops its workers only when the cycle is collected, and then takes seconds
    per worker. _shutdown_workers is what the iterator's own __del__ and StopIteration call.
    """
    if source is not None and source is not getattr(loader, "_iterator", None):
        shutdown = getattr(source, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class _InFlight(NamedTuple):
    batch: Any  # on the device, transformed; written on the side stream
    host: Any  # the (pinned) host batch it was copied from; held until `ready` is done
    ready: torch.cuda.Event | None  # recorded on the side stream after the copy and transform


class DeviceLoader:
    """A DataLoader's batches on `device`, copied `depth` batches ahead of use.

    Iterate it like the DataLoader, one iteration at a time (an epoch, or the endless stream
    of a training loader whose sampler streams: mgpu.data.sampler's stream_batch); len(),
    set_epoch(), .sampler and .dataset pass through. On CUDA each batch is copied from pinned
    memory with non_blocking=True on the loader's one side stream, `transform` runs there after
    the copy (so images cross PCIe as uint8), and the consumer's current stream waits for that
    batch on the GPU just before it is handed over. On CPU batches pass straight through (plus
    `transform`): no streams, no copies, no buffering.

    Copies are issued inline, from the consumer's thread, between handing over one batch and
    the next; with `copy_thread=True` a background thread issues them instead. Inline is the
    default because it is simpler and, by design, should not be slower: both only enqueue async
    work (the DMA itself runs on the GPU's copy engine either way), the fetch from the
    DataLoader is a queue read that its pin-memory thread has usually filled already, and a
    Python thread competes with the training loop for the GIL. bench/input_pipeline.py measures
    both, (d) and (e); the thread becomes the default only if it wins by more than the spread.

    `decode`, if given, turns a host batch into a device batch (mgpu.data.gpu_decode) on the
    side stream, before `transform`; it replaces the copy for the batches it returns.
    `after_batch`, if given, is called with the batches handed over so far in the iteration,
    after each one (mgpu.data.decode_switch).

    `wait` (metrics.DataWait) gathers the time the consumer waited for data, without a sync.
    close() (or `with`) ends the running epoch and stops the DataLoader's workers.

    The rules, each kept where its comment names it: one side stream for the loader's life; the
    consumer's stream waits for a batch on the GPU, never the host; handed-over tensors are
    record_stream'ed to the consumer; a pinned host batch is held until its copy is done. The
    only host sync is in close(); nothing in iteration waits for the GPU.
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device | str,
        *,
        depth: int = 2,
        transform: Transform | None = None,
        memory_format: torch.memory_format | None = None,
        copy_thread: bool = False,
        decode: Callable[[Any], Any] | None = None,
        after_batch: Callable[[int], None] | None = None,
    ):
        if depth < 1:
            raise ValueError(f"depth={depth}: prefetch at least one batch ahead, e.g. depth=2")
        device = torch.device(device)
        if decode is not None and device.type != "cuda":
            raise ValueError(f"a decode step runs on a CUDA device, not on {device}")
        if device.type == "cuda" and device.index is None:
            # Name the GPU: a copy thread's current device is its own, not this thread's.
            device = torch.device("cuda", torch.cuda.current_device())
        self.loader, self.device, self.depth = loader, device, depth
        self.transform, self.copy_thread, self.decode = transform, copy_thread, decode
        # Called with the count of batches handed over in the iteration, after each (the
        # training set's mgpu.data.decode_switch), in the consumer's thread.
        self.after_batch, self._handed = after_batch, 0
        # The layout 4-D inputs leave in (channels_last for models that want it, as
        # build_run and the Trainer's own prefetcher ask), converted on the side stream too.
        self.memory_format = memory_format
        self.cuda = self.device.type == "cuda"
        # Stream-lifetime rule: one side stream for the loader's whole life, reused by every
        # epoch; a stream per epoch would pile up.
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.wait = DataWait()
        # Pinned-buffer rule: (copy event, host batch) of each batch whose copy may still be
        # running; the host batch is released only once its event is done.
        self._retired: deque[tuple[torch.cuda.Event, Any]] = deque()
        self._running: weakref.ref | None = None  # the epoch being iterated, if any

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    @property
    def sampler(self) -> Sampler:
        return self.loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Pass the epoch (and a resumed run's consumed prefix) to the sampler, for a new
        shuffle; call before iterating the epoch."""
        set_epoch = getattr(self.loader.sampler, "set_epoch", None)
        if set_epoch is None:
            raise AttributeError(f"{type(self.loader.sampler).__name__} has no set_epoch")
        if consumed:
            set_epoch(epoch, consumed)
        else:
            set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        # One epoch at a time: a persistent DataLoader has one pool of workers to feed it.
        self._end_running()
        self._handed = 0
        if self.copy_thread:
            epoch = self._thread_epoch()
        elif self.cuda:
            epoch = self._inline_epoch()
        else:
            epoch = self._host_epoch()
        # Weak: a consumer that breaks out of its loop drops the last reference, and the epoch's
        # `finally` runs at once (in-flight batches retired, the copy thread joined).
        self._running = weakref.ref(epoch)
        _LIVE_EPOCHS.add(epoch)
        return epoch

    def close(self) -> None:
        """End the running epoch, wait for copies in flight, and stop the DataLoader's workers.

        Not for the hot loop: it waits for the GPU's copies (a sync point) and joins processes.
        """
        self._end_running()
        while self._retired:
            ready, _ = self._retired.popleft()
            ready.synchronize()  # sync point: close only
        # DataLoader has no public close; its persistent iterator's _shutdown_workers is what
        # that iterator's own __del__ calls.
        persistent = getattr(self.loader, "_iterator", None)
        if persistent is not None:
            persistent._shutdown_workers()
            self.loader._iterator = None

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _end_running(self) -> None:
        epoch = self._running() if self._running is not None else None
        if epoch is not None:
            epoch.close()
        self._running = None

    def _start_epoch(self) -> None:
        if self.cuda:
            # Whatever the consumer queued before this iteration (a transform's device
            # constants, tensors moved at setup) is done before the side stream reads it. A
            # GPU-side wait, once per iteration; after it the side stream reads only what it
            # wrote.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _issue(self, host: Any) -> _InFlight:
        """Start one batch on its way: copy and transform on the side stream, then mark it."""
        batch = host
        if not self.cuda:
            return _InFlight(self._transformed(batch), None, None)
        with torch.cuda.stream(self.stream):
            # From pinned memory, non_blocking is an async DMA the host does not wait for. The
            # device tensors come from the side stream's pool; _hand_over guards their reuse.
            batch = self.decode(host) if self.decode is not None else host
            batch = self._transformed(to_device(batch, self.device))
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return _InFlight(batch, host, ready)

    def _transformed(self, batch: Any) -> Any:
        if self.transform is None and self.memory_format is None:
            return batch
        return transform_inputs(batch, self._prepare_inputs)

    def _prepare_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        # Layout first: on uint8 images the reorder moves a quarter of the bytes it would move
        # after the transform, and the elementwise transform keeps the layout.
        if self.memory_format is not None and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=self.memory_format)
        if self.transform is not None:
            inputs = self.transform(inputs)
        return inputs

    def _requested(self) -> tuple[float, torch.cuda.Event | None]:
        """Mark the consumer asking for a batch: host time, and on a GPU an event on its stream
        that completes once the work it queued so far is done (metrics.DataWait)."""
        if not self.cuda:
            return time.perf_counter(), None
        requested = torch.cuda.Event(enable_timing=True)
        requested.record(torch.cuda.current_stream(self.device))
        return time.perf_counter(), requested

    def _hand_over(self, item: _InFlight, request: tuple[float, torch.cuda.Event | None]) -> Any:
        """Make the consumer's stream wait for `item`, then give it out."""
        start, requested = request
        self._handed += 1
        if not self.cuda:
            self.wait.add(time.perf_counter() - start, None)
            self._after_batch()
            return item.batch
        consumer = torch.cuda.current_stream(self.device)
        # The consumer's stream, not the host, waits for this batch's copy, and only from here:
        # the work it queued earlier runs on undelayed. No host sync.
        consumer.wait_event(item.ready)
        ready = torch.cuda.Event(enable_timing=True)
        ready.record(consumer)
        # Stream-lifetime rule: these tensors were allocated on the side stream. Without this,
        # the caching allocator could give their memory to the next copy as soon as the
        # consumer drops them, while the consumer's kernels that read them are still queued.
        for t in tensors(item.batch):
            t.record_stream(consumer)
        self._retire(item)
        self.wait.add(time.perf_counter() - start, (requested, ready))
        self._after_batch()
        return item.batch

    def _after_batch(self) -> None:
        # After the data wait is counted: what after_batch takes is not the data's time.
        if self.after_batch is not None:
            self.after_batch(self._handed)

    def _retire(self, *items: _InFlight) -> None:
        """Hold the host batches of `items` until their copies are done (the pinned-buffer rule;
        torch's pinned allocator also guards its own blocks, but not memory pinned elsewhere)."""
        self._retired.extend((i.ready, i.host) for i in items if i.ready is not None)
        while self._retired and self._retired[0][0].query():  # query() does not wait
            self._retired.popleft()

    def _host_epoch(self) -> Iterator[Any]:
        """CPU: the DataLoader's batches (plus transform) as they come, timed; nothing else."""
        source = iter(self.loader)
        try:
            while True:
                request = self._requested()
                host = next(source, _END)
                if host is _END:
                    return
                yield self._hand_over(self._issue(host), request)
        finally:
            _end_source(source, self.loader)

    def _inline_epoch(self) -> Iterator[Any]:
        """CUDA, copies issued from the consumer's thread: while the consumer works on one
        batch, the next `depth` are in flight."""
        self._start_epoch()
        source: Iterator[Any] | None = iter(self.loader)
        pending: deque[_InFlight] = deque()
        try:
            while True:
                request = self._requested()
                # The batch that goes out next plus `depth` more stay issued. The host blocks
                # here when the workers fall behind (counted as data wait).
                source = self._fill(source, pending, self.depth + 1)
                if not pending:
                    return
                yield self._hand_over(pending.popleft(), request)
        finally:
            # The end, an early break or an error: batches copied but never handed over keep
            # their pinned source until their copies are done.
            self._retire(*pending)
            _end_source(source, self.loader)

    def _fill(self, source: Iterator[Any] | None, pending: deque, n: int) -> Iterator[Any] | None:
        """Issue batches until `n` are pending; the source, or None once it is exhausted."""
        while source is not None and len(pending) < n:
            host = next(source, _END)
            if host is _END:
                return None
            pending.append(self._issue(host))
        return source

    def _thread_epoch(self) -> Iterator[Any]:
        """Copies issued from a background thread, which keeps at most `depth` batches issued
        ahead (a semaphore) and hands them, the epoch's end or its error over through a queue."""
        self._start_epoch()
        source = iter(self.loader)
        ready: queue.SimpleQueue = queue.SimpleQueue()
        slots, stop = threading.Semaphore(self.depth), threading.Event()
        producer = threading.Thread(
            target=self._produce, args=(source, ready, slots, stop), name="mgpu-copy", daemon=True
        )
        producer.start()
        try:
            while True:
                request = self._requested()
                item = self._next_ready(ready, producer)
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item  # a worker's error keeps its message and original traceback
                batch = self._hand_over(item, request)
                slots.release()
                yield batch
        finally:
            stop.set()
            producer.join()  # it wakes within STOP_POLL_S, or once the batch it fetches comes
            while not ready.empty():
                item = ready.get_nowait()
                if isinstance(item, _InFlight):
                    self._retire(item)
            _end_source(source, self.loader)

    def _produce(self, source, ready: queue.SimpleQueue, slots, stop: threading.Event) -> None:
        """The copy thread: fetch, issue, hand over; never lets an error die with the thread."""
        try:
            # The current device is per thread: this one must name it.
            with torch.cuda.device(self.device) if self.cuda else nullcontext():
                while self._acquire(slots, stop):
                    host = next(source, _END)
                    if host is _END:
                        break
                    ready.put(self._issue(host))
            ready.put(_END)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, who raises it
            ready.put(err)

    @staticmethod
    def _acquire(slots: threading.Semaphore, stop: threading.Event) -> bool:
        while not stop.is_set():
            if slots.acquire(timeout=STOP_POLL_S):
                return not stop.is_set()
        return False

    @staticmethod
    def _next_ready(ready: queue.SimpleQueue, producer: threading.Thread) -> Any:
        while True:
            try:
                return ready.get(timeout=1.0)
            except queue.Empty:
                if not producer.is_alive() and ready.empty():
                    raise RuntimeError("the copy thread ended without a word") from None
