"""Data-parallel scaling of one host in one command: each model trained by mgpu on 2 and 4 GPUs
(every count up to the GPUs the machine has), beside the same GPUs each training alone (the one-GPU
step, measured in the same job) and torch DDP, compiled and eager.

    python bench/scaling.py                       # GPT-2-small and ResNet-50, all GPU counts
    python bench/scaling.py --models gpt2_small --gpus 2 --modes compiled
    python bench/scaling.py --xl                  # GPT-2 XL too (experiment=gpt2_xl's micro-batch)
    python bench/scaling.py --quick               # tiny models on the CPU over gloo: checks it

Each job is one `torchrun bench/engines.py` (mgpu's Trainer, wrappers and compile as train.py
builds them, batches already on the GPU, so the figures are compute and communication, not
input): engine `none` is every GPU training alone, mgpu's fastest one-GPU path (the whole model
compiled with CUDA graphs, or the eager step replayed as CUDA graphs); `mgpu` is data parallelism
as train.py runs it by default (trainer.cuda_graphs=auto: the step replayed as CUDA graphs with
the reductions recorded inside, wherever they can be; compiled, the whole model in torch's
default mode, its reductions after backward), `mgpu_uncaptured` with trainer.cuda_graphs=false
(compiled block by block, its reductions during backward); `torch_ddp` and `torch_ddp_tuned` are
torch's DistributedDataParallel (compiled whole by torch.compile under --compile, eager otherwise).

Writes bench/results/scaling-<device>-<time>.json: the machine, versions and commit, every job's
rows (each engine's step times, peak memory, exposed communication), and two summaries keyed
`<model>_<compiled|eager>_<gpus>`: "efficiency" (the one-GPU step over mgpu's step),
"vs_ddp" (the faster torch DDP step over mgpu's step), both for mgpu's faster setting, which
"engine" names. `--side-by-side` runs jobs of half the machine's GPUs or fewer at the same time
(2-GPU jobs two at a time on 4 GPUs), each on GPUs and host cores of its own (each GPU's equal
share of the cores); a job's record says which GPUs, how many cores, and which jobs ran beside
it. It is off by default: beside another job, the engines whose kernels the host launches step by
step (torch DDP, mgpu uncaptured) ran up to 17 % slower on 4 H200s, while replayed and compiled
steps did not move, which flatters mgpu against torch DDP (bench/README.md).

The file is written again after every job, so a run cut short keeps what it did;
a job cut short by its time limit, or failed, keeps the engines it finished (engines.py writes
them after each one when it times them one at a time, as for XL) and names itself at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = ["none", "mgpu", "mgpu_uncaptured", "torch_ddp", "torch_ddp_tuned"]
MINE = ("mgpu", "mgpu_uncaptured")  # mgpu's settings, the faster one reported
MODES = ("compiled", "eager")
# engines.py's MODELS (and its --quick stand-ins), named here so that a typo stops before any job
# starts rather than in each job's torchrun; importing engines.py would cost this process torch.
MODELS = ("gpt2_small", "gpt2_xl", "resnet50")


def gpu_count(quick: bool) -> int:
    if quick:
        return 2
    import torch

    return torch.cuda.device_count()


@dataclass
class Job:
    """One torchrun of engines.py for one model, mode and GPU count, and, once started, where it
    runs: its GPUs and the host cores that go with them."""

    model: str
    gpus: int
    mode: str
    key: str = ""
    devices: list[int] = field(default_factory=list)
    cores: list[int] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    began: float = 0.0
    beside: set[str] = field(default_factory=set)  # keys of jobs that ran at the same time
    before: set[Path] = field(default_factory=set)  # its result files already there at its start

    def __post_init__(self) -> None:
        xl = self.model == "gpt2_xl"
        self.key = f"{self.model}_{self.gpus}" if xl else f"{self.model}_{self.mode}_{self.gpus}"

    @property
    def tag(self) -> str:
        return f"{self.model}-{self.mode}-x{self.gpus}"


def order(jobs: list[Job]) -> list[Job]:
    """The order jobs start in: fewer GPUs first (jobs that can share the machine side by side
    start together, the machine-wide ones after), the longest first within a GPU count (GPT-2
    XL, then compiled jobs, whose compiling is most of their wall), so that the side-by-side
    jobs end at about the same time."""
    length = {"gpt2_xl": 0}
    return sorted(jobs, key=lambda j: (j.gpus, length.get(j.model, 1), j.mode != "compiled"))


def place(free: list[int], gpus: int) -> list[int] | None:
    """`gpus` of the free GPUs, an aligned block of them (GPUs 0-1 or 2-3 for 2 of 4, which
    on a server share a switch or a socket more often than 1-2 do), or None."""
    for first in range(0, max(free, default=-1) + 1, gpus):
        block = list(range(first, first + gpus))
        if all(d in free for d in block):
            return block
    return None


def cores_of(devices: list[int], machine_gpus: int, cpus: list[int]) -> list[int]:
    """The host cores that go with `devices`: each GPU's equal share of the cores this process
    may use, so that jobs side by side do not take each other's (compiling is CPU-bound). The
    share is taken in the order the CPUs are numbered, not by socket or by hardware thread: where
    a core's second thread is numbered far from its first, two shares can share cores."""
    share = max(1, len(cpus) // machine_gpus)
    return [c for d in devices for c in cpus[d * share : (d + 1) * share]] or cpus


def command(job: Job, args, out: Path) -> list[str]:
    xl = job.model == "gpt2_xl"
    names = args.xl_engines if xl else ENGINES
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={job.gpus}", str(HERE / "engines.py"),
        "--models", job.model, "--engines", *names, "--out", str(out), "--tag", job.tag,
    ]  # fmt: skip
    if not args.quick:  # --quick: engines.py's own few
        cmd += ["--steps", str(args.xl_steps if xl else args.steps), "--rounds", str(args.rounds)]
        cmd += ["--warmup", str(args.warmup)]
    if job.mode == "compiled":
        cmd.append("--compile")
    if xl:
        cmd += ["--accum", str(args.xl_accum), "--one-at-a-time"]
    if args.quick:
        cmd.append("--quick")
    return cmd


