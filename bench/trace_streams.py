"""Where a traced train.py run's GPU time went, stream by stream: what each CUDA stream ran in a
torch.profiler trace (trainer.profile=true), its busy time and its costliest kernels. For
data.decode=gpu, the streams beside the training stream are the decode's (the loader's side
stream with the crops, nvJPEG's with its conversions): their busy time a step is what the
decode takes from the step.

    python bench/trace_streams.py outputs/RUN/profile/rank0/*.pt.trace.json [--steps 5]

bench/real_images.py --trace runs this on a traced run of each pair and keeps the summary.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
from pathlib import Path

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
STALL_MS = 1.0  # a CUDA runtime call this long held its thread (and maybe others): listed
GAP_MS = 0.1  # an idle stretch of the training stream this long is counted as a gap


def stream_summary(path: Path, steps: int, top: int = 8) -> dict:
    """Per stream of the trace at `path`: ops, busy ms a step over `steps` traced steps, and the
    `top` names by time. The stream busiest with other work than NCCL's is taken as the
    training stream ("main"). Beside it: the training stream's idle gaps (each of GAP_MS or
    more), the collectives' kernels, and the host's CUDA runtime calls of STALL_MS or more
    (`at_ms` from the trace's first event)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_WORK and "dur" in e]
    if not work:
        return {"path": str(path), "streams": {}, "note": "no GPU work in the trace"}
    by_stream = collections.defaultdict(list)
    for e in work:
        by_stream[str(e.get("args", {}).get("stream"))].append(e)
    # A rank that waits long in collectives can have an NCCL stream busier than its training
    # stream: NCCL's kernels do not count in choosing it.
    main = max(by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s] if not nccl_kernel(e)))
    start = min(e["ts"] for e in work)
    end = max(e["ts"] + e["dur"] for e in work)
    streams = {}
    for stream, ops in by_stream.items():
        names = collections.defaultdict(lambda: [0, 0.0])
        for e in ops:
            names[e["name"][:90]][0] += 1
            names[e["name"][:90]][1] += e["dur"]
        ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
        streams[stream] = {
            "main": stream == main,
            "ops": len(ops),
            "busy_ms_per_step": sum(e["dur"] for e in ops) / 1e3 / steps,
            "top": [
                {"name": n, "count": c, "ms_per_step": d / 1e3 / steps} for n, (c, d) in ranked
            ],
        }
    side = sum(s["busy_ms_per_step"] for s in streams.values() if not s["main"])
    # A collective's kernel runs from its launch until every rank has joined it and the data has
    # moved: the longest ones (2 a traced step) bound from above how far this rank ran ahead of
    # the last rank to get there.
    nccl = [e["dur"] / 1e3 for e in work if nccl_kernel(e)]
    # The training stream idle between two of its kernels; with the host's long CUDA calls
    # beside it, this says whether the GPU waited on the host (a launch that was itself held:
    # another thread in cudaHostAlloc holds every launch of the process) or on other streams.
    ordered = sorted(by_stream[main], key=lambda e: e["ts"])
    gaps = [(b["ts"] - a["ts"] - a["dur"]) / 1e3 for a, b in itertools.pairwise(ordered)]
    gaps = sorted((g for g in gaps if g >= GAP_MS), reverse=True)
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    origin = min([start, *(e["ts"] for e in calls)])
    stalls = sorted(
        (
            {"name": e["name"], "thread": e.get("tid"), "at_ms": round((e["ts"] - origin) / 1e3, 2),
             "ms": round(e["dur"] / 1e3, 2)}
            for e in calls if e.get("dur", 0) >= STALL_MS * 1e3
        ),
        key=lambda c: -c["ms"],
    )  # fmt: skip
    return {
        "path": str(path),
        "window_ms_per_step": (end - start) / 1e3 / steps,
        "main_busy_ms_per_step": streams[main]["busy_ms_per_step"],
        "side_busy_ms_per_step": side,
        "nccl_ms_per_step": sum(nccl) / steps,
        "nccl_longest_ms": [round(d, 3) for d in sorted(nccl, reverse=True)[: 2 * steps]],
        "main_gaps_ms_per_step": sum(gaps) / steps,
        "main_longest_gaps_ms": [round(g, 3) for g in gaps[: 2 * steps]],
        "host_stalls": stalls[:20],
        "streams": streams,
    }


def nccl_kernel(event: dict) -> bool:
    return event["name"].startswith("ncclDevKernel")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", type=Path, help="a torch.profiler chrome trace (.json or .json.gz)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps the trace holds")
    args = p.parse_args()
    summary = stream_summary(args.trace, args.steps)
    for stream, s in sorted(summary["streams"].items(), key=lambda kv: -kv[1]["busy_ms_per_step"]):
        role = "training" if s["main"] else "beside"
        print(f"stream {stream} ({role}): {s['busy_ms_per_step']:.2f} ms a step, {s['ops']} ops")
        for row in s["top"]:
            print(f"  {row['ms_per_step']:7.3f} ms  x{row['count']:<5d} {row['name']}")


if __name__ == "__main__":
    main()
