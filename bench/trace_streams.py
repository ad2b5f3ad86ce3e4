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
LATE_GAP_MS = 1.0  # a gap this long is explained: whose launch ended it, and how late it came
PHASE = "mgpu/"  # the trainer's annotations of a step's phases (mgpu.telemetry.profiling)


def stream_summary(path: Path, steps: int, top: int = 8) -> dict:
    """Per stream of the trace at `path`: ops, busy ms a step over `steps` traced steps, and the
    `top` names by time. The stream busiest with other work than NCCL's is taken as the
    training stream ("main"). Beside it: the training stream's idle gaps (each of GAP_MS or
    more), the collectives' kernels, and the host's CUDA runtime calls of STALL_MS or more
    (`at_ms` from the trace's first event). `late_launches` says, for each of the training
    stream's gaps of LATE_GAP_MS or more, what ended it; `host_phases_ms_per_step` is the host
    time of each of the trainer's phases, the room a step leaves its launches."""
    with open_trace(path, "rt") as f:
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
        "late_launches": late_launches(events, ordered, origin, 2 * steps),
        "host_phases_ms_per_step": host_phases(events, steps),
        "streams": streams,
    }


def late_launches(events: list, ordered: list, origin: float, top: int) -> list[dict]:
    """The training stream's `top` longest gaps of LATE_GAP_MS or more, each with the op that
    ended it: the host thread whose CUDA call launched it, `late_ms` from the gap's start to
    that call's return (the op is queued then; over 0: the GPU waited for the host, whose call
    may itself have been held, `call_ms`; 0 or under: the op was queued before the gap began,
    so it waited on another stream, e.g. a collective's kernel ending within the gap,
    `after_nccl_ms` before it started), and the trainer's phase at the call."""
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    calls = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    phases = [e for e in events if host_phase(e)]
    nccl_ends = [e["ts"] + e["dur"] for e in events if e.get("ph") == "X" and nccl_kernel(e)]
    gaps = [(b["ts"] - a["ts"] - a["dur"], a, b) for a, b in itertools.pairwise(ordered)]
    gaps = sorted((g for g in gaps if g[0] >= LATE_GAP_MS * 1e3), key=lambda g: -g[0])[:top]
    rows = []
    for gap, a, b in gaps:
        start = a["ts"] + a["dur"]
        row = {"gap_ms": round(gap / 1e3, 3), "at_ms": round((start - origin) / 1e3, 2)}
        row["op"] = b["name"][:60]
        call = calls.get(b.get("args", {}).get("correlation"))
        if call is not None:
            row.update(thread=call.get("tid"), call=call["name"])
            row["call_ms"] = round(call["dur"] / 1e3, 3)
            row["late_ms"] = round((call["ts"] + call["dur"] - start) / 1e3, 3)
            covering = [p for p in phases if p["ts"] <= call["ts"] <= p["ts"] + p["dur"]]
            row["phase"] = min(covering, key=lambda p: p["dur"])["name"] if covering else None
        ended = [t for t in nccl_ends if start < t <= b["ts"]]
        if ended:
            row["after_nccl_ms"] = round((b["ts"] - max(ended)) / 1e3, 3)
        rows.append(row)
    return rows


def host_phases(events: list, steps: int) -> dict[str, float]:
    """Each trainer phase's host time, ms a traced step (its annotations summed over the trace)."""
    total = collections.defaultdict(float)
    for e in filter(host_phase, events):
        total[e["name"]] += e["dur"] / 1e3 / steps
    return {name: round(ms, 3) for name, ms in sorted(total.items())}


def open_trace(path: Path, mode: str):
    """A chrome trace as torch.profiler writes it (.json) or gzipped (.json.gz)."""
    return (gzip.open if str(path).endswith(".gz") else open)(path, mode)


def host_phase(event: dict) -> bool:
    """A trainer's phase as the host ran it (the trace also holds each one's GPU span)."""
    name, cat = event.get("name", ""), event.get("cat")
    return event.get("ph") == "X" and cat == "user_annotation" and name.startswith(PHASE)


def nccl_kernel(event: dict) -> bool:
    return event.get("name", "").startswith("ncclDevKernel")


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
