"""mgpu's gradient reducer: keeps gradients in flat buckets (their layout is mgpu.comm.buckets') and
all-reduces each bucket on a communication stream as soon as backward has produced it.

Stream rules (CUDA), in the order they happen in one optimizer step:
1. A bucket is complete when the post-accumulate-grad hooks of all its parameters have fired.
   An event recorded then on the compute stream is waited on by the communication stream, so
   the all-reduce reads finished gradients; buckets launch in a fixed index order on every rank,
   because NCCL needs every rank to issue collectives in the same order.
2. At the end of backward (an autograd final callback), the compute stream waits on the
   communication stream. Clipping and the optimizer, queued later on the compute stream, see
   reduced gradients, and the next backward cannot write into a bucket still being reduced.
3. The buckets are allocated once and never freed while training, so the caching allocator
   never hands their memory to anyone else mid-flight. A bucket of one parameter has no memory
   of its own: the all-reduce reads and writes that parameter's .grad, which autograd made on
   the compute stream. It stays .grad until the optimizer clears it, and the optimizer runs
   after the wait of rule 2, so its memory, too, is reused only after the reduction is done.

Not supported: reentrant activation checkpointing (use_reentrant=True) runs an inner backward
whose end the reducer would take for the step's; use use_reentrant=False, as GPT's
model.activation_checkpointing does (each parameter's hook fires once, as without it). Buffers
(BatchNorm statistics) follow rank 0's: see buckets.FlatBuffers."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as tdist
from torch import nn

from mgpu.comm.buckets import Bucket, FlatBuffers, assign_buckets
from mgpu.comm.groups import comm_group, comm_stream
from mgpu.comm.shard import sharding
from mgpu.config.schema import DistConfig, ReduceDtype
from mgpu.runtime.dist import Runtime
from mgpu.telemetry import stamps
from mgpu.telemetry.profiling import REDUCE, phase

log = logging.getLogger(__name__)


class GradReducer:
    """Averages gradients across ranks, bucket by bucket, overlapped with backward."""

    def __init__(
        self,
        module: nn.Module,
        rt: Runtime,
        cfg: DistConfig,
        *,
        group: tdist.ProcessGroup | None = None,
        in_place: bool = True,
        communicate: bool = True,
    ):
        """Keywords for measuring the reducer (bench/engines.py): `group` to reduce in (default:
        mgpu.comm.groups.comm_group's); `in_place=False` packs every bucket, one of a parameter
        too (Bucket.own); `communicate=False` skips the all-reduce (wrong math: timing only)."""
        self.rt, self.world = rt, rt.world_size
        self.find_unused = cfg.find_unused
        self.reduce_dtype = torch.bfloat16 if cfg.reduce_dtype is ReduceDtype.bf16 else None
        self.cfg = cfg
        self._set_caps(cfg.bucket_cap(large=False))
        # Unique trainable parameters, in registration order: a tied weight is reduced once.
        self.params = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
        self.names = {id(p): n for n, p in module.named_parameters()}
        # Rank 0's buffers into every rank's (none to send in a world of one)
        share = cfg.broadcast_buffers and rt.distributed
        self.buffers = FlatBuffers([b for b in module.buffers() if b.numel() > 0] if share else [])
        self.cuda = rt.device.type == "cuda"
        self.stream = comm_stream(rt, cfg)
        self.op = tdist.ReduceOp.AVG if rt.backend == "nccl" else tdist.ReduceOp.SUM
        self.group = group if group is not None else comm_group(rt, cfg)
        self.communicate = communicate
        self._sync = True
        self.step_done = True  # the last synchronised backward finished: next forward is new
        self.steps_started, self.whole = 0, False  # whole: the model is compiled whole
        # ids of parameters whose .grad is their bucket slice in this step
        self.attached: set[int] = set()
        # The first step's gradient order; None once learned, or never learned under
        # dist.shard_optimizer (a relayout would split the shards apart from a resumed run's).
        self.observed: list[int] | None = None if cfg.shard_optimizer else []
        # (backward end, reduce end) marks per synchronised step (take_exposed); bounded.
        self.exposed: deque = deque(maxlen=10_000)
        self.stamps: stamps.GraphStamps | None = None  # replayed steps' marks (stamp_replays)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # Buckets of one parameter reduced in its own .grad; never under sharding, whose
        # buckets are packed and padded to equal shards.
        self.in_place = in_place and not cfg.shard_optimizer
        # dist.shard_optimizer: buckets packed, padded and reduce-scattered (mgpu.comm.shard)
        self.shards = sharding(cfg, module, rt, self.group, self.stream, self.reduce_dtype)
        # Reverse registration order approximates backward order; the first step checks it.
        self._build(list(reversed(range(len(self.params)))))
        hook = self._on_grad_ready  # the handles kept for remove()
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def capturable(self) -> bool:
        """Whether a CUDA graph can record this reducer's work for every later step (mgpu.train.
        graphs): on a GPU, with the same buckets reduced every step (DistConfig.recordable)."""
        return self.cuda and self.cfg.recordable()

    def use_large_buckets(self, whole: bool = False) -> None:
        """Before the first step: buckets of dist.bucket_cap_mb's large size (bucket_cap) for a
        recorded backward, or one compiled `whole` (models.whole_for_mgpu; later calls keep it)."""
        if self.steps_started:  # the layout is fixed once .grad tensors are bucket slices
            raise RuntimeError("GradReducer.use_large_buckets: call it before the first step")
        self.whole = self.whole or whole
        one_node = self.rt.local_world_size == self.world
        self._set_caps(self.cfg.bucket_cap(True, one_node, self.whole))
        self._build(list(reversed(range(len(self.params)))))

    def _set_caps(self, cap_mb: float) -> None:
        self.cap_bytes = int(cap_mb * 2**20)
        self.first_cap_bytes = min(self.cap_bytes, int(self.cfg.first_bucket_mb * 2**20))

    def take_exposed(self) -> list:
        """The (backward end, communication end) marks of the synchronised steps since the last
        call (CUDA events, or host times on CPU), then the replayed steps' (a StampRange), for
        telemetry (mgpu.telemetry.timing); the reducer forgets them."""
        marks: list = list(self.exposed)
        self.exposed.clear()
        return marks if self.stamps is None else [*marks, self.stamps.snapshot()]

    def stamp_replays(self) -> None:
        """Before a capture records this reducer (mgpu.train.graphs): replays stamp backward's
        end and the end of its wait for the reductions by the GPU's clock, where it can."""
        self.exposed.clear()  # the capture's warm-up steps, not the run's
        self.stamps = self.stamps or stamps.build(self.rt.device)

    def remove(self) -> None:
        """Take this reducer off its parameters: no hook of it runs in a later backward. Before
        wrapping the same module again (two reducers would both act on every gradient), or to
        free a wrapped model without a garbage collection (hooks and parameters refer to each
        other). The parameters' gradients stay as they are."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _build(self, order: list[int]) -> None:
        ordered = [self.params[i] for i in order]
        groups = assign_buckets(ordered, self.cap_bytes, self.first_cap_bytes)
        wire, pad = (self.reduce_dtype, 1) if self.shards is None else (None, self.world)
        self.buckets = [Bucket(i, g, wire, self.in_place, pad) for i, g in enumerate(groups)]
        if self.shards is not None:
            self.shards.build(self.buckets)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.slot = {id(p): i for b in self.buckets for i, p in enumerate(b.params)}
        self.next_launch = 0
        self.callback_queued = False
        self.ready: set[int] = set()  # ids of parameters whose gradient is final this step

    def prepare(self) -> None:
        """Before a forward: start a new step if the last synchronised backward finished. If
        the optimizer cleared the gradients (zero_grad(set_to_none=True)), each parameter's
        first gradient of the step is copied into its slice when its bucket launches (_flush);
        gradients zeroed in place stay attached, and gradients left alone keep accumulating,
        as they would without data parallelism."""
        if self.callback_queued:
            self._recover()  # the last backward raised before its final callback ran
        if not self.step_done:
            return
        self.step_done = False
        self.steps_started += 1
        if self.steps_started == 2 and self.observed is not None:
            self._learn_order()  # every rank at the same step: it broadcasts
        cleared = [p.grad is None for p in self.params]
        if any(cleared):
            if not all(cleared):
                raise RuntimeError(
                    "dist.engine=mgpu: some parameters' .grad were set to None and others kept; "
                    "clear all of them (optimizer.zero_grad()) or none"
                )
            self.attached.clear()
        elif not all(b.is_attached() for b in self.buckets):
            raise RuntimeError(
                "dist.engine=mgpu: .grad tensors were replaced by new ones, so they are no "
                "longer views into the reducer's buckets; clear them with optimizer.zero_grad()"
            )
        else:
            self.attached = set(self.bucket_of)

    def _flush(self, bucket: Bucket) -> None:
        """Copy the bucket's fresh gradients of this step into their slices, all in one
        multi-tensor copy, and make the slices their .grad; on the current stream, the one that
        produced them (the compute stream), before anything reads the bucket. A parameter with
        no gradient (unused, under find_unused) gets a zeroed slice: it contributes zeros. A
        bucket of its own (Bucket.own) keeps its fresh gradient as it is (zeros if none came).
        One copy (autograd's fresh gradient read and written once) rather than zeroed buckets
        accumulated into (twice each); one per bucket keeps the host's work small (ResNet-50:
        161 parameters, a handful of buckets). Later micro-steps accumulate in place."""
        if not bucket.arrived:
            return
        if bucket.own:  # its gradient is reduced where autograd put it
            (p,) = bucket.arrived
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.attached.add(id(p))
            bucket.arrived.clear()
            return
        slot, views = self.slot, bucket.views
        fresh = [p for p in bucket.arrived if p.grad is not None]
        if fresh:
            torch._foreach_copy_([views[slot[id(p)]] for p in fresh], [p.grad for p in fresh])
        for p in bucket.arrived:
            if p.grad is None:
                views[slot[id(p)]].zero_()
            p.grad = views[slot[id(p)]]
            self.attached.add(id(p))
        bucket.arrived.clear()

    def _recover(self) -> None:
        """After an exception inside backward (autograd dropped the final callback): finish what
        was launched and start clean. Ranks stay in step only if all failed at the same point."""
        log.warning("mgpu reducer: the previous backward did not finish; resetting its state")
        self._wait_launched()
        for b in self.buckets:  # every .grad a slice again, as a finished backward leaves them
            b.arrived = [p for p in b.params if id(p) not in self.attached]
            self._flush(b)
        self._reset()
        self.callback_queued = False
        self.step_done = True

    def _learn_order(self) -> None:
        """Rebuild the buckets once in the order the first backward produced gradients: rank
        0's everywhere (the launch order must be identical on all ranks). Every rank takes part
        in the broadcast, whatever it saw (an unused branch, with find_unused); -1: incomplete."""
        n = len(self.params)
        observed = torch.full((n,), -1, dtype=torch.int64)
        if len(self.observed) == n:
            observed = torch.tensor(self.observed, dtype=torch.int64)
        self.observed = None
        if self.rt.distributed:
            observed = observed.to(self.rt.device)
            tdist.broadcast(observed, src=0, group=self.group)
        order = observed.tolist()  # sync point: once, at the start of the second step
        if -1 in order or sorted(order) != list(range(n)):
            return  # rank 0 saw an incomplete step: keep the assumed order
        if order != list(reversed(range(n))):
            log.info(
                "mgpu reducer: rebuilding %d buckets in observed gradient order", len(self.buckets)
            )
            self._build(order)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside (accumulation's micro-steps) add into the buckets, not reducing."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: runs in the autograd thread once p.grad is final. Host
        time here is paid per parameter per backward: bookkeeping only, no kernel launch."""
        if id(p) not in self.attached:
            self.bucket_of[id(p)].arrived.append(p)  # copied in by _flush
        if self.observed is not None and self._sync:
            self.observed.append(self._index[id(p)])
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if not self._sync:
            return
        self.ready.add(id(p))
        self.bucket_of[id(p)].pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.pending > 0:
                return
            self._launch(bucket)
            self.next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        self._flush(bucket)
        if not self.cuda:
            self._all_reduce(bucket)
            return
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: this bucket's gradients are written
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            self._all_reduce(bucket)

    def _all_reduce(self, bucket: Bucket) -> None:
        if not self.communicate:
            bucket.work = _NO_WORK
            return
        if self.shards is not None:
            bucket.work = self.shards.reduce_scatter(bucket)
            return
        tensor = bucket.tensor()
        if bucket.wire is not None:
            bucket.wire.copy_(tensor)
            tensor = bucket.wire
        if self.op is tdist.ReduceOp.SUM:
            # gloo has no average: divide first, as torch DDP does (a sum of averages cannot
            # overflow). NCCL averages inside its kernel, sparing a pass over the bucket.
            tensor.div_(self.world)
        bucket.work = tdist.all_reduce(tensor, op=self.op, group=self.group, async_op=True)

    def _on_backward_end(self) -> None:
        """Autograd final callback: every hook of this backward has run."""
        self.callback_queued = False
        if not self._sync:
            for b in self.buckets:  # accumulation micro-step: slices hold the gradients now
                self._flush(b)
            return
        missing = [p for p in self.params if id(p) not in self.ready]
        if missing and not self.find_unused:
            names = ", ".join(self.names.get(id(p), "?") for p in missing[:10])
            # Launched reductions still write into the buckets: let them finish first.
            self._wait_launched()
            for b in self.buckets:  # every gradient that came is in its slice, as usual
                self._flush(b)
            self._reset()
            self.step_done = True
            raise RuntimeError(
                f"dist.engine=mgpu: {len(missing)} parameter(s) got no gradient this step: "
                f"{names}. Set dist.find_unused=true to reduce zeros for them, or freeze them "
                "(requires_grad=False)"
            )
        for p in missing:
            if id(p) not in self.attached:  # zeros, copied in before its bucket launches
                self.bucket_of[id(p)].arrived.append(p)
        for b in self.buckets[self.next_launch :]:
            b.pending = 0  # unused parameters contribute their zeros
        self._launch_ready()
        with phase(REDUCE):  # the reductions' share that backward did not hide
            self._finish_reductions()

    def _finish_reductions(self) -> None:
        # A backward that a CUDA graph records (mgpu.train.graphs) keeps these stream rules; no
        # timed event can be recorded into it (the GPU stamps the two points: stamp_replays);
        # it holds the buckets' addresses, so they are never laid out again (observed: none).
        captured = self.cuda and torch.cuda.is_current_stream_capturing()
        stamped = self.stamps if captured else None
        start = torch.cuda.Event(enable_timing=not captured) if self.cuda else time.perf_counter()
        if self.cuda:
            start.record()  # backward compute is done here (compute stream)
            if stamped is not None:
                stamped.begin()
            # The buffers were last written by this step's forwards: read them after this.
            self.stream.wait_event(start)
            with torch.cuda.stream(self.stream):
                self._wait_all()
                self.buffers.broadcast(self.group)
            # The optimizer and the next backward, queued later on the compute stream, run
            # only after every reduction and copy-back has finished.
            torch.cuda.current_stream().wait_stream(self.stream)
            end = None if captured else torch.cuda.Event(enable_timing=True)
            if end is not None:
                end.record()
            elif stamped is not None:
                stamped.end()
        else:
            self._wait_all()
            self.buffers.broadcast(self.group)
            end = time.perf_counter()
        if captured:
            self.observed = None
        else:
            self.exposed.append((start, end))
        self._reset()
        self.step_done = True

    def _wait_launched(self) -> None:
        """Wait for the reductions already launched and order the compute stream after them."""
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)

    def _wait_all(self) -> None:
        for b in self.buckets:
            b.work.wait()  # CUDA: the current (communication) stream waits; no host block
            if b.wire is not None:
                b.tensor().copy_(b.wire)
            b.work = None

    def _reset(self) -> None:
        self.ready.clear()
        for b in self.buckets:
            b.pending = len(b.params)
            b.work = None
        self.next_launch = 0


_NO_WORK = SimpleNamespace(wait=lambda: None)  # a bucket's work when nothing is communicated
