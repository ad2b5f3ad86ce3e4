"""On CUDA machines (skipped elsewhere): the main job over NCCL, one process per GPU, each
process's memory on its own GPU only; and too many processes for the GPUs stops before work."""

import subprocess
import threading
import time

import pytest
import torch
from conftest import FAST, read_scalars, run_train

pytestmark = pytest.mark.gpu

NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class GpuProcessSampler(threading.Thread):
    """Polls nvidia-smi for (pid, gpu) pairs while a run is going on."""

    def __init__(self):
        super().__init__(daemon=True)
        self.pairs: set[tuple[str, str]] = set()
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            for line in out.stdout.splitlines():
                pid, gpu = (part.strip() for part in line.split(","))
                self.pairs.add((pid, gpu))
            time.sleep(0.5)


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
