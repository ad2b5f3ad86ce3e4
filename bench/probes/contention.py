"""Does an all-reduce that overlaps compute slow the compute less when NCCL reads its buffers
through a registered window (symmetric memory, NCCL 2.27+) or runs on fewer SMs? #39's bound on
GPT-2-small and ResNet-50 compiled: overlapped with backward, the gradient all-reduce slows
backward's kernels by about what it hides.

    torchrun --nproc_per_node=4 bench/probes/contention.py
    torchrun --nproc_per_node=2 bench/probes/contention.py --quick   # CPU, gloo: checks it

The compute is a loop of bf16 matrix multiplies and a memory-bound multiply-add (backward's two
kinds of kernel), about --compute-ms long on the GPU alone; the communication is --buckets
all-reduces of --bucket-mb MB of fp32 each (GPT-2-small's gradients are five of 100 MB). Each
buffer kind ("how") is timed three ways, over --rounds rounds after a warm-up, every rank
starting together:
  compute   the loop alone, on the compute stream
  comm      the all-reduces alone (launched as the reducer does, waited on at the end)
  overlap   the all-reduces launched, then the loop at once beside them; the loop's own time
            (events on its stream) and the time until both are done
Buffer kinds:
  plain       buffers from torch's caching allocator
  registered  buffers from a pool of NCCL's allocator registered with the communicator
              (ProcessGroupNCCL.mem_allocator, register_mem_pool: NCCL user-buffer registration)
  symmetric   buffers from torch's symmetric memory on its NCCL backend, rendezvoused over the
              group (NCCL's window registration: its symmetric kernels, which use fewer SMs)
  ctas4       plain buffers on a communicator capped at 4 CTAs (dist.nccl_max_ctas=4)
Both buffer kinds reach torch through underscored APIs (ProcessGroup._get_backend,
torch.distributed._symmetric_memory, which torch documents as its symmetric-memory interface):
this probe is where they are tried; mgpu's own code would adopt them only if they pay.
A kind that this torch or NCCL cannot set up is recorded with the error and skipped (it fails
alike on every rank: the same software); on the CPU (gloo) only plain runs. Writes
bench/results/contention-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

from bench.engines import versions  # noqa: E402

HOWS = ["plain", "registered", "symmetric", "ctas4"]
KEPT: list = []  # (backend, pool) behind registered buffers: alive until released below


class Compute:
    """The loop: `iters` of (matmul, then a multiply-add over a large tensor)."""

    def __init__(self, device: torch.device, quick: bool, compute_ms: float):
        n, big = (64, 1 << 16) if quick else (8192, 64 << 20)  # 64M bf16 elements: 128 MB
        dtype = torch.float32 if quick else torch.bfloat16
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.x = torch.randn(big, device=device, dtype=dtype)
        self.iters = 1
        self.device = device
        if device.type == "cuda":  # as many iterations as make compute_ms alone
            self.time(iters=3)  # warm: the first loop pays cuBLAS's set-up, not one iteration
            one = self.time(iters=5) / 5
            self.iters = max(1, round(compute_ms / one))

    def run(self, iters: int | None = None) -> None:
        for _ in range(iters or self.iters):
            torch.mm(self.a, self.b)
            self.x.mul_(0.999).add_(1e-3)

    def time(self, iters: int | None = None) -> float:
        """ms on the GPU's clock (wall on a CPU) of the loop alone."""
        return clocked(self.device, lambda: self.run(iters))


