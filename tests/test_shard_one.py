"""dist.shard_optimizer=true on a world of one process (`python train.py`, or torchrun with one
process): not a silent no-op. The sharded path runs with one shard per bucket and nothing
communicated, says so in the log, and trains as the unsharded one-process run does (fp16 loss
scaling with an overflow and a NaN loss included); also through train.py."""

import logging

import torch
from conftest import FAST, free_port, gloo_runtime, run_train, spawn
from test_shard_fp16 import CASES, train

from mgpu.runtime.dist import Runtime

ADAMW = "adamw_accum_clip"


def compare(results: dict, cases=tuple(CASES)) -> None:
    for case in cases:
        plain, sharded = results[case, False], results[case, True]
        assert sharded["scales"] == plain["scales"], case
        assert sharded["loss_skips"] == plain["loss_skips"] == 1, case
        assert sharded["steps_taken"] == plain["steps_taken"], case
        for key, value in plain["params"].items():
            # fp32 rounding: the sharded optimizer steps flat pieces, the clipping norm is summed
            # bucket by bucket
            torch.testing.assert_close(sharded["params"][key], value, rtol=1e-5, atol=1e-5)


def test_one_process_without_a_process_group_runs_the_sharded_path(caplog):
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    with caplog.at_level(logging.INFO, logger="mgpu.comm.engine"):
        results = {(c, s): train(rt, c, s) for c in CASES for s in (False, True)}
    assert "dist.shard_optimizer=true has no one to shard with" in caplog.text
    compare(results)


def one_rank_worker(rank: int, port: int, out: str) -> None:
    with gloo_runtime(rank, port, world=1) as rt:
        results = {(ADAMW, s): train(rt, ADAMW, s) for s in (False, True)}
    torch.save(results, out)


def test_a_process_group_of_one_runs_the_sharded_path(tmp_path):
    """torchrun --nproc_per_node=1: a process group, but no one to communicate with."""
    out = tmp_path / "results.pt"
    spawn(one_rank_worker, free_port(), str(out), nprocs=1)
    compare(torch.load(out, weights_only=True), [ADAMW])


def test_train_py_on_one_process_says_it_shards_nothing(tmp_path):
    args = [*FAST, "trainer.max_steps=6", "trainer.eval_every=0", "dist.shard_optimizer=true",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = run_train(args, cwd=tmp_path, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dist.shard_optimizer=true has no one to shard with" in proc.stdout + proc.stderr
