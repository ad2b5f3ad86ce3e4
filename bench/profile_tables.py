"""GPU profiles of training steps for bench/engines.py: torch.profiler over a few of a
Trainer's steps, then GPU time per kernel (`--kernels`) and where the GPU sits idle (`--idle`).
"""

from __future__ import annotations

import itertools

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from mgpu.train.trainer import Trainer


def profiled(trainer: Trainer, batch, steps: int, warmup: int = 2):
    """torch.profiler (CUDA activity) over `steps` training steps. Tracing starts `warmup` steps
    before the recorded ones: a profiler starts at a different moment on each rank, and an NCCL
    kernel would count that difference as its own time. The recorded window opens on an empty
    queue with the ranks together (the host is otherwise a step ahead, and the queued step's
    kernels would fall into the window), and closes once its last kernel has run."""
    plan = schedule(wait=0, warmup=warmup, active=steps, repeat=1)  # one cycle: kept after
    batches = itertools.repeat(batch)  # as many as the steps' micro-batches take
    with profile(activities=[ProfilerActivity.CUDA], schedule=plan) as prof:
        for i in range(warmup + steps):
            trainer.train_step(batches)
            if i == warmup - 1:
                torch.cuda.synchronize()
                torch.distributed.barrier()
                torch.cuda.synchronize()  # the barrier's own kernel stays out of the window
            if i == warmup + steps - 1:
                torch.cuda.synchronize()
            prof.step()
    return prof


# Groups of kernels, by name (lower case). Inductor's own kernels first: its matrix-multiply
# templates (triton_tem_*) are matrix multiplies, and its fused elementwise and reduction
# kernels (triton_poi/red/per: LayerNorm, GELU, casts, fp8 scaling, the logits' softmax) take
# the names of the ops they fuse, which may say "attention" or "softmax". The attention
# kernels' template arguments name cutlass types, so attention comes before the matrix
# multiplies among the rest.
HEAD_LOSS_WORDS = ("loss_grad_rows", "cross_entropy", "log_softmax", "nll_loss")
KERNEL_GROUPS = (
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "scaled_mm", "s16816")),
    ("head_loss", HEAD_LOSS_WORDS),
    ("optimizer", ("adam", "multi_tensor")),
    ("copy_memset", ("memcpy", "memset")),
    ("nccl", ("nccl",)),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_tem"):
        return "matmul"
    if low.startswith("triton_"):  # inductor's fused kernels: the logits' loss, or the rest
        return "head_loss" if any(w in low for w in HEAD_LOSS_WORDS) else "inductor_fused"
    for group, needles in KERNEL_GROUPS:
        if any(n in low for n in needles):
            return group
    return "other"


def table_of(prof, steps: int, top: int, width: int = 120) -> dict:
    """GPU time per step by kernel (and copy/memset) and by group (KERNEL_GROUPS), from a
    torch.profiler profile of the GPU's activity over `steps` steps. Kernels on different
    streams can run at once, so the total is GPU work, not step time."""
    rows = [
        (e.key, e.self_device_time_total / steps / 1e3, e.count / steps)
        for e in prof.key_averages()
        # kernels, copies and memsets; an op or annotation around them would count them twice
        if e.self_device_time_total > 0 and not e.key.startswith(("aten::", "Optimizer."))
    ]
    rows.sort(key=lambda r: -r[1])
    groups: dict[str, float] = {}
    for key, ms, _ in rows:
        group = kernel_group(key)
        groups[group] = groups.get(group, 0.0) + ms
    return {
        "gpu_work_ms": sum(ms for _, ms, _ in rows),
        "kernels_per_step": sum(n for _, _, n in rows),
        "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "top": [{"kernel": k[:width], "ms": ms, "calls": n} for k, ms, n in rows[:top]],
    }


def kernel_table(trainer: Trainer, batch, steps: int = 3, top: int = 25) -> dict:
    """GPU time per step by kernel and by group, from torch.profiler over `steps` steps taken
    after the timed rounds: what an engine adds to the GPU's work (table_of)."""
    return table_of(profiled(trainer, batch, steps), steps, top)


def idle_table(trainer: Trainer, batch, steps: int = 3, top: int = 12) -> dict:
    """Where the GPU sits idle: from torch.profiler over `steps` steps (after the timed rounds),
    every moment between the first and the last kernel when no kernel, copy or memset runs on
    any stream of this GPU, per step, with the gaps grouped by the kernels around them (the one
    that ended before, the one that started after). A gap before a forward's first kernel is
    the host launching late. An NCCL kernel that waits for another rank counts as busy: its
    wait shows as its length in --kernels, not here."""
    prof = profiled(trainer, batch, steps)
    spans = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0
    )
    every = gaps(spans, steps, top)
    # The compute stream (the busiest): its own gaps are waits on the host, on another stream
    # (the reducer's) or on a collective of its own, whatever else the GPU is doing meanwhile.
    busiest = max(every["busy_ms_by_stream"], key=every["busy_ms_by_stream"].get, default=None)
    compute = gaps([s for s in spans if str(s[2]) == busiest], steps, top)
    return {
        **every,
        "compute_stream": busiest,
        "compute_idle_ms": compute["idle_ms"],
        "compute_gaps": compute["gaps"],
        "steps": steps,
    }


def gaps(spans: list[tuple[int, int, int, str]], steps: int, top: int) -> dict:
    """GPU idle time from (start_ns, end_ns, stream, name) spans sorted by start: per step, by
    stream (busy time), and the largest groups of gaps keyed by the kernels around them."""
    busy: dict[int, float] = {}
    groups: dict[tuple[str, str], list[float]] = {}
    idle_ns, reach, last = 0, None, ""
    for start, end, stream, name in spans:
        busy[stream] = busy.get(stream, 0) + (end - start) / 1e6 / steps
        if reach is not None and start > reach:
            idle_ns += start - reach
            groups.setdefault((last[:70], name[:70]), []).append((start - reach) / 1e6)
        if reach is None or end > reach:
            reach, last = end, name
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    return {
        "idle_ms": idle_ns / 1e6 / steps,
        "span_ms": (reach - spans[0][0]) / 1e6 / steps if spans else 0.0,
        "busy_ms_by_stream": {str(k): v for k, v in sorted(busy.items())},
        "gaps": [
            {"after": a, "before": b, "ms": sum(v) / steps, "count": len(v) / steps}
            for (a, b), v in rows[:top]
        ],
    }
