"""ResNet-50 trained through train.py on a folder of real-sized images against the same run with
its batches made on the GPU's doorstep, on 1 and on several GPUs of one host, in one job, with the
host's cores limited.

    python bench/real_images.py                       # 1 and 4 GPUs, 3 pairs, 2 image sets
    python bench/real_images.py --gpus 1 --folder DIR --cores 16 --batches 128 --decodes auto cpu
    python bench/real_images.py --quick               # tiny shapes on the CPU (1 and 2 processes)
    python bench/real_images.py --only 16:128 --shards 256   # and from the set prepared once
    python bench/real_images.py --variant keep=data.keep_trainer_cores=true   # and with overrides
    python bench/real_images.py --only 16:128 --trace   # and where each run's GPU time went
    python bench/real_images.py --cpu-shares auto 0 0.3  # the default share (auto) and fixed ones

On a 4-GPU machine: the default's runs (about 12 minutes) with the prepared shards and the
ranks unpinned beside them (dist.cpu_affinity=auto pins a folder's ranks to their own cores), in
three calls of under 10 minutes each (the first, B=128 and B=256, took over 7.5 minutes on 4
H200s: each writes its file as it goes), NVLink multicast off:

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    A=unpinned=dist.cpu_affinity=false
    python bench/real_images.py --gpus 4 --only 16:128 16:256 --variant $A
    python bench/real_images.py --gpus 4 --only 8:128 --variant $A --shards 256
    python bench/real_images.py --gpus 1 --shards 256

The default: --gpus 1 4, the pairs (cores per GPU : batch per GPU) 16:128 16:256 8:128, and two
image sets written side by side (--mixes realistic plain); `--gpus 8` where 8 GPUs are lent.

Each run is `taskset -c <the first G x N CPUs> torchrun --standalone --nproc_per_node=G train.py
...` as a user types it (`python train.py` for G=1; N = --cores, the cores of each GPU; compiled
ResNet-50, bf16, channels_last, SGD, the defaults of experiment=resnet50_folder, B images per GPU),
read back from its own TensorBoard telemetry: the median of throughput/samples_per_sec (every
GPU's images) over the log intervals after --warmup steps, and each rank's data wait (the median
over intervals of the ranks' min, median and max: ranks/data_wait_ms_*). The reference is
experiment=resnet50 on the same G GPUs with the same batch, model and cores: synthetic uint8
images from the workers, which cost them a fraction of a millisecond each (its data wait is
reported beside it), so its rate is the step's own.

The image sets (bench/make_image_folder.py): --mix realistic, 500x375 JPEGs, one in four
portrait, with photo-sized (2400x1800), grayscale and CMYK JPEGs and PNGs among them; --mix
plain, only 500x375 RGB JPEGs. Variants, CPU shares, traces and shards use the first of --mixes.
Also measured (--probes): what one CPU core decodes and crops a second (a worker's loop, in one
process pinned to one core) and what the GPU decodes and crops a second (data.decode=gpu's
batch step, batches of 128).

Writes bench/results/real_images-<device>-<time>.json, rewritten after every run (a call cut off
keeps what it measured; a run that fails is recorded with its error, the others go on, and the
script exits 1 at the end), with a top-level "ratio" object: resnet50_b<B>_<N>cores on one GPU
and resnet50_b<B>_<N>cores_<G>gpu on G (img/s through train.py with data.decode=auto and the
default data.cpu_decode_share=auto over the reference's on as many GPUs); the plain set adds
_plain, the shards _shards, a fixed share _cpu<share>, a variant _<name>. Each folder run records
the share auto chose and the rates it measured (decode_split), and whether the workers then took
every JPEG (decode_move); the file records the host's CPUs and NUMA nodes (which CPUs a job's
first G x N are). A traced run's summary names the training
stream's late launches (bench/trace_streams.py), and each rank's trace is kept gzipped in
traces-<time>/ beside the results file (--out).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.children import exit_on_sigterm, run_child  # noqa: E402
from bench.engines import versions  # noqa: E402
from bench.host_watch import HostWatch  # noqa: E402
from bench.make_image_folder import write_folder  # noqa: E402
from tests.conftest import read_scalars  # noqa: E402


def share_arg(value: str) -> str:
    """--cpu-shares: auto, or a share in [0, 1) as data.cpu_decode_share takes it."""
    if value != "auto" and not 0 <= float(value) < 1:
        raise argparse.ArgumentTypeError(f"{value}: give auto or a share in [0, 1)")
    return value


def train_args(
    kind: str,
    folder: Path,
    batch: int,
    decode: str,
    steps: int,
    every: int,
    share: str | None = None,
):
    common = [
        f"data.batch_size={batch}",
        f"trainer.max_steps={steps}",
        f"trainer.log_every={every}",
        "trainer.eval_every=0",
        "ckpt.every=0",
        "model.num_classes=1000",
    ]
    if kind == "reference":
        return ["experiment=resnet50", *common]
    # shards: the same images prepared once (prepare_images --max-side), folder = its DST
    data = ["data=image_shards"] if kind == "shards" else []
    return [
        "experiment=resnet50_folder",
        *data,
        f"data.path={folder}",
        f"data.decode={decode}",
        *([f"data.cpu_decode_share={share}"] if share is not None else []),  # None: the default
        "data.eval_samples=16",
        *common,
    ]


# Issue 40's table: (cores per GPU, batch per GPU), on every --gpus count
TABLE = [(16, 128), (16, 256), (8, 128)]
MIX_KEY = {"realistic": "", "plain": "_plain", "given": ""}  # a ratio key's suffix per image set


def job_cpus(count: int) -> str:
    """The first `count` CPUs this process may use, as taskset -c takes them (e.g. 0-31)."""
    cpus = sorted(os.sched_getaffinity(0))[:count]
    spans = [[cpus[0], cpus[0]]]
    for cpu in cpus[1:]:
        if cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def host_cpus() -> dict:
    """The CPUs this process may use and the host's NUMA nodes' CPU lists (where a job's first
    G x N CPUs lie against the GPUs' nodes)."""
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*/cpulist"))
    return {
        "allowed": job_cpus(len(os.sched_getaffinity(0))),
        "count": len(os.sched_getaffinity(0)),
        "numa_nodes": {n.parent.name: n.read_text().strip() for n in nodes},
    }


def busy_processes(seconds: float = 1.0, above: float = 0.1) -> dict:
    """The host's load averages and the processes that used more than `above` of a core over
    `seconds` just before a run: what else shared the cores (a run is slower than the one before
    it on the same machine only with a reason, and this is where to look for one)."""

    def cpu_ticks() -> dict[int, tuple[str, int]]:
        ticks = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:  # the process ended between the listing and the read
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            ticks[int(stat.parent.name)] = (name, int(fields[11]) + int(fields[12]))
        return ticks

    first = cpu_ticks()
    time.sleep(seconds)
    second = cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    busy = {
        f"{pid} {name}": round((used - first[pid][1]) / hz / seconds, 2)
        for pid, (name, used) in second.items()
        if pid in first and pid != os.getpid() and (used - first[pid][1]) / hz / seconds > above
    }
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "busy": busy}


