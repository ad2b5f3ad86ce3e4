"""dist.shard_optimizer=true on CUDA on a machine with one GPU: two processes share it, with gloo
carrying the CUDA tensors (NCCL refuses two ranks on one device), so that sharding's CUDA stream
rules run there (the reduce-scatters and all-gathers on the communication stream, the compute
stream waiting for the all-gathers at the next forward): fp16 with loss scaling, checked as
test_shard_fp16 checks it, and a model compiled whole by inductor (CUDA graphs, as on a GPU by
default), checked against the eager unsharded model as test_compile checks it on CPU."""

import os

import pytest
import torch
import torch.distributed as tdist
from conftest import free_port, spawn
from test_compile import stack_as_sequential
from test_compile import train as train_compiled
from test_shard_fp16 import CASES as FP16_CASES
from test_shard_fp16 import assert_same_training
from test_shard_fp16 import train as train_fp16

from mgpu.runtime.dist import Runtime

PER_PARAM = {"bucket_cap_mb": 1e-6}


def worker(rank: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        rt = Runtime(rank, 0, 2, "gloo", device, has_process_group=True)
        fp16 = {(c, s): train_fp16(rt, c, s) for c in FP16_CASES for s in (False, True)}
        whole = {
            "eager": train_compiled(rt, False, PER_PARAM, stack_as_sequential),
            "sharded": train_compiled(
                rt, True, {**PER_PARAM, "shard_optimizer": True}, stack_as_sequential, "inductor"
            ),
        }
    finally:
        tdist.destroy_process_group()
    torch.save({"fp16": fp16, "whole": whole}, f"{out_dir}/{rank}.pt")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sharding_runs_its_cuda_streams_with_two_processes_on_one_gpu(tmp_path):
    spawn(worker, free_port(), str(tmp_path), nprocs=2)
    results = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]
    for case in FP16_CASES:
        assert_same_training([r["fp16"] for r in results], case, tol=1e-4)
    for rank, result in enumerate(results):
        eager, sharded = result["whole"]["eager"]["params"], result["whole"]["sharded"]["params"]
        for key, value in eager.items():
            where = f"rank {rank} {key}"
            torch.testing.assert_close(
                sharded[key], value, rtol=1e-4, atol=1e-4, msg=lambda m, k=where: f"{k}: {m}"
            )
