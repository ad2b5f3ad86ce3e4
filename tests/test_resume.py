"""Checkpoints wired into training, end to end with real processes: a worker killed under
`torchrun --max-restarts`, a preempted run started again, and a run that saw a corrupt newest
checkpoint each end with the final parameters and per-step loss record of an uninterrupted run,
bit for bit; a resume on another number of processes sees every sample once; bad resumes,
non-finite losses and hung collectives stop with a clear error."""

import json
import logging
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    free_port,
    gloo_runtime,
    made_once,
    read_scalars,
    run_train,
    said_lines,
    spawn,
)
from faults import first_sample_of_step, recorded
from hydra import compose, initialize_config_dir
from test_checkpoint import Shell, bitflip, no_space, reseal
from torch.utils.data import DataLoader, TensorDataset

from mgpu.ckpt.checkpoint import CheckpointError, find_latest_valid, load, step_dir
from mgpu.ckpt.resume import Checkpointer, CheckpointPlan
from mgpu.config.schema import NonFinite, OptimConfig, Precision, TrainerConfig
from mgpu.data.sampler import ShardedSampler, epoch_order
from mgpu.models import MLP
from mgpu.optim.optimizer import build_optimizer, build_schedule, lr_factor
from mgpu.run.build import build_run
from mgpu.run.config import resolved_yaml, to_config
from mgpu.runtime.dist import Runtime
from mgpu.runtime.launch import attempt_prefix, parse_launch_env, restart_hazard
from mgpu.runtime.preempt import PREEMPTED_EXIT_CODE, Preemption
from mgpu.runtime.stops import RunStopped
from mgpu.telemetry.board import TensorBoard
from mgpu.telemetry.metrics import Recorder
from mgpu.train.guard import LAG, NonFiniteGuard
from mgpu.train.trainer import Trainer