def start(job: Job, args, out: Path) -> None:
    """Starts the job's torchrun on its GPUs, its processes bound to its cores."""
    env = dict(os.environ)
    if not args.quick:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, job.devices))
    cmd = command(job, args, out)
    where = f"GPUs {job.devices}, {len(job.cores)} cores" if not args.quick else "CPU"
    print(f"=== {job.key} ({where}): {' '.join(cmd[2:])}", flush=True)
    cores = set(job.cores)
    job.before = set(out.glob(f"engines-{job.tag}-2*.json"))  # a job run twice reads its own
    job.began = time.time()
    job.proc = subprocess.Popen(cmd, env=env, text=True, preexec_fn=lambda: bind(cores))


def bind(cores: set[int]) -> None:
    """In the job's torchrun before it starts: its workers inherit the cores."""
    if cores:
        os.sched_setaffinity(0, cores)


def stop(job: Job, limit: float) -> str:
    """Past its limit the job's torchrun is asked to end (SIGTERM: it stops its workers, which
    also end with it, engines.py's end_with_agent), then killed; the next job must not share
    the GPUs with this one's workers."""
    job.proc.terminate()
    try:
        job.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        job.proc.kill()
        job.proc.wait()
    return f"timed out after {limit} s"


def collect(job: Job, status: int | str, out: Path) -> tuple[list[dict], dict, str]:
    """The ended job's rows and metadata, and how it ended ('ok' or why not). A job cut short
    keeps the engines it finished (XL's, timed one at a time)."""
    written = sorted(set(out.glob(f"engines-{job.tag}-2*.json")) - job.before)
    if written:  # the whole job's record, whatever its teardown did after writing it
        data = json.loads(written[-1].read_text())
        return data.pop("rows"), data, "ok" if status == 0 else f"ok, then exit {status}"
    status = status if isinstance(status, str) else f"exit {status}"
    partial = out / f"engines-{job.tag}-partial.json"
    try:
        data = json.loads(partial.read_text())
    except (OSError, ValueError):  # none written, or not whole
        return [], {}, status
    partial.unlink()
    rows = data.pop("rows")
    return rows, data, f"{status}; kept the engines it finished: {[r['engine'] for r in rows]}"


