"""Hang reports name the rank that did not arrive: rank 1 stops for good in its forward at step 20
(tests.faults.HangGPT), before the gradient all_reduce rank 0 waits in. Whether the stall clock
or a timed-out collective ends the run, the report names rank 1, its step and phase, its frame
and the file its stacks were written to, and rank 1 ends first with exit code 70, so that
torchrun's "Root Cause" is rank 1. 2 processes over gloo; on 2 GPUs, over NCCL."""

import re

import pytest
import torch
from conftest import run_train

HANG_STEP = 20
# gpt_tiny cut to one narrow layer: what a hang report says does not depend on the model.
GPT = "vocab_size=256 block_size=64 n_layer=1 n_head=2 n_embd=32".split()
RUN = [
    "trainer.max_steps=40",
    "trainer.log_every=10",
    "trainer.eval_every=0",
    "data.num_workers=0",
    "data.eval_samples=64",
    "model=custom",
    "model._target_=tests.faults.HangGPT",
    *[f"+model.kwargs.{kv}" for kv in GPT],
    "+model.kwargs.rank=1",
    f"+model.kwargs.at_forward={HANG_STEP}",  # one forward a step: no accumulation
]
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def root_cause(stderr: str) -> tuple[int, int]:
    """The rank and exit code torchrun's summary names as its "Root Cause"."""
    block = stderr.split("Root Cause", 1)[1]
    rank = re.search(r"rank\s*:\s*(\d+)", block)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", block)
    return int(rank.group(1)), int(code.group(1))


def hung_run(tmp_path, *settings: str, env: dict | None = None) -> str:
    """The run's output, once it has ended with rank 1 as the rank that hung: torchrun's Root
    Cause is rank 1 with exit code 70, and its stacks, in the run directory, show the frame it
    is stuck in."""
    run_dir = tmp_path / "run"
    args = [*RUN, *settings, f"hydra.run.dir={run_dir}"]
    proc = run_train(args, cwd=tmp_path, nproc=2, env=env, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert root_cause(proc.stderr) == (1, 70), text[-3000:]
    # and its table says why, in the hung rank's own words
    cause = proc.stderr.split("Root Cause", 1)[1]
    assert re.search(r"traceback : rank 1: no progress for \d+ s", cause), cause
    stacks = (run_dir / "hang-rank1.txt").read_text()
    assert re.search(r'File "\S*tests/faults\.py", line \d+ in forward', stacks), stacks
    assert "lagging: rank 0" not in text, text[-3000:]
    return text


def named(text: str, tmp_path, *said: str) -> list[str]:
    """The report lines that name the rank the others wait for; each names rank 1 at the step
    it hung in, in forward, and where its stacks are, and each pattern in `said` is one's."""
    lines = [line for line in text.splitlines() if "the other ranks wait for" in line]
    lines += [line for line in text.splitlines() if "rank 1 did not arrive" in line]
    stacks = re.escape(f"its stacks: {tmp_path / 'run' / 'hang-rank1.txt'}")
    where = rf"step {HANG_STEP}, forward/backward and the gradient all_reduce"
    for line in lines:
        assert re.search(where, line), line
        assert re.search(r"tests/faults\.py:\d+ in forward; its stacks: ", line), line
        assert re.search(stacks, line), line
    for pattern in said:
        assert [line for line in lines if re.search(pattern, line)], (pattern, text[-3000:])
    return lines


def test_the_stall_clock_names_the_rank_stuck_in_its_forward(tmp_path):
    text = hung_run(tmp_path, "dist.timeout_s=300", "trainer.stall_timeout_s=4")
    said = r"rank 1: no progress for \d+ s .*: the other ranks wait for this one"
    lines = named(text, tmp_path, said)
    # What shows it: the collective rank 0 issued and rank 1 did not.
    arrive = r"rank 1 did not arrive at collective \d+ (\(gloo:all_reduce\) )?of process group"
    assert all(re.search(arrive, line) for line in lines if "did not arrive" in line)
    assert re.search(r"lagging: rank 1; rank 1: step 20, ", text), text[-3000:]


def test_a_timed_out_collective_names_the_rank_that_did_not_arrive(tmp_path):
    text = hung_run(tmp_path, "dist.timeout_s=5", "trainer.stall_timeout_s=0")
    timed_out = r"rank 0: a collective timed out \(dist.timeout_s\) in step 20, .* rank 1 did not"
    # rank 1 was asked to end, and said so itself
    asked = r"rank 1: no progress for \d+ s .*: the other ranks wait for this one \(rank 0 waited"
    named(text, tmp_path, timed_out, asked)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_rank_hung_before_an_nccl_collective_is_the_one_named(tmp_path):
    """On NCCL rank 0's host does not wait in the collective its GPU waits in: it runs on to
    its next sync point, a step or two later. The report still names rank 1, by the collectives
    NCCL's flight recorder counted, or by step where the recorder is off."""
    # Eager, not replayed: the hang is in the Python forward, which a replay would not call.
    settings = ("dist.timeout_s=120", "trainer.stall_timeout_s=10", "trainer.compile=false")
    settings += ("trainer.cuda_graphs=false",)
    text = hung_run(tmp_path, *settings, env=NCCL_ENV)
    behind = r"rank 1 (did not arrive at collective \d+ .*|is furthest behind): it is in step 20"
    named(text, tmp_path, behind, r"rank 1: no progress for \d+ s .*: the other ranks wait")
