"""Telemetry end to end: a 2-process run on CPU/gloo with one starved loader (rank 1) and one
slow model (rank 0) writes the step breakdown, throughput, MFU, rank spread, goodput, layout,
HParams and profiler traces, and the figures hold together. On 2 GPUs: the exposed
communication figure grows when overlap is taken away."""

import json
import math
import time

import pytest
import torch
from conftest import read_scalars, run_train

from mgpu.telemetry.timing import PARTS

# gpt_tiny's vocabulary and context in one narrow layer: rank 0's 60 ms of sleep must outweigh
# rank 1's own compute, which with gpt_tiny (~150 ms a step on a CPU) a busy machine flipped.
GPT = "vocab_size=256 block_size=64 n_layer=1 n_head=2 n_embd=32".split()
STEPS, LOG_EVERY, BATCH = 24, 4, 16
RUN = [
    f"trainer.max_steps={STEPS}",
    f"trainer.log_every={LOG_EVERY}",
    "trainer.eval_every=12",
    "ckpt.every=12",
    "trainer.peak_tflops=1",  # CPU has no table entry: MFU against 1 TFLOP/s
    "trainer.profile=true",
    "trainer.profile_start=6",
    "trainer.profile_steps=2",
    f"data.batch_size={BATCH}",
    "data.num_workers=0",
    "data=custom",
    "data._target_=tests.faults.SlowTokens",
    "+data.kwargs.rank=1",
    "+data.kwargs.delay_s=0.002",  # x 16 samples: 32 ms per batch on rank 1
    "+data.kwargs.eval_samples=64",
    "model=custom",
    "model._target_=tests.faults.SlowGPT",
    "+model.kwargs.rank=0",
    "+model.kwargs.delay_s=0.06",
    *[f"+model.kwargs.{kv}" for kv in GPT],
]
TAGS = [
    *(f"time/{p}_{unit}" for p in PARTS for unit in ("ms", "pct")),
    "time/step_ms",
    "throughput/samples_per_sec",
    "throughput/tokens_per_sec_per_device",
    "throughput/mfu_pct",
    "throughput/tflops_per_device",
    *(
        f"ranks/{f}_{s}"
        for f in ("step_ms", "data_wait_ms", "compute_ms")
        for s in ("min", "median", "max", "slowest_rank")
    ),  # fmt: skip
    *(f"goodput/{c}_s" for c in ("startup", "training", "eval", "checkpoint", "stall")),
    "goodput/restart_s",
    "goodput/wall_s",
    "goodput/pct",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("telemetry")
    proc = run_train([*RUN, f"hydra.run.dir={tmp / 'run'}"], cwd=tmp, nproc=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return tmp / "run"


def by_step(scalars, tag) -> dict[int, float]:
    return dict(scalars[tag])


def test_every_tag_is_written(run_dir):
    scalars = read_scalars(run_dir)
    missing = [t for t in TAGS if t not in scalars]
    assert not missing, f"missing {missing}; have {sorted(scalars)}"
    assert sorted(by_step(scalars, "time/step_ms")) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))


def test_the_parts_add_up_to_the_step_time(run_dir):
    scalars = read_scalars(run_dir)
    for step, step_ms in scalars["time/step_ms"]:
        parts = [by_step(scalars, f"time/{p}_ms")[step] for p in PARTS]
        assert all(ms >= 0 for ms in parts), (step, parts)
        assert math.isclose(sum(parts), step_ms, rel_tol=0.05), (step, parts, step_ms)
        pcts = sum(by_step(scalars, f"time/{p}_pct")[step] for p in PARTS)
        assert math.isclose(pcts, 100.0, rel_tol=0.05)
    # Rank 0 (whose figures these are) sleeps 60 ms in each forward: compute holds it.
    assert all(ms > 60 for _, ms in scalars["time/compute_ms"])