def run_all(jobs: list[Job], args, machine_gpus: int, out: Path, done) -> None:  # noqa: ANN001
    """Runs the jobs, side by side where their GPUs leave room (`--side-by-side`), in `order`;
    `done(job, rows, meta, status)` as each ends."""
    pending, running = order(jobs), []
    # SIGTERM (a batch system's, a time limit's) ends this process through the cleanup below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("scaling.py: stopped by SIGTERM"))
    try:
        schedule(pending, running, args, machine_gpus, out, done)
    finally:  # an error here or a signal: no job left running on its GPUs unrecorded
        for job in running:
            if job.proc is not None and job.proc.poll() is None:
                stop(job, 0)


def schedule(pending, running, args, machine_gpus: int, out: Path, done) -> None:  # noqa: ANN001
    """run_all's loop: starts the pending jobs that fit the free GPUs, in order, and polls the
    running ones (`running` is shared, for run_all's cleanup)."""
    free = list(range(machine_gpus))
    cpus = sorted(os.sched_getaffinity(0))
    while pending or running:
        while pending and (args.side_by_side or not running):
            devices = place(free, pending[0].gpus)
            if devices is None:  # in order: the machine-wide jobs wait for the machine
                break
            job = pending.pop(0)
            # one job at a time: every core, as before side by side existed
            share = args.side_by_side and len(devices) < machine_gpus
            job.devices = devices
            job.cores = cores_of(devices, machine_gpus, cpus) if share else cpus
            free = [d for d in free if d not in devices]
            for other in running:
                job.beside.add(other.key)
                other.beside.add(job.key)
            start(job, args, out)
            running.append(job)
        time.sleep(0.5)
        for job in list(running):
            xl = job.model == "gpt2_xl"
            limit = args.xl_job_timeout_s if xl else args.job_timeout_s
            status = job.proc.poll()
            if status is None and time.time() - job.began > limit:
                status = stop(job, limit)
            if status is None:
                continue
            running.remove(job)
            free = sorted(free + job.devices)
            done(job, *collect(job, status, out))


def summarize(rows: list[dict], key: str, summary: dict, settings: tuple = MINE) -> None:
    """Efficiency and speed against torch DDP of mgpu's fastest setting in one job's rows
    (`settings`, by default MINE: `mgpu`, trainer.cuda_graphs=auto, or another of its
    settings), and which it was."""
    by_engine = {r["engine"]: r["step_ms"] for r in rows}
    mine = {e: ms for e, ms in by_engine.items() if e in settings}
    if not mine:
        return
    engine = min(mine, key=mine.__getitem__)
    mgpu = mine[engine]
    summary["engine"][key] = engine
    if "none" in by_engine:
        summary["efficiency"][key] = round(by_engine["none"] / mgpu, 4)
    ddp = [ms for e, ms in by_engine.items() if e.startswith("torch_ddp")]
    if ddp:
        summary["vs_ddp"][key] = round(min(ddp) / mgpu, 4)