BATCH = 32  # data.batch_size's default
# gpt_tiny cut to one narrow layer: a step costs a third, and bit-for-bit resumption does not
# depend on the model's size. Its shape, for tests that give the same GPT as model=custom.
GPT = {"vocab_size": 256, "block_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 32}
MODEL = [f"model.{key}={GPT[key]}" for key in ("vocab_size", "n_layer", "n_head", "n_embd")]
RUN = [
    "trainer.max_steps=20",
    "trainer.log_every=1",  # a loss per step: the record compares step by step
    "trainer.eval_every=0",
    "ckpt.every=5",
    "data.num_workers=0",
    *MODEL,
]


def faulty(fault: str, *, rank: int, step: int, marker) -> list[str]:
    """data=ngram's samples through tests.faults.FaultyTokens, with `fault` at `step`."""
    at = first_sample_of_step(step, BATCH)
    return [
        "data=custom",
        "data._target_=tests.faults.FaultyTokens",
        f"+data.kwargs.fault={fault}",
        f"+data.kwargs.rank={rank}",
        f"+data.kwargs.at_sample={at}",
        f"+data.kwargs.marker={marker}",
        "+data.kwargs.eval_samples=64",
    ]


def output(proc) -> str:
    return proc.stdout + proc.stderr


def final_state(run_dir) -> dict:
    return torch.load(step_dir(run_dir / "checkpoints", 20) / "state.pt", weights_only=True)


def loss_record(run_dir) -> dict[int, float]:
    """train/loss by step, the last value logged for each step."""
    return dict(read_scalars(run_dir)["train/loss"])


def assert_same_run(run_dir, reference) -> None:
    """The same final model and optimizer state and the same per-step loss, bit for bit."""
    got, want = final_state(run_dir), final_state(reference)
    assert got["step"] == 20 and got["data"] == want["data"]
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for index, state in want["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][index][key], value), (index, key)
    steps = [s for s, _ in read_scalars(run_dir)["train/loss"]]
    assert steps == list(range(1, 21))  # purge_step dropped the re-run steps' first values
    assert loss_record(run_dir) == loss_record(reference)


SHARE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# How torchrun gives its workers a store to meet in (mgpu.runtime.launch.attempt_prefix): its
# agent's own, kept across its restarts, or rank 0's, new with each attempt. Plain torchrun (the
# static rendezvous) always shares the agent's, whatever the variable says (so plain torchrun
# with it set is the "plain" launch again); --standalone (c10d) shares it unless the variable
# is 1. name: (--standalone?, torchrun's environment)
LAUNCHES = {
    "plain": (False, {SHARE: "0"}),
    "standalone": (True, {SHARE: "0"}),
    "standalone-variable-set": (True, {SHARE: "1"}),
}


def run_restartable(args: list[str], cwd: Path, launch="standalone", restarts: int = 1):
    """train.py on 2 processes under torchrun allowed `restarts` restarts (the kill tests'
    launch), started as LAUNCHES[launch] says."""
    standalone, env = LAUNCHES[launch]
    rendezvous = ("--standalone",) if standalone else (f"--master-port={free_port()}",)
    return run_train(
        args,
        cwd=cwd,
        nproc=2,
        torchrun_args=(f"--max-restarts={restarts}",),
        env=env,
        rendezvous=rendezvous,
    )


def uninterrupted_run(tmp: Path, args: list[str]) -> Path:
    """A run of `args` on 2 processes with the fault hook armed but never firing (the same code
    path as the faulty runs), to compare them with."""
    run_dir = tmp / "run"
    never = faulty("kill", rank=-1, step=1, marker=tmp / "unused")
    proc = run_train([*args, *never, f"hydra.run.dir={run_dir}"], cwd=tmp, nproc=2)
    assert proc.returncode == 0, output(proc)[-3000:]
    return run_dir


def shared_reference(tmp_path_factory) -> Path:
    """The uninterrupted run of RUN: 2 processes, 20 steps, checkpoints at 5, 10, 15, 20. Made
    once for the whole test run (this file and test_two_nodes.py compare with the same run),
    and only read: the tests that change its checkpoints change copies."""
    return made_once(tmp_path_factory, "reference", lambda tmp: uninterrupted_run(tmp, RUN))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_reference(tmp_path_factory)


def kill_in_save(marker: Path) -> list[str]:
    """RUN's model as tests.faults.KillInSaveGPT, whose rank 0 SIGKILLs itself in the middle of
    the step-15 save (its own files written, the manifest not)."""
    model = ["model=custom", "model._target_=tests.faults.KillInSaveGPT"]
    model += [f"+model.kwargs.{key}={value}" for key, value in GPT.items()]  # the reference's
    model += ["+model.kwargs.at_save=3", f"+model.kwargs.marker={marker}"]  # the step-15 save
    never = faulty("kill", rank=-1, step=1, marker=marker.with_name("unused"))
    return [*(a for a in RUN if a not in MODEL), *never, *model]  # custom: no gpt_tiny keys


# Where the worker dies, for each launch: rank 1 at step 13, or rank 0 in the middle of the
# step-15 save. A restart over the agent's shared store is the same hazard wherever the kill
# came (the store outlives it), so the save's crash runs as one of the launches, not apart.
KILLS = {"plain": "step", "standalone": "save", "standalone-variable-set": "step"}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_killed_worker_restarts_and_ends_like_an_uninterrupted_run(tmp_path, reference, launch):
    # Restarted under torchrun's agent's store, the group once read the attempt before's
    # addresses: it failed to connect, or hung without a word until dist.timeout_s (here
    # 60 s, so that a hang ends within the test's limit and fails it).
    marker = tmp_path / "killed"
    if KILLS[launch] == "step":
        args, killed = [*RUN, *faulty("kill", rank=1, step=13, marker=marker)], 1
    else:
        args, killed = kill_in_save(marker), 0
    proc = run_restartable([*args, "dist.timeout_s=60"], tmp_path, launch, restarts=2)
    assert proc.returncode == 0, output(proc)[-3000:]
    assert marker.exists()  # the worker did die, at step 13 or in the save of step 15
    # The default run directory (the agent's start time) is the same after the restart.
    (run_dir,) = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    # torchrun names the first failed worker it sees: the one SIGKILLed, or the other, which
    # can exit (code 1, its peer gone from the next collective) before the agent's next look.
    # One of the two, and nothing else, failed the first attempt.
    failed = re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: (\d)", proc.stderr)
    assert failed in ([("-9", str(killed))], [("1", str(1 - killed))]), proc.stderr[-3000:]
    assert "pytorch#135712" not in output(proc)
    # A half-written step 15 never counts: the restart goes back to step 10 either way.
    assert "resumed from " + str(step_dir(run_dir / "checkpoints", 10)) in output(proc)
    assert_same_run(run_dir, reference)
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert left == ["step-00000010", "step-00000015", "step-00000020"]  # ckpt.keep_last=3
    # Goodput kept one account over both attempts: the second charged the restart (the time
    # between them and the steps after step 10 that the first trained in vain).
    attempts = json.loads((run_dir / "goodput.json").read_text())["attempts"]
    assert len(attempts) == 2
    final = {tag: values[-1][1] for tag, values in read_scalars(run_dir).items()}
    assert final["goodput/restart_s"] > 0
    parts = ("startup", "training", "eval", "checkpoint", "stall", "restart")
    total = sum(final[f"goodput/{p}_s"] for p in parts)
    assert abs(total - final["goodput/wall_s"]) < 1e-3 * final["goodput/wall_s"]
    assert final["goodput/wall_s"] >= attempts[1]["last_update"] - attempts[0]["started_at"] - 1


def test_a_job_killed_whole_resumes_when_relaunched_with_the_same_command(tmp_path, reference):
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    command = [*RUN, *faulty("kill_job", rank=1, step=13, marker=marker)]
    command += [f"hydra.run.dir={run_dir}", "dist.timeout_s=30"]
    first = run_train(command, cwd=tmp_path, nproc=2)
    assert first.returncode != 0 and marker.exists(), output(first)[-3000:]
    again = run_train(command, cwd=tmp_path, nproc=2)  # the same command, as a user reruns it
    assert again.returncode == 0, output(again)[-3000:]
    assert "resumed from " + str(step_dir(run_dir / "checkpoints", 10)) in output(again)
    assert_same_run(run_dir, reference)


def test_a_run_resumed_from_a_step_that_evaluated_trains_on_as_it_would_have(tmp_path):
    """The checkpoint of a step that also evaluates (by default every 100th does both) is saved
    before the evaluation. A world of one resumed from step 3's checkpoint of a 6-step run
    trains steps 4-6 bit for bit as that run did, dropout's masks included: the evaluation
    after the save draws from none of the generators the checkpoint carries."""
    args = ["trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=3", "ckpt.every=3"]
    args += ["data.num_workers=0", "model.dropout=0.2", *MODEL]
    whole, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    reference = run_train([*args, f"hydra.run.dir={whole}"], cwd=tmp_path, nproc=None)
    assert reference.returncode == 0, output(reference)[-3000:]
    start = step_dir(whole / "checkpoints", 3)
    again = [*args, f"ckpt.resume={start}", f"hydra.run.dir={resumed_dir}"]
    resumed = run_train(again, cwd=tmp_path, nproc=None)
    assert resumed.returncode == 0, output(resumed)[-3000:]
    assert "resumed from " + str(start) in output(resumed)
    after = {s: v for s, v in loss_record(whole).items() if s > 3}
    assert loss_record(resumed_dir) == after and sorted(after) == [4, 5, 6]
    got, want = (
        torch.load(step_dir(d / "checkpoints", 6) / "state.pt", weights_only=True)
        for d in (resumed_dir, whole)
    )
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name


def test_a_preempted_run_saves_exits_and_resumes_like_an_uninterrupted_run(tmp_path, reference):
    run_dir = tmp_path / "run"
    # Rank 0 sends SIGTERM to the torchrun agent at step 8, as a scheduler would; the agent
    # passes it on to both workers. Started again, the same command finds the marker. (The
    # signal reaching DataLoader workers and their fork server too: tests/test_run_dir.py's
    # test_a_preempted_run_with_a_worker_a_rank_saves_before_its_workers_go.)
    args = [
        *RUN,
        *faulty("term_agent", rank=0, step=8, marker=tmp_path / "m"),
        f"hydra.run.dir={run_dir}",
    ]
    first = run_train(args, cwd=tmp_path, nproc=2)
    # torchrun's own code: it was signalled itself (docs/checkpoints.md, Exit codes); rarely
    # (seen once) its own teardown aborts instead (SIGABRT, torch's message below), after the
    # workers have saved and left: torch's, not the run's.
    aborted = first.returncode == -signal.SIGABRT
    aborted = aborted and "terminate called without an active exception" in output(first)
    assert first.returncode == 1 or aborted, output(first)[-3000:]
    stopped = re.search(r"preempted \(SIGTERM\) after step (\d+): checkpoint saved", output(first))
    assert stopped, output(first)[-3000:]
    step = int(stopped.group(1))
    assert 8 <= step < 20 and (run_dir / "checkpoints" / f"step-{step:08d}").is_dir()
    for rank in (0, 1):  # every rank stopped after the same step, the one saved
        log = (run_dir / f"rank{rank}.log").read_text()
        assert f"after step {step}: checkpoint saved; exit code {PREEMPTED_EXIT_CODE}" in log
    second = run_train(args, cwd=tmp_path, nproc=2)
    assert second.returncode == 0, output(second)[-3000:]
    assert f"step {step}, epoch 0" in output(second)
    assert_same_run(run_dir, reference)


def test_sigterm_to_a_world_of_one_exits_with_the_preempted_code(tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, *faulty("term_self", rank=0, step=3, marker=tmp_path / "m")]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=None)
    assert proc.returncode == PREEMPTED_EXIT_CODE, output(proc)[-3000:]
    # One process has no one to agree with: it stops after the step the signal came in.
    assert (run_dir / "checkpoints" / "step-00000003" / "manifest.json").is_file()


def pickled(path):
    """state.pt with a shell command inside, and a manifest that matches it (a forged file)."""
    state = torch.load(path, weights_only=True)
    torch.save({**state, "payload": Shell()}, path)
    reseal(path.parent)


# Two damages, each to one of the reference's two newest checkpoints: step 20's state.pt
# bit-flipped (its manifest's checksum fails) and step 15's a forged pickle with a matching
# manifest (it verifies; torch.load(weights_only=True) refuses it). One resume meets both: it
# skips step 20, fails to load step 15, and falls back to step 10.
DAMAGES = {
    20: (bitflip, "checksum mismatch"),
    15: (pickled, "refused by torch.load(weights_only=True)"),
}


@pytest.fixture(scope="module")
def resumed_over_corrupt(tmp_path_factory, reference):
    """The reference's run directory, DAMAGES done, run again with the same command: the run
    directory, each damaged file and its bytes, and the run's output."""
    tmp = tmp_path_factory.mktemp("corrupt")
    run_dir = tmp / "run"
    shutil.copytree(reference, run_dir)
    damaged = {}
    for step, (damage, _) in DAMAGES.items():
        bad = step_dir(run_dir / "checkpoints", step) / "state.pt"
        damage(bad)
        damaged[step] = (bad, bad.read_bytes())
    never = faulty("kill", rank=-1, step=1, marker=tmp / "unused")
    proc = run_train([*RUN, *never, f"hydra.run.dir={run_dir}"], cwd=tmp, nproc=2)
    return run_dir, damaged, proc


@pytest.mark.parametrize("step", DAMAGES, ids=lambda step: DAMAGES[step][0].__name__)
def test_a_corrupt_newest_checkpoint_is_skipped_loudly(resumed_over_corrupt, reference, step):
    run_dir, damaged, proc = resumed_over_corrupt
    bad, damaged = damaged[step]
    check = DAMAGES[step][1]
    assert proc.returncode == 0, output(proc)[-3000:]
    assert f"skipping invalid checkpoint: {bad}: {check}" in output(proc)
    assert "weights_only=False" not in output(proc) and "set to `False`" not in output(proc)
    assert "resuming from an OLDER checkpoint" in output(proc)
    assert "step 10, epoch 0" in output(proc)
    assert_same_run(run_dir, reference)  # steps 15 and 20 again, this time intact
    # Invalid, whether its manifest shows it or not: kept out of the way as evidence, not
    # deleted when its step was saved again.
    (evidence,) = (run_dir / "checkpoints").glob(f"step-{step:08d}.invalid-*")
    assert (evidence / "state.pt").read_bytes() == damaged


def test_a_resume_trains_with_the_optimizer_settings_of_its_command_line(tmp_path, reference):
    """A stopped run continued with a lower optim.lr (the non-finite stop's advice), another
    weight decay and warmup: from the first resumed step the run trains with them, from the
    checkpoint's moments and step counts; the log names each change once (model.residual's too:
    it changes the arithmetic, not the weights; and the data's settings, here the batch)."""
    run_dir = tmp_path / "run"
    shutil.copytree(step_dir(reference / "checkpoints", 10), step_dir(run_dir / "checkpoints", 10))
    never = faulty("kill", rank=-1, step=1, marker=tmp_path / "unused")
    new = ["optim.lr=5e-4", "optim.weight_decay=0.05", "optim.warmup_steps=4"]
    new += ["model.residual=autocast", f"data.batch_size={BATCH // 2}"]
    proc = run_train([*RUN, *never, *new, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2)
    assert proc.returncode == 0, output(proc)[-3000:]
    said = f"resuming with settings changed from {step_dir(run_dir / 'checkpoints', 10)}: "
    said += "optim.lr 0.001 -> 0.0005, optim.weight_decay 0.1 -> 0.05, optim.warmup_steps 20 -> 4"
    said += f", model.residual fp32 -> autocast, data.batch_size {BATCH} -> {BATCH // 2}"
    assert output(proc).count(said) == 1, output(proc)[-3000:]  # once, by rank 0
    # The rate each resumed step logs is the new schedule's (linear warmup over 4 steps, then
    # cosine to 0.1 of 5e-4 at step 20), unlike the reference's at every one of those steps.
    logged = dict(read_scalars(run_dir)["train/lr"])
    old = dict(read_scalars(reference)["train/lr"])
    assert sorted(logged) == list(range(11, 21))
    for step, rate in logged.items():
        assert rate == pytest.approx(5e-4 * lr_factor(step - 1, 4, 20, 0.1), rel=1e-6), step
        assert rate != pytest.approx(old[step], rel=1e-3), step
    state = final_state(run_dir)["optimizer"]
    decayed, flat = state["param_groups"]
    assert (decayed["initial_lr"], decayed["weight_decay"], flat["weight_decay"]) == (5e-4, 0.05, 0)
    assert decayed["lr"] == pytest.approx(5e-4 * lr_factor(20, 4, 20, 0.1))
    # The moments went on from the checkpoint's: 10 updates there, 10 here.
    assert {int(s["step"]) for s in state["state"].values()} == {20}


def test_resume_on_another_world_size_sees_each_sample_once(tmp_path):
    """1 process x 16 for 6 steps, then 2 processes x 8 to the end of the epoch: 200 samples,
    12 steps of 16 per epoch, the last 8 dropped. The change is said once, by rank 0."""
    run_dir, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    data = [
        "data=custom",
        "data._target_=tests.faults.RecordingTokens",
        f"+data.kwargs.record={record}",
        "+data.kwargs.num_samples=200",
        "+data.kwargs.eval_samples=16",
        "data.num_workers=0",
        "trainer.eval_every=0",
        *MODEL,
        f"hydra.run.dir={run_dir}",
    ]
    first = run_train(
        [*data, "data.batch_size=16", "trainer.max_steps=6"], cwd=tmp_path, nproc=None
    )
    assert first.returncode == 0, output(first)[-3000:]
    second = run_train([*data, "data.batch_size=8", "trainer.max_steps=12"], cwd=tmp_path, nproc=2)
    assert second.returncode == 0, output(second)[-3000:]
    assert output(second).count("saved by 1 process(es), this run has 2") == 1, output(second)
    assert "not match an uninterrupted one bit for bit" in output(second)
    per_process = recorded(record)
    assert sorted(len(seen) for seen in per_process) == [48, 48, 96]
    seen = [i for indices in per_process for i in indices]
    assert len(seen) == len(set(seen))  # no sample twice
    assert set(seen) == set(epoch_order(200, 0, 0)[:192].tolist())  # and none skipped


def test_resume_from_a_corrupt_path_stops_and_writes_nothing(tmp_path, reference):
    source = tmp_path / "source"
    shutil.copytree(reference / "checkpoints" / "step-00000015", source)
    bitflip(source / "rank-1.pt")
    run_dir = tmp_path / "run"
    proc = run_train(
        [*RUN, f"ckpt.resume={source}", f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=None
    )
    # A stop before training, in a world of one: its reason, its code, no traceback. (A
    # refusal's code, 2, is checked under torchrun below, for a changed model.)
    assert proc.returncode == 1, output(proc)[-3000:]
    assert f"{source / 'rank-1.pt'}: checksum mismatch" in output(proc)
    assert "Traceback" not in output(proc)
    # no config, events, ckpt: only the log, and the lock file the run held (mgpu.runtime.run_lock)
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank0.log", "run.lock"]


# Resumes that cannot continue the reference run: (arguments, the reason said, the exit code).
# A checkpoint whose model, data or optimizer this run cannot continue is input that cannot
# work (2); another run's newer checkpoint in the directory, a stop (1).
REFUSED = {
    "shape": (
        ["model.n_embd=16", "ckpt.resume={ref}/checkpoints/step-00000020"],
        # the shapes are named (the torchrun twin below checks them), then how to go on
        "model.n_embd 32 -> 16. Resume with the model settings it was trained with, or train "
        "this model afresh in another run directory (hydra.run.dir=...), without ckpt.resume",
        2,
    ),
    "never-over-newer": (
        ["ckpt.resume=never"],  # in a run directory that holds the reference's step 20
        "step-00000020: a valid checkpoint newer than a fresh start (ckpt.resume=never)",
        1,
    ),
    "other-data": (
        ["data.num_samples=5000", "ckpt.resume={ref}/checkpoints/step-00000020"],
        # the reference trained on a dataset of the tests' own: its data settings all differ
        "trained on 100000 samples; this run has 5000. Resuming needs the same training set: "
        "changed since: data._target_ tests.faults.FaultyTokens -> mgpu.data.NgramTokens",
        2,
    ),
    "other-optimizer": (
        ["optim=sgd", "ckpt.resume={ref}/checkpoints/step-00000015"],
        "optim.name=sgd: {ref}/checkpoints/step-00000015 was trained with optim.name=adamw",
        2,
    ),
}


def refused_run(tmp_path, reference, name) -> tuple[list[str], Path]:
    """The command line of REFUSED[name] and its run directory, made as Hydra makes it (with
    the reference's step 20 in it for ckpt.resume=never)."""
    args, _, _ = REFUSED[name]
    run_dir = tmp_path / "run"
    if "ckpt.resume=never" in args:
        shutil.copytree(
            step_dir(reference / "checkpoints", 20), step_dir(run_dir / "checkpoints", 20)
        )
    run_dir.mkdir(exist_ok=True)
    return [*RUN, "data.eval_samples=64", *(a.format(ref=reference) for a in args)], run_dir


@pytest.mark.parametrize("name", REFUSED)
def test_resume_that_cannot_continue_the_run_stops_with_the_reason(tmp_path, reference, name):
    """The stop the run's start (build_run) raises, in this process as a world of one (as
    `python train.py` is): its reason and its exit code. Launches check that train.py ends
    with them: a changed model's under torchrun (below), a corrupt checkpoint's alone."""
    args, run_dir = refused_run(tmp_path, reference, name)
    _, message, code = REFUSED[name]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=args)
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    with pytest.raises(RunStopped) as err:
        build_run(to_config(dcfg), rt, run_dir, resolved_yaml(dcfg))
    assert err.value.exit_code == code, err.value.report()
    assert message.format(ref=reference) in err.value.report()


def files_of(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes, but the rank logs and the lock file, which
    every launch writes (a refused one too)."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and not p.name.endswith(".log") and p.name != "run.lock"
    }


def test_a_resume_refused_for_a_changed_model_says_so_in_one_line_and_changes_nothing(
    tmp_path, reference
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = files_of(run_dir)
    never = faulty("kill", rank=-1, step=1, marker=tmp_path / "unused")
    wider = [a for a in RUN if not a.startswith("model.n_embd=")] + ["model.n_embd=64"]
    proc = run_train([*wider, *never, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2)
    # every worker's exit code 2 (torchrun's own is 1, with its summary)
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)) == {"2"}, output(proc)[-3000:]
    said = [line for line in said_lines(proc) if "the model does not match" in line]
    assert len(said) == 1, output(proc)[-3000:]  # once, by rank 0, in one line
    newest = step_dir(run_dir / "checkpoints", 20)
    assert f"does not match {newest}: " in said[0]
    assert "wte.weight [256, 32] in the checkpoint, [256, 64] in the model" in said[0]
    assert "more parameters differ" in said[0] and "model.n_embd 32 -> 64" in said[0]
    assert said[0].endswith("afresh in another run directory (hydra.run.dir=...)"), said[0]
    assert len(said[0].replace(str(newest), "")) < 400, said[0]  # the path named once
    assert output(proc).count("Traceback") == 1, output(proc)[-3000:]  # torchrun's summary only
    # config.yaml, goodput.json, the event files and the checkpoints as they were, none added
    assert files_of(run_dir) == before


def test_a_resume_past_trainer_max_steps_is_refused_in_one_line_and_changes_nothing(
    tmp_path, reference
):
    """trainer.max_steps below the newest checkpoint's step: not "done" with exit 0 (no
    checkpoint of the step asked for exists) but exit 2, the way on said, nothing written."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = files_of(run_dir)
    shorter = [a for a in RUN if not a.startswith("trainer.max_steps=")] + ["trainer.max_steps=12"]
    proc = run_train([*shorter, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=None)
    assert proc.returncode == 2, output(proc)[-3000:]
    (said,) = [line for line in said_lines(proc) if "trainer.max_steps=12" in line]
    newest = step_dir(run_dir / "checkpoints", 20)
    assert f"{newest} is at step 20, past it" in said and "above 20" in said, said
    assert "Traceback" not in output(proc)
    assert files_of(run_dir) == before  # config.yaml too: still the run's own max_steps
    # At the checkpoint's step: exit 0, but said aloud that nothing was trained (a second run
    # in a directory already trained, as one SLURM job's directory is, would seem to have run).
    again = run_train([*RUN, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=None)
    assert again.returncode == 0, output(again)[-3000:]
    (said,) = [line for line in said_lines(again) if "nothing left to train" in line]
    assert "WARNING" in said and "RUN_ID=NAME" in said and "ckpt.resume=never" in said, said


def run_with_a_hung_rank(tmp_path, *settings: str, step: int = 3) -> str:
    """Rank 1 stops for good in its loader at `step`; the run's output. Which clock ended the
    run is told by what it said, not by how long it took (a loaded machine is slow)."""
    hang = faulty("hang", rank=1, step=step, marker=tmp_path / "m")
    proc = run_train([*RUN, *hang, *settings], cwd=tmp_path, nproc=2, timeout=240)
    assert proc.returncode != 0
    assert os.path.exists(tmp_path / "m")
    return output(proc)


def test_a_hung_rank_fails_the_run_after_dist_timeout_s_naming_it(tmp_path):
    text = run_with_a_hung_rank(tmp_path, "dist.timeout_s=5", "trainer.stall_timeout_s=0")
    # The step the loop was at: the loader fetches ahead of it.
    said = r"rank 0: a collective timed out \(dist.timeout_s\) in step \d+, forward/backward"
    assert re.search(said, text), text[-3000:]
    assert re.search(r"lagging: rank 1; rank 1: step \d+, data loading", text), text[-3000:]
    assert "Timed out waiting 5000ms" in text  # what the backend said, quoted


def test_a_loader_that_never_yields_ends_the_run_after_stall_timeout_s(tmp_path):
    settings = ("dist.timeout_s=300", "trainer.stall_timeout_s=4")
    text = run_with_a_hung_rank(tmp_path, *settings)
    said = r"rank 1: no progress for \d+ s .* in step \d+, data loading"
    assert re.search(said, text), text[-3000:]
    assert "lagging: rank 1" in text


def test_a_rank_stuck_in_its_first_batch_is_the_one_named(tmp_path):
    """The first batch is read and agreed on before the loop (a GPU's prefetcher reads three
    batches there, so a loader stuck at step 3 is stuck in it): the rank still reading is named
    as lagging, not both, though neither has begun a step."""
    settings = ("dist.timeout_s=300", "trainer.stall_timeout_s=4")
    text = run_with_a_hung_rank(tmp_path, *settings, step=1)
    said = r"rank 1: no progress for \d+ s .* in step 1, data loading"
    assert re.search(said, text), text[-3000:]
    assert re.search(r"lagging: rank 1; rank 1: step 1, data loading", text), text[-3000:]


def stalled_alone(tmp_path, step: int, settings: list[str]) -> tuple[list[tuple[str, str]], str]:
    """A world of one whose loader hangs at `step` under a 1-s stall clock: where each stall
    report said it stopped (step, phase), and the run's output."""
    hang = faulty("hang", rank=0, step=step, marker=tmp_path / "m")
    settings = [*settings, "trainer.stall_timeout_s=1", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_train([*RUN, *hang, *settings], cwd=tmp_path, nproc=None, timeout=240)
    text = output(proc)
    assert proc.returncode != 0 and os.path.exists(tmp_path / "m"), text[-3000:]
    said = r"rank 0: no progress for \d+ s \(trainer.stall_timeout_s=1\) in step (\d+), (.+?)[.:]"
    return re.findall(said, text), text


def test_a_compiled_runs_first_step_is_not_timed_by_the_stall_clock(tmp_path):
    """The first step of a compiled run compiles (here ~2.5 s on one idle core, the stall clock
    at 1 s; minutes for a large model): not a stall. The clock runs again after it and finds
    the loader that never yields at step 3."""
    settings = ["trainer.compile=true", "trainer.compile_backend=aot_eager"]
    stops, text = stalled_alone(tmp_path, 3, settings)
    assert stops == [("3", "data loading")], text[-3000:]


def test_a_compiled_models_first_evaluation_is_not_timed_by_the_stall_clock(tmp_path):
    """The first evaluation of a compiled model compiles it again (eval mode, no grad), each
    rank for its own input shapes: 65 eval samples over 2 ranks in batches of 32 give rank 0 two
    compiles (2.5 s each, tests.faults.slow_compile) under a 1-s stall clock, and rank 1 one,
    after which it waits for rank 0 in the loss sum: neither is a stall."""
    never = faulty("hang", rank=0, step=10_000, marker=tmp_path / "m")  # imports slow_compile
    settings = ["trainer.compile=true", "trainer.compile_backend=slow_compile"]
    settings += ["trainer.max_steps=2", "trainer.eval_every=2", "ckpt.every=0"]
    settings += ["data.kwargs.eval_samples=65", "trainer.stall_timeout_s=1"]
    command = [*RUN, *never, *settings, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_train(command, cwd=tmp_path, nproc=2, timeout=240)
    text = output(proc)
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"step 2/2 \| eval loss", text), text[-3000:]
    compiles = re.findall(r"evaluation compiles the model for input shape \((\d+),", text)
    assert compiles == ["32", "1"], text[-3000:]  # rank 0's (rank 1's are not logged)


def test_an_evaluation_loader_that_never_yields_is_named_as_such(tmp_path):
    """The stall clock's report names the phase: an evaluation's batch that never comes is its
    data loading (its workers start with each evaluation), not the logging before it. The
    checkpoint of the step it evaluates was saved before it: the failed evaluation loses no
    step trained."""
    settings = ["+data.kwargs.in_split=eval", "trainer.eval_every=2", "ckpt.every=2"]
    stops, text = stalled_alone(tmp_path, 1, settings)  # step 1's first sample: eval's first
    assert stops == [("2", "evaluation's data loading")], text[-3000:]
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved == ["step-00000002"], (saved, text[-3000:])


# ---- the pieces: signal agreement, restart hazard ----


def preemption_worker(rank: int, port: int, out: str):
    """The step's one agreement (NonFiniteGuard.check) carrying the preemption flag, for ranks
    that share their parameters (agree=True) and ranks that train apart (agree=False: only the
    preemption slot is agreed). Rank 0's loss is NaN at step 2 (trainer.nonfinite=skip)."""
    before = signal.getsignal(signal.SIGUSR1)
    results = {}
    with gloo_runtime(rank, port, 2) as rt:
        with Preemption(rt) as preemption:
            for agree in (True, False):
                guard = NonFiniteGuard(
                    NonFinite.skip, 5, rt, scaler_owns_grads=False, agree=agree, preemptible=True
                )
                decisions = []
                for step in range(1, 8):
                    if rank == 1 and step == 3 and agree:
                        os.kill(os.getpid(), signal.SIGUSR1)  # before step 3's update, rank 1
                    loss = torch.tensor(float("nan") if rank == 0 and step == 2 else 1.0)
                    guard.check(step, loss, [], None, preemption.asked)
                    guard.poll()
                    decisions.append(guard.stop != 0)
                guard.settle()
                results[agree] = {"decisions": decisions, "skipped": guard.skipped}
        results["restored"] = signal.getsignal(signal.SIGUSR1) is before
        results["signum"] = preemption.signum
        torch.save(results, f"{out}/{rank}.pt")


def test_every_rank_stops_after_the_same_step_whichever_rank_got_the_signal(tmp_path):
    spawn(preemption_worker, free_port(), str(tmp_path), nprocs=2)
    results = [torch.load(tmp_path / f"{rank}.pt", weights_only=True) for rank in (0, 1)]
    for rank, result in enumerate(results):
        # step 3's exchange carries the flag; every rank reads it LAG steps later
        assert result[True]["decisions"] == [False] * (3 + LAG - 1) + [True] * (7 - 3 - LAG + 1)
        # Ranks that train apart still agree on preemption (the flag stays up from step 1 on)
        assert result[False]["decisions"] == [False] * LAG + [True] * (7 - LAG)
        assert result[True]["skipped"] == 1  # rank 0's NaN loss: skipped on both ranks
        assert result[False]["skipped"] == (1 if rank == 0 else 0)  # rank 0's own verdict only
        assert result["restored"]  # the previous handler is back after the with-block
    assert [r["signum"] for r in results] == [None, int(signal.SIGUSR1)]


def test_restarts_over_the_agents_shared_store_are_flagged_on_several_nodes_only():
    env = {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    launch = parse_launch_env(env)
    assert (launch.restart_count, launch.max_restarts, launch.shared_store) == (1, 2, True)
    # Each node counts its own restarts: the nodes' counts may differ, and the keys with them.
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_hazard(launch)
    assert attempt_prefix(launch) == "mgpu/attempt-1"
    # One node: one count, which names every attempt (tests/test_rendezvous.py)
    assert restart_hazard(parse_launch_env({**env, "GROUP_WORLD_SIZE": "1"})) is None
    own = parse_launch_env({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert restart_hazard(own) is None
    assert attempt_prefix(own) == "mgpu"  # rank 0's store, new with every attempt
    assert restart_hazard(parse_launch_env({**env, "TORCHELASTIC_MAX_RESTARTS": "0"})) is None
    assert parse_launch_env({}).restart_count == 0


def test_a_failed_periodic_save_is_logged_and_training_goes_on(tmp_path, monkeypatch, caplog):
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    model = MLP(in_features=8, num_classes=5, hidden=[16])
    optimizer = build_optimizer(OptimConfig(), model, rt.device)
    schedule = build_schedule(OptimConfig(), optimizer, max_steps=10)
    root = tmp_path / "checkpoints"
    plan = CheckpointPlan(root, every=1, keep_last=3, token="t", config="trainer: {}\n")
    tcfg = TrainerConfig(precision=Precision.fp32, grad_accum_steps=2)
    checkpointer = Checkpointer(plan, rt, seed=0, loaded=None)
    trainer = Trainer(tcfg, model, optimizer, schedule, rt, checkpointer=checkpointer)
    data = TensorDataset(torch.randn(40, 8), torch.randint(0, 5, (40,)))
    sampler = ShardedSampler(40, 0, 1, shuffle=True, seed=0, even=True)
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    no_space(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mgpu.ckpt.resume"):
        assert trainer.save(2, loader, required=False) is None  # before any checkpoint
    assert f"training goes on; no checkpoint in {root} yet" in caplog.text
    monkeypatch.undo()
    caplog.clear()
    assert trainer.save(3, loader, required=False) == step_dir(root, 3)
    # 3 steps x 2 micro-batches x 4 samples: 24 of epoch 0's 40; the config text rides along
    shared = load(step_dir(root, 3), rank=0).shared
    assert shared["data"]["consumed"] == 24 and shared["config"] == "trainer: {}\n"
    no_space(monkeypatch)
    with caplog.at_level(logging.INFO, logger="mgpu.train.trainer"):
        assert trainer.save(4, loader, required=False) is None
    assert "checkpoint at step 4 failed on rank 0" in caplog.text
    assert "No space left on device" in caplog.text
    assert f"training goes on; {step_dir(root, 3)} stays the newest checkpoint" in caplog.text
    with pytest.raises(CheckpointError, match="step-00000005: not saved"):
        trainer.save(5, loader, required=True)  # final or preemption: stops the run
    assert find_latest_valid(root) == (step_dir(root, 3), [])
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]


def small_trainer(rt, steps: int, seed: int) -> tuple[Trainer, DataLoader]:
    torch.manual_seed(seed)
    model = MLP(in_features=8, num_classes=5, hidden=[16])
    optimizer = build_optimizer(OptimConfig(warmup_steps=2), model, rt.device)
    schedule = build_schedule(OptimConfig(warmup_steps=2), optimizer, max_steps=steps)
    tcfg = TrainerConfig(
        precision=Precision.fp32, grad_accum_steps=2, max_steps=steps, log_every=2, eval_every=0
    )
    recorder = Recorder(rt, TensorBoard(Path("."), enabled=False), samples_per_step=8,
                        tokens_per_sample=None, max_steps=steps)  # fmt: skip
    trainer = Trainer(tcfg, model, optimizer, schedule, rt, recorder=recorder)
    torch.manual_seed(0)  # the same data for every trainer
    data = TensorDataset(torch.randn(40, 8), torch.randint(0, 5, (40,)))
    sampler = ShardedSampler(40, 0, 1, shuffle=True, seed=0, even=True)
    return trainer, DataLoader(data, batch_size=4, sampler=sampler)


def test_a_trainers_state_dict_continues_another_trainer_bit_for_bit():
    """Trainer.state_dict() after 3 of 7 steps, loaded into a trainer with other weights,
    continues to the same parameters as 7 uninterrupted steps (the data from its cursor)."""
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    whole, loader = small_trainer(rt, 7, seed=0)
    whole.fit(loader, None)
    first, loader = small_trainer(rt, 7, seed=0)
    first.cfg.max_steps = 3
    first.fit(loader, None)
    state = first.state_dict()
    # 3 steps x 2 micro-batches x 4 samples: 24 of epoch 0's 40
    assert state["step"] == 3 and state["data"]["consumed"] == 24 and "config" not in state
    second, loader = small_trainer(rt, 7, seed=1)
    second.load_state_dict(state)
    assert (second.start_step, second.start_cursor.consumed) == (3, 24)
    second.fit(loader, None)
    for a, b in zip(whole.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert whole.state_dict()["data"] == second.state_dict()["data"]
