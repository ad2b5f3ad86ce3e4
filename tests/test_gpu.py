"""On CUDA machines (skipped elsewhere): the main job over NCCL, one process per GPU, each
process's memory on its own GPU only; and too many processes for the GPUs stops before work."""

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST, NCCL_ENV, read_scalars, run_train, together
from faults import first_sample_of_step

from mgpu.ckpt.checkpoint import step_dir

pytestmark = pytest.mark.gpu


class GpuProcessSampler(threading.Thread):
    """Polls nvidia-smi for (pid, gpu) pairs of the run's processes while it is going on: the
    processes this pytest process started (another worker's tests share its GPUs,
    tests/conftest.py).

    The pytest process itself is left out: earlier GPU tests in the same session (checkpoint
    round trips, the prefetcher's) leave it holding a CUDA context on GPU 0."""

    def __init__(self):
        super().__init__(daemon=True)
        self.pairs: set[tuple[str, str]] = set()
        self.done = threading.Event()

    def run(self):
        mine = self.visible_gpus()
        while not self.done.is_set():
            for pid, gpu in self.query("--query-compute-apps=pid,gpu_uuid"):
                if pid != str(os.getpid()) and (mine is None or gpu in mine) and ours(pid):
                    self.pairs.add((pid, gpu))
            time.sleep(0.5)

    @staticmethod
    def query(what: str) -> list[tuple[str, str]]:
        out = subprocess.run(
            ["nvidia-smi", what, "--format=csv,noheader"], capture_output=True, text=True
        )
        return [tuple(part.strip() for part in line.split(",")) for line in out.stdout.splitlines()]

    @classmethod
    def visible_gpus(cls) -> set[str] | None:
        """The UUIDs of the GPUs this process sees (a pytest worker of a GPU machine sees its
        own two, tests/conftest.py), or None for all: other workers' runs are not this test's."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not visible:
            return None
        names = set(visible.split(","))
        gpus = cls.query("--query-gpu=index,uuid")
        return {uuid for index, uuid in gpus if index in names or uuid in names}


def ours(pid: str) -> bool:
    """Whether process `pid` descends from this one (its parents, read from /proc)."""
    me, current = os.getpid(), int(pid)
    while current > 1:
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:  # it ended: not seen as ours, the next poll sees the run's others
            return False
        current = int(stat.rsplit(")", 1)[1].split()[1])  # the parent, after "(name) state"
        if current == me:
            return True
    return False


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_run_over_nccl_keeps_each_rank_on_its_own_gpu(tmp_path):
    sampler = GpuProcessSampler()
    sampler.start()
    run_dir = tmp_path / "run"
    args = [*FAST, "trainer.max_steps=200", "trainer.eval_every=100", f"hydra.run.dir={run_dir}"]
    proc = run_train(args, cwd=tmp_path, nproc=2, env=NCCL_ENV)
    sampler.done.set()
    sampler.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend nccl, device cuda:0" in proc.stdout
    losses = [v for _, v in read_scalars(run_dir)["train/loss"]]
    assert losses[-1] < losses[0] - 2.0, losses
    gpus_of: dict[str, set[str]] = {}
    for pid, gpu in sampler.pairs:
        gpus_of.setdefault(pid, set()).add(gpu)
    assert len(gpus_of) == 2, sampler.pairs  # two workers seen on the GPUs, nothing else
    assert all(len(g) == 1 for g in gpus_of.values()), sampler.pairs  # each on one GPU only
    assert len(set.union(*gpus_of.values())) == 2, sampler.pairs  # and on different GPUs


def test_more_processes_than_gpus_stops_before_any_work(tmp_path):
    n = torch.cuda.device_count() + 1
    run_dir = tmp_path / "run"
    proc = run_train([f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=n, env=NCCL_ENV)
    assert proc.returncode != 0
    assert f"{n} processes on this node but {n - 1} visible CUDA GPU(s)" in proc.stderr
    assert not run_dir.exists()


# ---- faults on 2 GPUs: fp16 resume, a hung rank under NCCL ----

FAULT_RUN = [
    "trainer.max_steps=20",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "ckpt.every=5",
    "data.num_workers=0",
    "data=custom",
    "data._target_=tests.faults.FaultyTokens",
    "+data.kwargs.rank=1",
    "+data.kwargs.eval_samples=64",
    "model.vocab_size=256",  # a user's dataset: the model cannot follow its vocabulary
]


def faulty(fault: str, step: int, marker) -> list[str]:
    at = first_sample_of_step(step, 32)  # data.batch_size's default
    return [
        f"+data.kwargs.fault={fault}",
        f"+data.kwargs.at_sample={at}",
        f"+data.kwargs.marker={marker}",
    ]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fp16_run_killed_and_restarted_ends_like_an_uninterrupted_one(tmp_path):
    """GradScaler's scale, which the first fp16 steps lower through overflows, is restored
    exactly: the restarted run's losses and loss scales equal the uninterrupted run's. The
    scale starts at 2**30 so that the first steps overflow and lower it (at torch's 2**16 the
    tiny GPT never overflowed in 20 steps on H200s, and the scaler's state did not matter)."""
    fp16 = [*FAULT_RUN, "trainer.precision=fp16", f"trainer.loss_scale_init={2.0**30}"]
    # Equal to another run bit for bit needs kernels that repeat from run to run
    # (docs/checkpoints.md, Resume): replayed as CUDA graphs, two uninterrupted runs differed
    # (at step 11 by 1.4e-6 in this test on 4 H200s), so the kernels are torch's deterministic
    # ones and the attention the math kernel.
    fp16 += ["trainer.deterministic=true", "trainer.cudnn_benchmark=false"]
    fp16 += ["model.attention=math"]

    def launch(name: str, kind: str, step: int):
        args = [*fp16, *faulty(kind, step, tmp_path / f"{name}.m")]
        return lambda: run_train(
            [*args, f"hydra.run.dir={tmp_path / name}"],
            cwd=tmp_path,
            nproc=2,
            env={**NCCL_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            torchrun_args=("--max-restarts=1",),
            timeout=600,
        )

    # Both runs at once on the same two GPUs: deterministic kernels give the same bits whatever
    # else the GPU runs.
    procs = together(launch("reference", "kill", 999), launch("killed", "kill", 13))
    runs = {}
    for name, proc in zip(("reference", "killed"), procs, strict=True):
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        runs[name] = read_scalars(tmp_path / name)
    assert (tmp_path / "killed.m").exists()
    for tag in ("train/loss", "train/loss_scale"):
        assert runs["killed"][tag] == runs["reference"][tag], tag
    scales = {v for _, v in runs["reference"]["train/loss_scale"]}
    assert len(scales) > 1, scales  # overflow lowered it: the scaler's state mattered


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_hung_rank_under_nccl_ends_the_job_naming_the_lagging_rank(tmp_path):
    """Rank 1 stops in its data loader; rank 0's host blocks at its next sync point while its
    GPU waits in the gradient all_reduce. The stall clock ends the job well inside
    dist.timeout_s and names rank 1 as the one behind."""
    args = [*FAULT_RUN, *faulty("hang", 3, tmp_path / "m"), f"hydra.run.dir={tmp_path / 'run'}"]
    args += ["dist.timeout_s=120", "trainer.stall_timeout_s=10"]
    start = time.monotonic()
    proc = run_train(args, cwd=tmp_path, nproc=2, env=NCCL_ENV, timeout=300)
    elapsed = time.monotonic() - start
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "no progress for" in text and "lagging: rank 1" in text, text[-3000:]
    assert elapsed < 90, elapsed  # start-up + 10 s of stall + tear-down, not 120 s


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_preemption_with_dataloader_workers_over_nccl_saves_and_resumes(tmp_path):
    """SIGTERM to the torchrun agent while DataLoader workers run: every rank stops after the
    same step and saves it; the same command resumes there and finishes."""
    run_dir = tmp_path / "run"
    args = [
        *(a for a in FAULT_RUN if a != "data.num_workers=0"),
        "data.num_workers=2",
        *faulty("term_agent", 8, tmp_path / "m"),
        f"hydra.run.dir={run_dir}",
    ]
    first = run_train(args, cwd=tmp_path, nproc=2, env=NCCL_ENV, timeout=300)
    text = first.stdout + first.stderr
    # torchrun's agent passes the signal on to each worker: rank 0 (the one that prints) says
    # SIGTERM, or, where another rank's arrived first, that it stopped on that one's
    stopped = re.search(
        r"preempted \((?:SIGTERM|another rank's signal)\) after step (\d+): checkpoint saved", text
    )
    assert first.returncode == 1 and stopped, text[-3000:]  # torchrun's own code (README)
    step = int(stopped.group(1))
    for rank in (0, 1):
        assert f"after step {step}: checkpoint saved" in (run_dir / f"rank{rank}.log").read_text()
    second = run_train(args, cwd=tmp_path, nproc=2, env=NCCL_ENV, timeout=300)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "resumed from " + str(step_dir(run_dir / "checkpoints", step)) in (
        second.stdout + second.stderr
    )
    steps = [s for s, _ in read_scalars(run_dir)["train/loss"]]
    assert steps == list(range(1, 21))  # each step once, across both launches