def at_least(least: int):  # noqa: ANN201
    """An argparse type: a whole number of at least `least`, else one line (exit code 2) before
    any job starts. Under --quick engines.py replaces --steps, --rounds and --warmup with its
    own 2, 1 and 1, so a 0 there would run and be recorded as given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least {least}")
        return value

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2_small", "resnet50"], choices=MODELS)
    parser.add_argument("--xl", action="store_true", help="GPT-2 XL too, compiled, --xl-accum")
    parser.add_argument("--xl-accum", type=at_least(1), default=4)
    parser.add_argument(
        "--xl-steps", type=at_least(1), default=4, help="steps a round for GPT-2 XL"
    )
    parser.add_argument("--xl-job-timeout-s", type=at_least(1), default=420)
    parser.add_argument("--xl-engines", nargs="+", default=["none", "mgpu", "torch_ddp_view"])
    parser.add_argument("--gpus", nargs="+", type=int, help="GPU counts (default: 2, 4, ... all)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    quick = "; --quick runs engines.py's {} instead"
    parser.add_argument(
        "--steps", type=at_least(1), default=10, help="timed steps a round" + quick.format(2)
    )
    parser.add_argument("--rounds", type=at_least(1), default=3, help="rounds" + quick.format(1))
    # at least 1: engines.py's warm-up divides its time by its steps (engines.timed)
    parser.add_argument(
        "--warmup", type=at_least(1), default=3, help="steps before timing" + quick.format(1)
    )
    parser.add_argument("--job-timeout-s", type=at_least(1), default=300)
    parser.add_argument(
        "--side-by-side",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="jobs that leave room (2 GPUs of 4) run at the same time on GPUs and cores of "
        "their own: sooner, but host-launched engines (torch DDP) run slower beside a job",
    )
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU (gloo)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    available = gpu_count(args.quick)
    if available < 2:
        parser.error(f"this machine has {available} GPU(s); scaling needs at least 2")
    counts = args.gpus or sorted({n for n in (2, 4, 8) if n <= available} | {available})
    too_many = [n for n in counts if n > available or n < 2]
    if too_many:
        parser.error(f"--gpus {too_many}: between 2 and the {available} GPUs this machine has")
    # GPT-2 XL (its experiment) is compiled: one job a GPU count, whatever --modes
    jobs = [
        Job(m, n, mode)
        for m in args.models
        for mode in (args.modes if m != "gpt2_xl" else ["compiled"])
        for n in counts
    ]
    if args.xl and "gpt2_xl" not in args.models:
        jobs += [Job("gpt2_xl", n, "compiled") for n in counts]
    summary: dict = {"efficiency": {}, "vs_ddp": {}, "engine": {}}
    results, meta, started = [], {}, time.time()
    stamp, path = time.strftime("%Y%m%d-%H%M%S"), None

    def done(job: Job, rows: list[dict], job_meta: dict, status: str) -> None:
        nonlocal meta, path
        meta = meta or {k: v for k, v in job_meta.items() if k != "command"}
        results.append({
            "key": job.key, "status": status, "wall_s": round(time.time() - job.began, 1),
            "gpus_used": job.devices, "cores": len(job.cores), "beside": sorted(job.beside),
            **job_meta, "rows": rows,
        })  # fmt: skip
        summarize(rows, job.key, summary)
        path = write(args, meta, summary, results, started, available, stamp, path)
        print(f"--- {job.key}: {status} in {results[-1]['wall_s']} s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        run_all(jobs, args, available, Path(tmp), done)
    print(f"\n{'key':<28} {'efficiency':>10} {'vs ddp':>7} {'mgpu engine':>12}  status")
    for r in results:
        k = r["key"]
        eff, ddp = summary["efficiency"].get(k), summary["vs_ddp"].get(k)
        print(
            f"{k:<28} {eff if eff is not None else float('nan'):10.3f} "
            f"{ddp if ddp is not None else float('nan'):7.3f} "
            f"{summary['engine'].get(k, '-'):>12}  {r['status']}"
        )
    print(f"wrote {path} ({time.time() - started:.0f} s)")
    failed = [r["key"] for r in results if r["status"] != "ok"]
    if failed:
        sys.exit(f"jobs that did not finish: {', '.join(failed)}")


def write(args, meta, summary, results, started, available, stamp, path) -> Path:  # noqa: ANN001
    """The record of the jobs so far, into one file (named by the device once a job knew it)."""
    if "device" not in meta and not args.quick:  # no job told it yet; no CUDA context here
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"]
        name = subprocess.run(query, capture_output=True, text=True).stdout.strip()
        meta = {**meta, "device": name or "unknown GPU"}
    device = str(meta.get("device", "cpu")).replace(" ", "_")
    record = {
        "what": "bench/scaling.py: mgpu on N GPUs against each GPU alone and torch DDP, one job "
        "per model, mode and GPU count",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": meta.get("device", "cpu"),
        "gpus": available,
        "torch": meta.get("torch"),
        "nccl": meta.get("nccl"),
        "git_commit": meta.get("git_commit"),
        "env": meta.get("env", {}),
        "wall_s": round(time.time() - started, 1),
        **summary,
        "jobs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    new = args.out / f"scaling-{device}-{stamp}.json"
    if path is not None and path != new:
        path.unlink(missing_ok=True)  # written before any job knew the device
    new.write_text(json.dumps(record, indent=1))
    return new


if __name__ == "__main__":
    main()