def test_throughput_times_step_time_is_the_global_batch(run_dir):
    scalars = read_scalars(run_dir)
    rates = by_step(scalars, "throughput/samples_per_sec")
    for step, step_ms in scalars["time/step_ms"]:
        assert math.isclose(rates[step] * step_ms / 1e3, BATCH * 2, rel_tol=1e-4)
    tokens = by_step(scalars, "throughput/tokens_per_sec_per_device")
    mfu = by_step(scalars, "throughput/mfu_pct")
    for step, rate in rates.items():
        assert math.isclose(tokens[step], rate * 64 / 2, rel_tol=1e-4)
        assert 0 < mfu[step] < 100


def test_rank_spread_names_the_starved_loader_and_the_slow_model(run_dir):
    scalars = read_scalars(run_dir)
    assert {v for _, v in scalars["ranks/data_wait_ms_slowest_rank"]} == {1.0}
    assert {v for _, v in scalars["ranks/compute_ms_slowest_rank"]} == {0.0}
    # Both ranks' figures are in it: rank 1 waits ~32 ms per step for data, rank 0 almost none.
    for step, high in scalars["ranks/data_wait_ms_max"]:
        low = by_step(scalars, "ranks/data_wait_ms_min")[step]
        assert high > 20 and low < high / 2, (step, low, high)
    assert sorted(by_step(scalars, "ranks/step_ms_max")) == list(
        range(LOG_EVERY, STEPS + 1, LOG_EVERY)
    )


def test_goodput_parts_add_up_to_wall_time(run_dir):
    record = json.loads((run_dir / "goodput.json").read_text())
    (attempt,) = record["attempts"]
    seconds = attempt["seconds"]
    assert math.isclose(
        sum(seconds.values()), attempt["last_update"] - attempt["started_at"], rel_tol=1e-6
    )
    assert seconds["startup"] > 0 and seconds["training"] > 0
    assert seconds["eval"] > 0 and seconds["checkpoint"] > 0 and seconds["stall"] > 0
    scalars = read_scalars(run_dir)
    wall = scalars["goodput/wall_s"][-1][1]
    parts = ("startup", "training", "eval", "checkpoint", "stall", "restart")
    assert math.isclose(sum(scalars[f"goodput/{c}_s"][-1][1] for c in parts), wall, rel_tol=1e-4)
    pct = scalars["goodput/pct"][-1][1]
    assert math.isclose(pct, 100 * scalars["goodput/training_s"][-1][1] / wall, rel_tol=1e-4)


def test_layout_hparams_and_summary_are_in_the_event_file(run_dir):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (events,) = run_dir.glob("events.out.tfevents.*")
    plugins = {}
    for event in EventFileLoader(str(events)).Load():
        for value in event.summary.value:
            plugins.setdefault(value.metadata.plugin_data.plugin_name, []).append(value.tag)
    assert "custom_scalars" in plugins
    assert "hparams" in plugins
    assert "run/summary" in [t.split("/text_summary")[0] for t in plugins.get("text", [])]


