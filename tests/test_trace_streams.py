"""bench/trace_streams.py's account of a late launch, and real_images.py keeping each rank's trace:
on traces written here, whose every gap has a known cause."""

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # engines.py imports its bench/ siblings

from bench.real_images import traced_streams  # noqa: E402
from bench.trace_streams import stream_summary  # noqa: E402


def op(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def launch(name, ts, correlation, tid, dur=5):
    return {**op("cuda_runtime", name, ts, dur, correlation=correlation), "tid": tid}


def two_step_trace() -> list[dict]:
    """The training stream (7) runs a 1 ms kernel, idles 2 ms because the host's launch of the next
    op (in the forward) was held in its call, 0.3 ms, until 1.5 ms into the gap; runs it, then
    idles 3 ms waiting for a collective (stream 50) whose kernel ends 0.5 ms before the next op
    starts: that op was launched long before, in the backward, by another thread. A 0.5 ms gap is
    too short to be explained."""
    events = [
        op("kernel", "conv", 0, 1000, stream=7, correlation=1),
        op("gpu_memcpy", "Memcpy DtoD", 3000, 1000, stream=7, correlation=2),
        op("kernel", "ncclDevKernel_AllReduce", 3500, 3000, stream=50, correlation=3),
        op("kernel", "gemm", 7000, 1000, stream=7, correlation=4),
        op("kernel", "relu", 8500, 100, stream=7, correlation=5),
    ]
    events += [
        launch("cudaLaunchKernel", -100, 1, tid=1),
        launch("cudaMemcpyAsync", 2200, 2, 1, 300),
    ]
    events += [launch("cudaGraphLaunch", 1200, 4, tid=2), launch("cudaLaunchKernel", 7100, 5, 1)]
    # the trainer's phases on the host, and the same names' GPU spans (not host time)
    events += [{**op("user_annotation", "mgpu/forward", 2000, 1500), "tid": 1}]
    events += [{**op("user_annotation", "mgpu/backward", 1100, 800), "tid": 1}]
    events += [{**op("user_annotation", "mgpu/forward", 6000, 500), "tid": 1}]
    events += [op("gpu_user_annotation", "mgpu/forward", 3000, 4000)]
    return events


def test_late_launches_say_whether_the_gpu_waited_on_the_host_or_on_a_collective(tmp_path):
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": two_step_trace()}))
    s = stream_summary(path, steps=2)
    late = s["late_launches"]
    assert [row["gap_ms"] for row in late] == [3.0, 2.0]  # longest first; 0.5 ms left out
    on_nccl, on_host = late
    assert on_host["op"] == "Memcpy DtoD" and on_host["thread"] == 1
    assert on_host["late_ms"] == 1.5 and on_host["call_ms"] == 0.3
    assert on_host["phase"] == "mgpu/forward"
    assert "after_nccl_ms" not in on_host
    assert on_nccl["op"] == "gemm" and on_nccl["thread"] == 2 and on_nccl["late_ms"] < 0
    assert on_nccl["phase"] == "mgpu/backward" and on_nccl["after_nccl_ms"] == 0.5
    # host time a step: the two forward annotations and the backward's, not the GPU span
    assert s["host_phases_ms_per_step"] == {"mgpu/backward": 0.4, "mgpu/forward": 1.0}


def test_a_traced_run_keeps_each_ranks_trace(tmp_path):
    run_dir = tmp_path / "b128_traced"
    for rank in (0, 1):
        (run_dir / "profile" / f"rank{rank}").mkdir(parents=True)
        trace = {"traceEvents": two_step_trace(), "rank": rank}
        path = run_dir / "profile" / f"rank{rank}" / f"rank{rank}.1.pt.trace.json"
        path.write_text(json.dumps(trace))
    summary = traced_streams(run_dir, 2, tmp_path / "kept")
    for rank in (0, 1):
        kept = tmp_path / "kept" / f"b128_traced-rank{rank}.json.gz"
        assert summary["ranks"][f"rank{rank}"]["kept"] == str(kept)
        assert json.loads(gzip.open(kept, "rt").read())["rank"] == rank
        assert summary["ranks"][f"rank{rank}"]["late_launches"][1]["late_ms"] == 1.5