class GpuWatch:
    """Each GPU's SM clock, power, temperature and the reasons its clock was held below its
    maximum (nvidia-smi's clocks_event_reasons), five times a second while a run goes, summed up
    over the samples where the GPU was busy (utilization >= 50 %: the steps, not the compile): a
    run slower than its neighbours on the same machine shows here whether its GPUs were held back
    (power, heat) or ran at full clock. Nothing where nvidia-smi is absent (a CPU)."""

    FIELDS = "index,utilization.gpu,clocks.sm,power.draw,temperature.gpu"
    REASONS = "clocks_event_reasons.active"

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        if shutil.which("nvidia-smi") is None:
            return
        # an unknown field fails the whole query: older drivers lack clocks_event_reasons
        known = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True)
        fields = self.FIELDS + (f",{self.REASONS}" if self.REASONS in known.stdout else "")
        query = [f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "200"]
        # a file, not a pipe: a pipe nobody reads fills in a long run and stops the sampling
        self.out = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            ["nvidia-smi", *query], stdout=self.out, stderr=subprocess.DEVNULL, text=True
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()

    def summary(self) -> dict | None:
        """Stops the sampling; per GPU index, over its busy samples: how many, the SM clock's
        median and least (MHz), the median power (W), the highest temperature (C), and the
        clock-event reasons seen (nvidia-smi's bit masks, with how many samples had each)."""
        if self.proc is None:
            return None
        self.stop()
        self.out.seek(0)
        per_gpu: dict[str, list[list[float | str]]] = {}
        for line in self.out.read().splitlines():
            fields = [f.strip() for f in line.split(",")]
            try:
                util, mhz, watts, temp = (float(v) for v in fields[1:5])
            except ValueError:  # "[N/A]" where the GPU does not report one of them; a cut line
                continue
            if util >= 50:
                per_gpu.setdefault(fields[0], []).append([mhz, watts, temp, *fields[5:6]])
        summary = {}
        for gpu, samples in per_gpu.items():
            reasons: dict[str, int] = {}
            for sample in samples:
                if len(sample) > 3:
                    reasons[sample[3]] = reasons.get(sample[3], 0) + 1
            summary[gpu] = {
                "busy_samples": len(samples),
                "sm_mhz_median": statistics.median(s[0] for s in samples),
                "sm_mhz_min": min(s[0] for s in samples),
                "power_w_median": statistics.median(s[1] for s in samples),
                "temp_c_max": max(s[2] for s in samples),
                "clock_event_reasons": reasons,
            }
        return summary