def test_one_profiler_trace_per_rank_with_the_step_phases(run_dir):
    for rank in (0, 1):
        (trace,) = (run_dir / "profile" / f"rank{rank}").glob("*.pt.trace.json")
        names = [e.get("name") for e in json.loads(trace.read_text())["traceEvents"]]
        for phase in ("mgpu/data", "mgpu/forward", "mgpu/backward", "mgpu/optimizer"):
            assert names.count(phase) == 2, (rank, phase, names.count(phase))
        assert names.count("mgpu/reduce") == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_exposed_comm_grows_without_overlap(tmp_path):
    """One bucket holding every gradient can only be reduced after backward: nothing overlaps.

    The steps must be GPU-bound (the engines benchmark's GPT-2 shape, B=16, T=1024) for the
    figure to be communication: in a short step the GPU can wait after backward for a host (its
    own, or the slower rank's launching its half of the all-reduce), and that wait counts as
    exposed too, whatever the buckets. And the all-reduce must take long enough to tell the
    tail of overlapped buckets from the whole: over NVLink between 2 H200s this model's
    gradients all-reduce in about 2 ms (2.08 ms exposed with one bucket, 1.24 ms with 25 MB
    buckets, in one run), so the test takes NCCL off peer-to-peer (about 27 GB/s, the slow-link
    stand-in of bench/scaling.sh), where the whole takes over 10 ms and the tail stays small."""
    env = {
        "NCCL_P2P_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    # Eager (no compile to wait for): the step stays GPU-bound, and the three runs start sooner
    base = ["model=gpt2_small", "data.seq_len=1024", "data.batch_size=16", "data.num_workers=4"]
    base += [
        "trainer.compile=false",
        "trainer.max_steps=30",
        "trainer.log_every=10",
        "trainer.eval_every=0",
        "ckpt.every=0",
    ]
    exposed = {}
    # Launched from Python (timed events), then one bucket replayed as CUDA graphs (the default
    # where a step can be recorded), whose exposed share the GPU stamps itself.
    for name, cap, graphs in (
        ("overlap", 25, False),
        ("none", 100_000, False),
        ("replayed", 100_000, True),
    ):
        run = tmp_path / name
        proc = run_train(
            [
                *base,
                f"dist.bucket_cap_mb={cap}",
                f"dist.first_bucket_mb={cap}",
                f"trainer.cuda_graphs={str(graphs).lower()}",
                f"hydra.run.dir={run}",
            ],  # fmt: skip
            cwd=tmp_path,
            nproc=2,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        scalars = read_scalars(run)
        exposed[name] = scalars["time/exposed_comm_ms"][-1][1]
        last = {t: v[-1][1] for t, v in scalars.items() if t.startswith(("time/", "ranks/"))}
        print(name, {t: round(v, 2) for t, v in sorted(last.items())})
        for step, step_ms in scalars["time/step_ms"]:
            parts = sum(by_step(scalars, f"time/{p}_ms")[step] for p in PARTS)
            assert math.isclose(parts, step_ms, rel_tol=0.05)
        assert "memory/max_allocated_gib" in scalars and "throughput/mfu_pct" in scalars
    print(f"exposed comm ms/step: {exposed}")
    assert exposed["none"] > 2 * exposed["overlap"], exposed
    # Measured, not overlapped: the same one bucket's all-reduce after backward as "none", timed
    # by the GPU's stamps rather than by events
    assert exposed["replayed"] > 2 * exposed["overlap"], exposed
    assert 0.5 * exposed["none"] < exposed["replayed"] < 1.5 * exposed["none"], exposed


def test_breakdown_leaves_exposed_comm_out_where_the_reducer_left_no_marks():
    """Host-time marks (seconds): one step of data 1-2, compute 2-10, optimizer 10-11. A reducer's
    marks take exposed communication out of compute; a reducer that reduced inside replayed CUDA
    graphs leaves none (an empty list), and the figure is left out rather than written as 0."""
    from mgpu.telemetry.timing import Clock, Interval, breakdown

    clock = Clock(torch.device("cpu"))

    def interval(comm):
        return Interval(1, 1, 0.1, None, 0.0, 11.0, comm=comm, marks=[[1.0, 2.0, 10.0, 11.0]])

    hooks = breakdown(interval([(8.0, 10.0)]), clock)
    assert hooks["exposed_comm"] == 2000.0 and hooks["compute"] == 6000.0
    captured = breakdown(interval([]), clock)
    assert "exposed_comm" not in captured and captured["compute"] == 8000.0
    alone = breakdown(interval(None), clock)  # no reducer at all: nothing was communicated
    assert alone["exposed_comm"] == 0.0 and alone["compute"] == 8000.0


def test_replayed_steps_stamps_are_summed_over_the_steps_since_the_last_snapshot():
    """A snapshot of the GPU's stamps ([previous snapshot's counter, counter, ring of (begin,
    end) ns]) read on the host: its steps' spans summed; a ring overrun by more steps than it
    holds counts them at the mean of those it kept; breakdown takes the sum out of compute."""
    from mgpu.telemetry.lagged import HostCopy
    from mgpu.telemetry.stamps import StampRange, span_total_ms
    from mgpu.telemetry.timing import Clock, Interval, breakdown

    def snapshot(since: int, count: int, spans_ns: dict[int, tuple[int, int]], size: int = 4):
        ring = torch.zeros(size, 2, dtype=torch.int64)
        for slot, pair in spans_ns.items():
            ring[slot] = torch.tensor(pair)
        return torch.cat([torch.tensor([since, count]), ring.flatten()])

    spans = {0: (0, 2_000_000), 1: (10, 1_000_010), 2: (5, 3_000_005)}
    assert span_total_ms(snapshot(0, 3, spans)) == (6.0, 3)
    assert span_total_ms(snapshot(2, 3, spans)) == (3.0, 1)  # only the step after the last
    assert span_total_ms(snapshot(3, 3, spans)) == (0.0, 0)
    # 6 steps through a ring of 4: slots 2, 3, 0, 1 hold steps 2-5 (1, 1, 2, 4 ms), 2 are gone
    wrapped = {2: (0, 1_000_000), 3: (0, 1_000_000), 0: (0, 2_000_000), 1: (0, 4_000_000)}
    assert span_total_ms(snapshot(0, 6, wrapped)) == (12.0, 6)

    reading = StampRange(HostCopy(snapshot(0, 2, {0: (0, 1_000_000), 1: (0, 1_000_000)})))
    clock = Clock(torch.device("cpu"))
    marks = [[1.0, 2.0, 10.0, 11.0]] * 2
    iv = Interval(1, 2, 0.1, None, 0.0, 22.0, comm=[reading], marks=marks)
    parts = breakdown(iv, clock)  # 2 steps, 2 ms exposed in all: 1 ms a step
    assert parts["exposed_comm"] == 1.0 and reading.reading() == (2.0, 2)


@pytest.mark.gpu
def test_gpu_stamps_recorded_in_a_graph_time_each_replay():
    """Begin and end stamps around a known wait, captured into a CUDA graph and replayed: the
    reading counts every replay, and each span is the wait as CUDA's timed events see it."""
    from mgpu.telemetry.stamps import GraphStamps

    device = torch.device("cuda", 0)
    stamps = GraphStamps(device)
    square = torch.randn(4096, 4096, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS sets up outside the capture, as torch asks
        product = square @ square
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            stamps.begin()
            for _ in range(8):  # some milliseconds of work
                product = square @ square
            stamps.end()
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    for _ in range(5):
        graph.replay()
    after.record()
    reading = stamps.snapshot()
    torch.cuda.synchronize()
    (stamped, steps), timed = reading.reading(), before.elapsed_time(after)
    assert steps == 5 and product.shape == square.shape
    assert 0.5 * timed < stamped <= timed * 1.01, (stamped, timed)


def test_the_console_eta_counts_from_the_step_reached_not_the_late_interval(caplog):
    """An interval is written a log interval late (its loss is read once the device is past it):
    its console line's eta counts the steps left from the step training has reached. Here the
    line of step 5 of 10, said at step 10, at 200 ms a step: eta 0, not 5 x 200 ms."""
    from pathlib import Path

    from mgpu.runtime.dist import Runtime
    from mgpu.telemetry.board import TensorBoard
    from mgpu.telemetry.metrics import Recorder

    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    board = TensorBoard(Path("."), enabled=False)
    rec = Recorder(rt, board, samples_per_step=1, tokens_per_sample=None, max_steps=10)
    with caplog.at_level("INFO", logger="mgpu.telemetry.metrics"):
        for step in range(1, 11):
            time.sleep(0.2)
            rec.step(torch.tensor(1.0), torch.tensor(False))
            if step % 5 == 0:
                rec.close_interval(step, 1e-3, None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 1 and lines[0].startswith("step 5/10 "), lines
    assert lines[0].endswith("| eta 0:00:00"), lines[0]
