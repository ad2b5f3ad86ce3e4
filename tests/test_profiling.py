"""trainer.profile: one trace per rank over exactly the window's steps, with the phase ranges in it,
from two gloo processes; windows cut short, resumed into, or never reached; and, disabled,
phase ranges that are a shared no-op and no files."""

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from conftest import free_port, gloo_runtime, spawn
from torch import nn

from mgpu.runtime.dist import Runtime
from mgpu.telemetry import profiling
from mgpu.telemetry.profiling import BACKWARD, DATA, FORWARD, OPTIMIZER, REDUCE, StepProfiler, phase

WORLD = 2
CPU = torch.device("cpu")
ONE = Runtime(0, 0, 1, "gloo", CPU, has_process_group=False)


def train(prof, first: int, last: int, *, reduce=False, fail_at=0, device=CPU):
    """Steps first..last of a tiny model, as the trainer runs them (close() in a finally)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(first, last + 1):
            prof.begin_step(step)
            with phase(DATA):
                x = torch.randn(8, 4, device=device)
            with phase(FORWARD):
                loss = model(x).square().mean()
            with phase(BACKWARD):
                loss.backward()
            if step == fail_at:
                raise RuntimeError("boom")
            if reduce:
                with phase(REDUCE):
                    for p in model.parameters():
                        tdist.all_reduce(p.grad)
            with phase(OPTIMIZER):
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        prof.close()


def traces(run_dir: Path, rank: int = 0) -> list[Path]:
    return sorted((run_dir / "profile" / f"rank{rank}").glob("*.pt.trace.json"))


def names(path: Path) -> list[str]:
    trace = json.loads(path.read_text())
    return [e.get("name", "") for e in trace["traceEvents"]]


def steps_in(path: Path) -> list[str]:
    return sorted(n for n in names(path) if n.startswith("ProfilerStep#"))


def worker(rank: int, port: int, run_dir: str):
    with gloo_runtime(rank, port, WORLD) as rt:
        train(StepProfiler(True, 3, 2, Path(run_dir), rt), 1, 8, reduce=True)


def test_one_trace_per_rank_over_exactly_the_window(tmp_path):
    spawn(worker, free_port(), str(tmp_path), nprocs=WORLD)
    for rank in range(WORLD):
        (path,) = traces(tmp_path, rank)  # exactly one file per rank
        assert path.name.startswith(f"rank{rank}.")
        trace = json.loads(path.read_text())
        assert trace["distributedInfo"]["rank"] == rank
        seen = names(path)
        # steps 3 and 4 only: the warm-up step (2) and everything after 4 stay out
        for name in (DATA, FORWARD, BACKWARD, REDUCE, OPTIMIZER):
            assert seen.count(name) == 2, name
        assert len(steps_in(path)) == 2


def test_window_cut_short_by_the_end_of_training_is_written_once(tmp_path, caplog):
    prof = StepProfiler(True, 6, 5, tmp_path, ONE)
    with caplog.at_level(logging.INFO, logger="mgpu.telemetry.profiling"):
        train(prof, 1, 8)  # steps 6, 7, 8 of 6..10
        prof.close()
    (path,) = traces(tmp_path)
    assert names(path).count(FORWARD) == 3
    assert len(steps_in(path)) == 3
    assert f"steps 6-8 written to {path}" in caplog.text
    assert not profiling._recording


def test_error_inside_the_window_still_writes_the_trace(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        train(StepProfiler(True, 2, 4, tmp_path, ONE), 1, 8, fail_at=3)
    (path,) = traces(tmp_path)
    seen = names(path)
    assert seen.count(FORWARD) == 2 and seen.count(OPTIMIZER) == 1  # step 3 stopped early


def test_resuming_inside_the_window_records_the_rest_of_it(tmp_path):
    train(StepProfiler(True, 3, 3, tmp_path, ONE), 4, 8)  # resumed after step 3
    (path,) = traces(tmp_path)
    assert names(path).count(FORWARD) == 2  # steps 4 and 5


@pytest.mark.parametrize("start, first, last", [(10, 1, 8), (9, 1, 8), (2, 5, 8)])
def test_window_outside_the_run_writes_nothing(tmp_path, start, first, last):
    # after the last step; starting right after it (only the warm-up step runs); before a resume
    train(StepProfiler(True, start, 2, tmp_path, ONE), first, last)
    assert not (tmp_path / "profile").exists() or not traces(tmp_path)
    assert not profiling._recording


def test_disabled_is_a_no_op(tmp_path):
    prof = StepProfiler(False, 1, 100, tmp_path, ONE)
    assert phase(FORWARD) is phase(BACKWARD)  # one shared no-op context, nothing allocated
    train(prof, 1, 4)
    assert prof._prof is None and not profiling._recording
    assert not (tmp_path / "profile").exists()


@pytest.mark.gpu
def test_cuda_trace_has_kernels_and_phase_ranges(tmp_path):
    cuda = torch.device("cuda", 0)
    rt = Runtime(0, 0, 1, "nccl", cuda, has_process_group=False)
    prof = StepProfiler(True, 3, 2, tmp_path, rt)
    assert phase(FORWARD) is not phase(FORWARD)  # NVTX ranges on, without any profiler flag
    train(prof, 1, 6, device=cuda)
    (path,) = traces(tmp_path)
    events = json.loads(path.read_text())["traceEvents"]
    cpu = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == FORWARD]
    gpu = [e for e in events if e.get("cat") == "gpu_user_annotation" and e["name"] == FORWARD]
    assert len(cpu) == 2 and len(gpu) == 2
    assert any(e.get("cat") == "kernel" for e in events)


def test_nvtx_ranges_balanced_and_named_with_or_without_a_trace(tmp_path, monkeypatch):
    # The CUDA path on CPU: record what would go to NVTX.
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(None))
    prof = StepProfiler(True, 2, 1, tmp_path, ONE)
    monkeypatch.setattr(profiling, "_nvtx", True)  # as StepProfiler sets it on a CUDA device
    train(prof, 1, 3)
    phases = [DATA, FORWARD, BACKWARD, OPTIMIZER]
    assert calls == [c for _ in range(3) for name in phases for c in (name, None)]
    (path,) = traces(tmp_path)  # and the step in the window also has them in its trace
    assert names(path).count(FORWARD) == 1