def clocked(device: torch.device, work) -> float:
    """ms from before `work` is queued to when it has run (events on the current stream)."""
    if device.type != "cuda":
        began = time.perf_counter()
        work()
        return (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def buffers(how: str, args, device: torch.device, group) -> tuple[list[torch.Tensor], object]:
    """The buckets to all-reduce for `how`, and what keeps their memory alive (a pool)."""
    numel = int(args.bucket_mb * 2**20) // 4
    if args.quick:
        numel = 1 << 14
    if how in ("plain", "ctas4"):
        return [torch.ones(numel, device=device) for _ in range(args.buckets)], None
    backend = group._get_backend(device)
    if how == "registered":
        pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(pool):
            bufs = [torch.ones(numel, device=device) for _ in range(args.buckets)]
        backend.register_mem_pool(pool)
        return bufs, pool
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.set_backend("NCCL")
    bufs = [symm_mem.empty(numel, dtype=torch.float32, device=device) for _ in range(args.buckets)]
    for b in bufs:
        b.fill_(1.0)
        symm_mem.rendezvous(b, group=group)
    return bufs, None


def group_for(how: str, cuda: bool):
    if how != "ctas4" or not cuda:
        return dist.group.WORLD
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = 4
    return dist.new_group(backend="nccl", pg_options=options)


def launch(bufs: list[torch.Tensor], group) -> list:
    return [dist.all_reduce(b, group=group, async_op=True) for b in bufs]


def overlapped(bufs, group, compute: Compute, cuda: bool, marks: dict) -> None:
    """The all-reduces launched, then the loop at once beside them; `marks` gets the loop's own
    span (its stream's events on a GPU, its wall time on a CPU)."""
    works = launch(bufs, group)
    if cuda:  # the loop's span on its stream, while NCCL's kernels run beside it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        compute.run()
        end.record()
        marks["events"] = (start, end)
    else:
        marks["compute"] = compute.time()
    for w in works:
        w.wait()


def measure(how: str, args, device: torch.device, compute: Compute) -> dict:
    cuda = device.type == "cuda"
    group = group_for(how, cuda)
    bufs, keep = buffers(how, args, device, group)
    for w in launch(bufs, group):  # warm-up: the communicator's connections
        w.wait()
    times: dict[str, list[float]] = {"compute": [], "comm": [], "overlap_compute": []}
    times["overlap_total"] = []
    for _ in range(args.warmup + args.rounds):
        sync(cuda)
        alone = compute.time()
        sync(cuda)
        comm = clocked(device, lambda: [w.wait() for w in launch(bufs, group)])
        sync(cuda)
        marks: dict = {}
        total = clocked(device, partial(overlapped, bufs, group, compute, cuda, marks))
        over = marks["events"][0].elapsed_time(marks["events"][1]) if cuda else marks["compute"]
        for key, ms in (("compute", alone), ("comm", comm), ("overlap_compute", over)):
            times[key].append(ms)
        times["overlap_total"].append(total)
    if keep is not None:
        KEPT.append((group._get_backend(device), keep))
    med = {k: statistics.median(v[args.warmup :]) for k, v in times.items()}
    return {
        "how": how,
        **{f"{k}_ms": round(v, 3) for k, v in med.items()},
        "compute_slowdown": round(med["overlap_compute"] / med["compute"], 4),
        "hidden_ms": round(med["compute"] + med["comm"] - med["overlap_total"], 3),
        "all_ms": {k: [round(x, 3) for x in v] for k, v in times.items()},
    }


def sync(cuda: bool) -> None:
    """Every rank idle and together before a timed part (a sync point: the probe's own)."""
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hows", nargs="+", default=HOWS, choices=HOWS)
    parser.add_argument("--buckets", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=100.0)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="CPU, gloo, tiny sizes")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    compute = Compute(device, args.quick, args.compute_ms)
    rows, skipped = [], {}
    for how in args.hows if cuda else ["plain"]:
        try:
            row = measure(how, args, device, compute)
        except Exception as e:  # a kind this torch or NCCL lacks: recorded, not fatal
            skipped[how] = f"{type(e).__name__}: {e}"[:500]
            print(f"rank {dist.get_rank()}: {how} skipped: {skipped[how]}", flush=True)
            continue
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "all_ms"}), flush=True)
    if dist.get_rank() == 0:
        meta = versions() if cuda else {"device": "cpu", "torch": torch.__version__}
        record = {
            **meta,
            "world_size": dist.get_world_size(),
            "command": " ".join(sys.argv),
            "buckets": args.buckets,
            "bucket_mb": args.bucket_mb,
            "compute_iters": compute.iters,
            "rows": rows,
            "skipped": skipped,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        name = str(meta["device"]).replace(" ", "_")
        path = args.out / f"contention-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(record, indent=1))
        print(f"wrote {path}")
    release()
    dist.destroy_process_group()


def release() -> None:
    """Deregister and free the registered pools while their communicator is alive: a pool freed
    at exit, after the process group is gone, aborts in NCCL's deregistration."""
    if KEPT:
        torch.cuda.synchronize()  # no all-reduce still reading a buffer of theirs
    while KEPT:
        backend, pool = KEPT.pop()
        backend.deregister_mem_pool(pool)
        del pool


if __name__ == "__main__":
    main()