def launcher(gpus: int) -> list[str]:
    """train.py's launch as a user types it: python for one GPU, torchrun with one process a
    GPU for several (over gloo on a CPU)."""
    if gpus == 1:
        return [sys.executable]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"
    ]  # fmt: skip


def run_train(
    args: list[str],
    cores: int,
    gpus: int,
    out: Path,
    timeout: float,
    quick: bool,
    environ: dict[str, str] | None = None,
) -> dict:
    """One train.py run on `gpus` GPUs pinned to the first `cores` x `gpus` CPUs, with
    `environ` added to its environment; its samples/s and data wait."""
    cpus = job_cpus(cores * gpus)
    pin = [] if quick else ["taskset", "-c", cpus]
    launch = launcher(gpus)
    cmd = [*pin, *launch, str(ROOT / "train.py"), *args, f"hydra.run.dir={out}"]
    if quick:
        cmd += ["model=resnet_tiny", "data.image_size=32", "data.num_workers=1"]
        # the reference's closing evaluation too is of 16 images, as the folder's held-out set
        # (its default of 1000 synthetic images took longer than its 6 steps)
        cmd.append("data.eval_samples=16")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(environ or {}),
    }
    start = time.perf_counter()
    # run_child: stopped with this script or at its timeout, torchrun's workers too
    done = run_child(cmd, env=env, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{tail}")
    scalars = read_scalars(out)
    # data.cpu_decode_share=auto's lines: the share it chose and the rates it measured, then
    # whether the workers took every JPEG once the step's pace was known (decode_switch)
    said = done.stdout + done.stderr
    split = [line for line in said.splitlines() if "data.cpu_decode_share=auto:" in line][:2]
    wall = time.perf_counter() - start
    typed = ["python"] if gpus == 1 else ["torchrun", *launch[3:]]
    line = " ".join([*typed, *cmd[len(pin) + len(launch) :]])
    return {"cmd": line, "cpus": "" if quick else cpus, "wall_s": wall, "split": split, **scalars}


# The per-interval series each run keeps (summarise): the step, its data waits (the training
# thread's on the host, the GPU's), its compute, and the slowest rank's step and data wait.
SERIES = (
    "time/step_ms",
    "time/data_host_wait_ms",
    "time/data_wait_ms",
    "time/compute_ms",
    "ranks/step_ms_max",
    "ranks/data_wait_ms_max",
)


def summarise(scalars: dict, warmup: int) -> dict:
    def median(tag: str) -> float | None:
        values = [v for step, v in scalars.get(tag, []) if step > warmup]
        return statistics.median(values) if values else None

    row = {
        "img_per_s": median("throughput/samples_per_sec"),  # every GPU's images
        "img_per_s_per_gpu": median("throughput/samples_per_sec_per_device"),
        "step_ms": median("time/step_ms"),
        "data_wait_pct": median("time/data_wait_pct"),  # rank 0's
        "intervals": len([s for s, _ in scalars.get("throughput/samples_per_sec", [])]),
    }
    # Every rank's data wait (telemetry's rank spread): the rank that waits most paces the rest
    if "ranks/data_wait_ms_max" in scalars:
        ranks = {s: median(f"ranks/data_wait_ms_{s}") for s in ("min", "median", "max")}
        row["rank_data_wait_ms"] = ranks
        if ranks["max"] is not None and row["step_ms"]:
            row["data_wait_pct_worst_rank"] = 100.0 * ranks["max"] / row["step_ms"]
        slowest = [int(v) for s, v in scalars["ranks/data_wait_ms_slowest_rank"] if s > warmup]
        row["data_wait_slowest_rank"] = max(set(slowest), key=slowest.count) if slowest else None
        row["rank_step_ms_max"] = median("ranks/step_ms_max")
    # Where each step's time went, as the run's own telemetry split it (compute, exposed
    # communication, data waits, every rank's spread): a run slower than its neighbours shows
    # in which part
    row["breakdown"] = {
        tag: median(tag) for tag in sorted(scalars) if tag.startswith(("time/", "ranks/"))
    }
    # Each interval's figures over the whole run, its warm-up too: whether a run slower than its
    # neighbours was slow from its start, from some step on, or in bursts (a median hides which)
    row["series"] = {
        tag: [[step, round(value, 3)] for step, value in scalars[tag]]
        for tag in SERIES
        if tag in scalars
    }
    return row


def cpu_decode_rate(folder: Path, n: int) -> float:
    """Images a second one core decodes and crops as a data.decode=cpu worker does."""
    code = (
        "import sys,time; from mgpu.data import ImageFolder;"
        "from mgpu.data.sampler import SampleKey;"
        f"d=ImageFolder('train', r'{folder}', decode='cpu', eval_samples=64);"
        f"keys=[SampleKey(i*7 % len(d), 0, 0) for i in range({n})]; d[keys[0]];"
        "t=time.perf_counter(); [d[k] for k in keys]; print(len(keys)/(time.perf_counter()-t))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env["OMP_NUM_THREADS"] = "1"
    cmd = ["taskset", "-c", "0", sys.executable, "-c", code]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def gpu_decode_rates(folder: Path, batch: int, batches: int) -> dict:
    """Images a second data.decode=gpu's batch step decodes and crops (pinned host bytes in,
    uint8 crops out), the workers' part done beforehand; and torchvision's decode alone, on the
    whole batch's JPEGs in one call and in calls of 64 (does the batch's size cost the decode?)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.gpu_decode_contention import alone, encoded_batches

    device = torch.device("cuda", torch.cuda.current_device())
    step, work = encoded_batches(folder, batch, batches, device)
    stream = torch.cuda.Stream(device)
    rates = {"step_img_per_s": alone(step, work, stream), "jpegs_per_batch": len(work[0].lengths)}
    for chunk in sorted({batch, 64}):

        def decode_only(encoded, chunk=chunk):
            jpegs = encoded.jpegs
            for at in range(0, len(jpegs), chunk):
                decode_jpeg(jpegs[at : at + chunk], mode=ImageReadMode.RGB, device=device)

        # alone() counts every image of a batch; the decode sees only its JPEGs
        jpeg_share = sum(len(w.lengths) for w in work) / (len(work) * len(work[0].labels))
        rates[f"decode_only_calls_of_{chunk}_img_per_s"] = (
            alone(decode_only, work, stream) * jpeg_share
        )
    return rates


def trace_args(args) -> list[str]:
    """train.py overrides that trace args.trace_steps steps after the warm-up."""
    start = args.warmup + args.every if not args.quick else 2
    steps = min(args.trace_steps, args.steps - start)
    return [
        "trainer.profile=true",
        f"trainer.profile_start={start}",
        f"trainer.profile_steps={steps}",
    ]


def traced_streams(run_dir: Path, steps: int, keep_in: Path) -> dict:
    """bench/trace_streams.py's summary of the trace a traced run wrote: rank 0's whole, and
    each rank's step window, training stream and collectives under "ranks" (a rank whose
    collectives take long waits for another; the one whose don't is the one waited for). Each
    rank's trace is kept, gzipped, as `keep_in`/<run>-<rank>.json.gz (the run's own folder is
    temporary)."""
    from bench.trace_streams import open_trace, stream_summary

    ranks = {}
    keep_in.mkdir(parents=True, exist_ok=True)
    for rank_dir in sorted((run_dir / "profile").glob("rank*")):
        found = sorted(rank_dir.glob("*.pt.trace.json*"))
        if found:
            ranks[rank_dir.name] = stream_summary(found[-1], steps)
            kept = keep_in / f"{run_dir.name}-{rank_dir.name}.json.gz"
            with open_trace(found[-1], "rb") as src, gzip.open(kept, "wb") as dst:
                shutil.copyfileobj(src, dst)
            ranks[rank_dir.name]["kept"] = str(kept)
    if "rank0" not in ranks:
        return {"note": f"no trace under {run_dir / 'profile' / 'rank0'}"}
    keep = (
        "window_ms_per_step", "main_busy_ms_per_step", "nccl_ms_per_step", "nccl_longest_ms",
        "main_gaps_ms_per_step", "main_longest_gaps_ms", "host_stalls", "late_launches",
        "host_phases_ms_per_step", "kept",
    )  # fmt: skip
    summary = ranks["rank0"]
    summary["ranks"] = {name: {k: s.get(k) for k in keep} for name, s in ranks.items()}
    return summary


def prepare_shards(folder: Path, dst: Path, max_side: int) -> float:
    """Seconds python -m mgpu.data.prepare_images takes to write `folder` as shards."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "mgpu.data.prepare_images", str(folder), str(dst)]
    start = time.perf_counter()
    subprocess.run([*cmd, "--max-side", str(max_side)], env=env, check=True)
    return time.perf_counter() - start


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--folder", type=Path, help="an image tree to use (default: write --mixes)")
    p.add_argument(
        "--mixes", nargs="+", choices=["realistic", "plain"],
        help="image sets to write and train from, side by side (default: realistic plain; "
        "--quick: realistic)",
    )  # fmt: skip
    p.add_argument("--images", type=int, default=12000)
    p.add_argument(
        "--gpus", type=int, nargs="+",
        help="GPU counts, each run under torchrun with one process a GPU (default: 1 4; "
        "--quick: 1 2 processes over gloo)",
    )  # fmt: skip
    p.add_argument("--cores", type=int, nargs="+", help="cores per GPU (default: the table's)")
    p.add_argument("--batches", type=int, nargs="+", help="batch per GPU (default: the table's)")
    p.add_argument("--decodes", nargs="+", default=["auto"], help="data.decode values to run")
    p.add_argument(
        "--only", nargs="*", default=[],
        help="cores:batch pairs to run, e.g. 8:128 (default: 16:128 16:256 8:128, or every "
        "--cores x --batches)",
    )  # fmt: skip
    p.add_argument(
        "--cpu-shares", type=share_arg, nargs="+", default=["auto"],
        help="data.cpu_decode_share values to run each decode with: auto (the default path's: "
        "measured at start-up) or a share, e.g. 0 0.3",
    )  # fmt: skip
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        metavar="KIND:DECODE[:SHARE]",
        help="runs of the plan left out, e.g. folder:cpu (the full-sized JPEGs on the workers "
        "alone, far below the others wherever the GPU decodes faster) or shards:auto:0.3",
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=60, help="steps left out of the medians")
    p.add_argument("--every", type=int, default=20, help="steps per log interval")
    p.add_argument("--probes", action="store_true", help="also measure decode rates alone")
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
        help="also a folder run (decode=auto) with these train.py overrides, named NAME, e.g. "
        "keep=data.keep_trainer_cores=true or unpinned=dist.cpu_affinity=false; an item "
        "env:VAR=VALUE sets an environment variable of its processes instead, e.g. "
        "reserve=env:PYTORCH_CUDA_ALLOC_CONF=pinned_reserve_segment_size_mb:1024 (items are "
        "split at commas: a value cannot hold one)",
    )  # fmt: skip
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a train.py override for every run of the call, the reference's too, e.g. "
        "--set data.worker_nice=10 (then against the same setting's reference)",
    )
    p.add_argument(
        "--trace", action="store_true",
        help="also a traced run of the reference and of the folder (trainer.profile): each "
        "CUDA stream's busy time a step and costliest kernels (bench/trace_streams.py)",
    )  # fmt: skip
    p.add_argument("--trace-steps", type=int, default=5, help="steps a traced run traces")
    p.add_argument(
        "--shards", type=int, metavar="MAX_SIDE",
        help="also train from the folder prepared once as data=image_shards, images shrunk to "
        "this shorter side (python -m mgpu.data.prepare_images; its time is recorded)",
    )  # fmt: skip
    p.add_argument(
        "--rounds", type=int, default=1,
        help="run each pair's plan this many times in turn (reference, folder, ..., reference, "
        "...): each ratio is the median of its rounds' ratios, each to its own round's "
        "reference (ratio_rounds lists them); single runs on 2 GPUs spread by up to 0.09",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    args.variants = {}  # name -> comma-separated overrides
    for v in args.variant:
        name, _, overrides = v.partition("=")
        if not name or "=" not in overrides or name in args.variants or name == "traced":
            p.error(f"--variant {v}: give NAME=KEY=VALUE[,KEY=VALUE], each NAME once (not traced)")
        for item in overrides.split(","):
            var, equals, _ = item.removeprefix("env:").partition("=")
            if item.startswith("env:") and not (var and equals):
                p.error(f"--variant {v}: {item!r}: give env:VAR=VALUE, VAR not empty")
        args.variants[name] = overrides
    for item in args.set:
        if "=" not in item.strip("="):
            p.error(f"--set {item}: give KEY=VALUE, e.g. --set data.worker_nice=10")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give 1 or more")
    if args.folder and args.mixes:
        p.error("--mixes writes image sets; --folder gives one: not both")
    if args.folder:
        args.mixes = ["given"]
    args.mixes = args.mixes or (["realistic"] if args.quick else ["realistic", "plain"])
    args.gpus = args.gpus or ([1, 2] if args.quick else [1, 4])
    if args.quick:
        args.images, args.cores, args.batches = 60, [1], [8]
        args.steps, args.warmup, args.every = 6, 2, 2
    if args.only:
        args.pairs = [tuple(map(int, x.split(":"))) for x in args.only]
    elif args.cores or args.batches:
        args.pairs = [(c, b) for c in args.cores or [16, 8] for b in args.batches or [128, 256]]
    else:
        args.pairs = TABLE
    if not args.quick:
        gpus, cpus = torch.cuda.device_count(), len(os.sched_getaffinity(0))
        if max(args.gpus) > gpus:
            p.error(f"--gpus {max(args.gpus)}: this machine has {gpus} GPU(s)")
        most = max(args.gpus) * max(c for c, _ in args.pairs)
        if most > cpus:
            p.error(f"{most} CPUs asked for (GPUs x cores per GPU); this process may use {cpus}")
    return args


def plan_of(args, prepared: dict | None) -> list[tuple[str, str, str | None, str, str]]:
    """A pair's runs, reference first: (kind, decode, CPU share, variant, image set). A CPU share
    means something only where the GPU decodes (not under decode=cpu); a variant is the folder
    run with its overrides; the other image sets run the default path only."""
    first, others = args.mixes[0], args.mixes[1:]
    shares = [(d, x) for d in args.decodes for x in args.cpu_shares]
    plan = [("reference", "-", None, "", "")]
    fixed = [(d, x) for d, x in shares if x == "auto" or not (d == "cpu" and float(x))]
    plan += [("folder", d, x, "", first) for d, x in fixed]
    plan += [("folder", "auto", None, "", mix) for mix in others]
    plan += [("folder", "auto", None, name, first) for name in args.variants]  # default share
    # shards at every --decodes and share (decode=cpu: the workers alone decode the shrunk images)
    plan += [("shards", d, x, "", first) for d, x in fixed] if prepared else []
    # traced twins of the reference and the folder run: where each one's GPU time went
    twins = [("reference", "-", None, "traced", ""), ("folder", "auto", None, "traced", first)]
    skip = {tuple(s.split(":")) for s in args.skip}
    return [
        run for run in plan + twins * args.trace
        if (run[0], run[1]) not in skip and (run[0], run[1], run[2]) not in skip
    ]  # fmt: skip


def rounds_of(plan: list[tuple], rounds: int) -> list[tuple]:
    """The plan `rounds` times in turn, each run led by its round; the traced twins in the first
    round only (their rates carry the profiler's cost: no ratio is taken of them)."""
    return [(r, *run) for r in range(rounds) for run in plan if not (r and run[3] == "traced")]


def round_ratios(results: dict) -> dict[tuple, list[float]]:
    """Each run's ratio to the reference of its own round (set on its row as `ratio`), listed by
    (kind, decode, suffix); `results` maps those to {round: row}, the reference's under
    ("reference", "-", "")."""
    references = results.get(("reference", "-", ""), {})
    ratios: dict[tuple, list[float]] = {}
    for run, rounds in results.items():
        if run[0] == "reference":
            continue
        ratios[run] = []
        for rnd, row in rounds.items():
            reference = references.get(rnd, {}).get("img_per_s")
            if reference and row["img_per_s"]:
                row["ratio"] = row["img_per_s"] / reference
                ratios[run].append(row["ratio"])
    return ratios


def main() -> None:
    exit_on_sigterm()  # `timeout`'s SIGTERM ends the runs through run_child's cleanup
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="real_images-"))
    folders, made = {}, {}  # image set -> its folder, and what was written there
    for mix in args.mixes:
        folders[mix] = args.folder if mix == "given" else work / f"images_{mix}"
        if mix != "given":
            classes = min(100, args.images // 4)
            made[mix] = write_folder(folders[mix], args.images, classes, mix=mix)
            print(f"wrote {mix}: {made[mix]}", flush=True)
    folder = folders[args.mixes[0]]  # probes, shards, variants and traces
    probes = {}
    if args.probes and not args.quick:
        probes["cpu_decode_img_per_s_per_core"] = cpu_decode_rate(folder, 300)
        if torch.cuda.is_available():
            probes["gpu_decode_per_gpu"] = {
                f"batch_{b}": gpu_decode_rates(folder, b, max(10, 2560 // b))
                for b in sorted({b for _, b in args.pairs})
            }
        print(json.dumps(probes), flush=True)
    prepared = None
    if args.shards:
        prepared = {"max_side": args.shards, "path": str(work / "shards")}
        prepared["prepare_s"] = prepare_shards(folder, work / "shards", args.shards)
        print(json.dumps(prepared), flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    record = {
        "ratio": {}, "ratio_rounds": {}, "probes": probes, "runs": [], "shards": prepared,
        "gpus": args.gpus,
        "folder": made.get(args.mixes[0], str(folder)), "folders": made, "host_cpus": host_cpus(),
    }  # fmt: skip
    for gpus in args.gpus:
        for cores, batch in args.pairs:
            measure_pair(args, gpus, cores, batch, folders, prepared, work, record, stamp)
    path = save(args.out, record, stamp)
    print("ratio", json.dumps(record["ratio"], indent=1))
    print(f"wrote {path}")
    failed = [r["name"] for r in record["runs"] if "error" in r]
    if failed:
        sys.exit(f"failed (each run's error is in {path}): {', '.join(failed)}")


def measure_pair(args, gpus, cores, batch, folders, prepared, work, record, stamp) -> None:
    """The reference and the folder runs of one (GPUs, cores per GPU, batch per GPU), into
    `record` (its runs and ratios), saved after every run."""
    results: dict = {}  # (kind, decode, suffix) -> {round: its row}
    scale = "" if gpus == 1 else f"_{gpus}gpu"  # one GPU keeps the keys of earlier files
    for rnd, kind, decode, share, variant, mix in rounds_of(plan_of(args, prepared), args.rounds):
        suffix = MIX_KEY.get(mix, "") + ("" if share in (None, "auto") else f"_cpu{share}")
        suffix += f"_{variant}" if variant else ""
        name = f"b{batch}_{cores}cores{scale}_{kind}_{decode}{suffix}"
        name += f"_round{rnd}" if rnd else ""  # the first round keeps earlier files' names
        source = Path(prepared["path"]) if kind == "shards" else folders.get(mix)
        cmd = train_args(kind, source, batch, decode, args.steps, args.every, share) + args.set
        traced = variant == "traced"
        environ = {}
        if traced:
            cmd += trace_args(args)
        elif variant:
            for item in args.variants[variant].split(","):
                if item.startswith("env:"):
                    var, _, value = item.removeprefix("env:").partition("=")
                    environ[var] = value
                else:
                    cmd.append(item)
        row = {"name": name, "gpus": gpus, "cores": cores, "batch": batch, "kind": kind}
        row.update(decode=decode, cpu_decode_share=share, variant=variant, mix=mix or "-")
        row.update(env=environ, round=rnd)
        row.update(before=busy_processes())
        watch, host = GpuWatch(), HostWatch()  # the GPUs, and each rank's threads on the CPUs
        try:
            raw = run_train(cmd, cores, gpus, work / name, args.timeout, args.quick, environ)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # the call's other runs go on
            row["error"] = str(e)[-3000:]
            row.update(gpu_watch=watch.summary(), host_watch=host.summary())
            record["runs"].append(row)
            print(row["error"], flush=True)
            save(args.out, record, stamp)
            continue
        finally:  # no sampler left running past its run (a no-op once summarised)
            watch.stop()
            host.stop()
        row.update(gpu_watch=watch.summary(), host_watch=host.summary())
        row.update(summarise(raw, args.warmup), cmd=raw["cmd"], cpus=raw["cpus"])
        row.update(wall_s=raw["wall_s"])
        said = [line.split("auto: ", 1)[1] for line in raw["split"]]
        row.update(decode_split=said[0] if said else "", decode_move=" ".join(said[1:2]))
        if traced:  # its rates carry the profiler's cost: not a ratio
            kept = args.out / f"traces-{stamp}"
            row["trace"] = traced_streams(work / name, args.trace_steps, kept)
        else:
            results.setdefault((kind, decode, suffix), {})[rnd] = row
        record["runs"].append(row)
        print(json.dumps(row), flush=True)
        save(args.out, record, stamp)
    for (kind, decode, suffix), ratios in round_ratios(results).items():
        if ratios:
            key = f"resnet50_b{batch}_{cores}cores{scale}" + ("_shards" if kind == "shards" else "")
            key = key if decode == "auto" else f"{key}_{decode}"
            record["ratio"][key + suffix] = statistics.median(ratios)
            record["ratio_rounds"][key + suffix] = ratios
    save(args.out, record, stamp)


def save(out: Path, record: dict, stamp: str) -> Path:
    """The results so far, rewritten after every run (a job cut off keeps what it measured)."""
    meta = (
        versions() if torch.cuda.is_available() else {"device": "cpu", "torch": torch.__version__}
    )
    record = {**record, **meta, "argv": sys.argv, "time": stamp}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"real_images-{meta['device'].replace(' ', '_')}-{stamp}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


if __name__ == "__main__":
    main()
