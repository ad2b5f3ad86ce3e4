"""Checkpoints: a bit-exact round trip of everything training depends on, errors that name the
file and the failed check, atomic saves that leave the previous checkpoint intact, pruning,
weights_only loading, per-rank files written by real processes, and the data cursor that
resumes on any number of processes with no sample repeated or skipped."""

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from conftest import ROOT, free_port, gloo_runtime, spawn
from torch.utils.data import DataLoader, TensorDataset

from mgpu.ckpt import checkpoint as ckpt
from mgpu.ckpt import write as ckpt_write
from mgpu.ckpt.checkpoint import CheckpointError, find_latest_valid, load, step_dir, verify
from mgpu.ckpt.resume import resolve_resume
from mgpu.ckpt.state import (
    CheckpointMismatch,
    capture_rng,
    restore_model,
    restore_optimizer,
    restore_rng,
    restore_training_state,
    training_state,
)
from mgpu.ckpt.write import finalize, prune, write_rank_files
from mgpu.config.checks import ConfigError
from mgpu.config.schema import CheckpointConfig, OptimConfig, OptimizerName
from mgpu.data.sampler import (
    DataCursor,
    ShardedSampler,
    advance,
    epoch_order,
    epochs,
    remaining_indices,
)
from mgpu.models import MLP
from mgpu.optim.optimizer import build_optimizer, build_schedule, lr_factor

CPU = torch.device("cpu")


def save(root, step, shared, rank_states, token="t"):
    """One save as phase 2 sequences it, in one process: every rank's files, then rank 0's."""
    for rank, state in enumerate(rank_states):
        write_rank_files(root, step, rank, state, token=token)
    return finalize(root, step, len(rank_states), shared, token=token)


def small(root, step, token="t"):
    shared = {"step": step, "w": torch.arange(4000.0) + step}
    return save(root, step, shared, [{"rng": capture_rng(CPU)}], token=token)


# ---- round trip ----


def build(seed, device, ocfg=None):
    torch.manual_seed(seed)
    model = MLP(in_features=8, num_classes=5, hidden=[16], dropout=0.3).to(device)
    ocfg = ocfg or OptimConfig(lr=0.01, warmup_steps=3)
    opt = build_optimizer(ocfg, model, device)  # fused AdamW on CUDA
    sched = build_schedule(ocfg, opt, max_steps=10)
    # growth_interval=2: the scale changes during the test, so its state matters
    scaler = torch.amp.GradScaler(device.type, growth_interval=2)
    gen = torch.Generator().manual_seed(seed + 1)  # stands in for the DataLoader's generator
    return SimpleNamespace(model=model, opt=opt, sched=sched, scaler=scaler, gen=gen, dev=device)


def train_step(t):
    """A step that draws from every RNG a checkpoint must carry."""
    x = torch.randn(4, 8) * float(1 + np.random.rand()) + random.random()
    x = (x + torch.rand(1, generator=t.gen)).to(t.dev)
    y = torch.randint(0, 5, (4,), device=t.dev)  # the CUDA generator, on CUDA
    loss = F.cross_entropy(t.model(x), y)  # dropout draws too
    t.scaler.scale(loss).backward()
    t.scaler.step(t.opt)
    t.scaler.update()
    t.opt.zero_grad(set_to_none=True)
    t.sched.step()
    return loss.detach()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_round_trip_continues_bit_exactly(tmp_path, device):
    dev = torch.device(device, torch.cuda.device_count() - 1) if device == "cuda" else CPU
    random.seed(0)
    np.random.seed(0)
    a = build(0, dev)
    for _ in range(3):
        train_step(a)
    cursor = DataCursor(seed=0, epoch=1, consumed=24, num_samples=100)
    shared = training_state(
        model=a.model, optimizer=a.opt, schedule=a.sched, scaler=a.scaler, step=3,
        cursor=cursor, config="trainer:\n  seed: 0\n",
    )  # fmt: skip
    path = save(tmp_path, 3, shared, [{"rng": capture_rng(dev, {"loader": a.gen})}])
    expected = [train_step(a) for _ in range(3)]
    expected_draws = (random.random(), np.random.rand(), torch.rand(2, device=dev))

    random.seed(99), np.random.seed(99)
    b = build(1, dev)  # other weights, other RNG: everything must come from the checkpoint
    loaded = load(path, rank=0, map_location=dev)
    step, got_cursor = restore_training_state(
        loaded.shared, model=b.model, optimizer=b.opt, schedule=b.sched, scaler=b.scaler
    )
    restore_rng(loaded.rank_state["rng"], dev, {"loader": b.gen})
    assert (step, got_cursor, loaded.shared["config"]) == (3, cursor, "trainer:\n  seed: 0\n")
    assert loaded.shared["model"]["net.0.weight"].device == dev
    got = [train_step(b) for _ in range(3)]

    assert all(torch.equal(x, y) for x, y in zip(got, expected, strict=True))
    b_params = b.model.state_dict()
    for name, x in a.model.state_dict().items():
        assert torch.equal(x, b_params[name]), name
    for sa, sb in zip(a.opt.state.values(), b.opt.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.sched.get_last_lr() == b.sched.get_last_lr()
    assert a.scaler.state_dict() == b.scaler.state_dict()
    assert a.scaler.get_scale() != 65536.0  # the scale did grow: its state was exercised
    got_draws = (random.random(), np.random.rand(), torch.rand(2, device=dev))
    assert got_draws[:2] == expected_draws[:2] and torch.equal(got_draws[2], expected_draws[2])


def test_a_restore_keeps_this_runs_settings_and_the_checkpoints_moments():
    """Built from a new config, the optimizer and schedule take the checkpoint's moments and
    step counts and keep their own hyperparameters: the next rate is the new optim.lr's."""
    a = build(0, CPU)  # lr 0.01, warmup 3
    for _ in range(3):
        train_step(a)
    cursor = DataCursor(seed=0, epoch=0, consumed=12, num_samples=100)
    shared = training_state(
        model=a.model, optimizer=a.opt, schedule=a.sched, scaler=a.scaler, step=3, cursor=cursor
    )
    new = OptimConfig(lr=0.02, weight_decay=0.05, betas=[0.8, 0.9], eps=1e-6, warmup_steps=2)
    b = build(1, CPU, new)
    restore_training_state(
        shared, model=b.model, optimizer=b.opt, schedule=b.sched, scaler=b.scaler
    )
    decayed, flat = b.opt.param_groups
    assert decayed["lr"] == 0.02 * lr_factor(3, 2, 10, 0.1) == b.sched.get_last_lr()[0]
    assert (decayed["weight_decay"], flat["weight_decay"]) == (0.05, 0.0)
    assert (decayed["betas"], decayed["eps"], decayed["initial_lr"]) == ((0.8, 0.9), 1e-6, 0.02)
    for sa, sb in zip(a.opt.state.values(), b.opt.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)  # moments and step counts
    train_step(b)
    assert b.sched.get_last_lr()[0] == decayed["lr"] == 0.02 * lr_factor(4, 2, 10, 0.1)


def test_momentum_turned_on_at_a_restore_starts_from_zero_buffers():
    a = build(0, CPU, OptimConfig(name=OptimizerName.sgd, lr=0.1, momentum=0.0))
    train_step(a)
    cursor = DataCursor(seed=0, epoch=0, consumed=4, num_samples=100)
    shared = training_state(
        model=a.model, optimizer=a.opt, schedule=a.sched, scaler=a.scaler, step=1, cursor=cursor
    )
    assert not any(shared["optimizer"]["state"].values())  # no momentum, no buffers
    b = build(1, CPU, OptimConfig(name=OptimizerName.sgd, lr=0.1, momentum=0.9))
    restore_training_state(
        shared, model=b.model, optimizer=b.opt, schedule=b.sched, scaler=b.scaler
    )
    params = [p for g in b.opt.param_groups for p in g["params"]]
    assert all(b.opt.param_groups[g]["momentum"] == 0.9 for g in (0, 1))
    # A skipped first step would leave buffers the fused kernel creates uninitialised.
    assert all(torch.equal(b.opt.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in params)


@pytest.mark.gpu
def test_cuda_rng_state_is_this_devices_and_loads_to_cpu(tmp_path):
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    # What GPU 0 holds already: tests run before this one in the same process (a pytest
    # worker runs several files) may have left their own tensors there.
    on_gpu0 = torch.cuda.memory_allocated(0)
    with torch.cuda.device(dev):
        torch.cuda.manual_seed(3)
        state = capture_rng(dev)
        expected = torch.rand(4, device=dev)
        path = save(tmp_path, 1, {"w": torch.arange(3.0, device=dev)}, [{"rng": state}])
        torch.rand(10, device=dev)
        loaded = load(path, rank=0, map_location=dev)
        assert loaded.rank_state["rng"]["cuda"].device == CPU  # set_rng_state needs CPU bytes
        restore_rng(loaded.rank_state["rng"], dev)
        assert torch.equal(torch.rand(4, device=dev), expected)
    if dev.index > 0:  # with several GPUs: nothing of this landed on GPU 0
        assert torch.cuda.memory_allocated(0) <= on_gpu0  # nothing new (older may be freed)


# ---- corruption ----


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def empty(path):
    path.write_bytes(b"")


def bitflip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def garble(path):
    path.write_text('{"version": 1, "files": [')


@pytest.mark.parametrize(
    "name, damage, check",
    [
        ("state.pt", truncate, "truncated"),
        ("rank-0.pt", empty, "empty file"),
        ("state.pt", bitflip, "checksum mismatch"),
        ("rank-0.pt", bitflip, "checksum mismatch"),
        ("manifest.json", os.remove, "missing manifest"),
        ("manifest.json", garble, "unreadable manifest"),
        ("state.pt", os.remove, "missing file"),
    ],
)
def test_damaged_checkpoint_names_the_file_and_the_check(tmp_path, name, damage, check):
    path = small(tmp_path, 1)
    damage(path / name)
    for attempt in (lambda: verify(path), lambda: load(path, rank=0)):
        with pytest.raises(CheckpointError) as info:
            attempt()
        assert info.value.file == path / name and check in info.value.check
        assert str(path / name) in str(info.value)


def test_auto_resumes_from_the_newest_valid_checkpoint_and_warns(tmp_path, caplog):
    for step in (1, 2, 3):
        small(tmp_path, step)
    bitflip(step_dir(tmp_path, 3) / "state.pt")
    os.remove(step_dir(tmp_path, 2) / "manifest.json")
    (tmp_path / "step-00000004.tmp-dead").mkdir()  # a crashed save is not a checkpoint
    with caplog.at_level(logging.WARNING, logger="mgpu.ckpt.checkpoint"):
        assert resolve_resume("auto", tmp_path) == step_dir(tmp_path, 1)
    text = caplog.text
    assert "step-00000003/state.pt: checksum mismatch" in text
    assert "step-00000002/manifest.json: missing manifest" in text and "OLDER" in text
    assert resolve_resume("never", tmp_path / "nothing") is None
    # the newer ones are invalid: they do not count as another run's history
    assert resolve_resume(str(step_dir(tmp_path, 1)), tmp_path) == step_dir(tmp_path, 1)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        resolve_resume(str(step_dir(tmp_path, 3)), tmp_path)
    assert resolve_resume("auto", tmp_path / "nothing") is None


def test_resume_from_a_run_directory_takes_its_newest_valid_checkpoint(tmp_path):
    """ckpt.resume=RUN_DIR, as the after-training commands take a run directory."""
    run = tmp_path / "run"
    for step in (1, 2):
        small(run / "checkpoints", step)
    bitflip(step_dir(run / "checkpoints", 2) / "state.pt")
    here = tmp_path / "new" / "checkpoints"
    for setting in (run, run / "checkpoints"):
        assert resolve_resume(str(setting), here) == step_dir(run / "checkpoints", 1)
    bitflip(step_dir(run / "checkpoints", 1) / "state.pt")
    with pytest.raises(CheckpointError, match="holds checkpoints but none is valid"):
        resolve_resume(str(run), here)
    CheckpointConfig(resume=str(run))  # a run directory is a valid setting
    (tmp_path / "new").mkdir()
    with pytest.raises(ConfigError, match="no checkpoints/"):
        CheckpointConfig(resume=str(tmp_path / "new"))  # holds no checkpoints/ yet


def test_a_start_below_a_valid_newer_checkpoint_is_refused_unless_restarted(tmp_path):
    """A fresh start, or a path older than what the run directory holds, would mix two
    histories; after a torchrun restart the newest one there is this launch's own."""
    other = tmp_path / "other"
    small(other, 1)
    for step in (2, 3):
        small(tmp_path, step)
    with pytest.raises(CheckpointError, match="newer than a fresh start") as info:
        resolve_resume("never", tmp_path)
    assert info.value.file == step_dir(tmp_path, 3)
    with pytest.raises(CheckpointError, match="newer than resuming from"):
        resolve_resume(str(step_dir(other, 1)), tmp_path)
    with pytest.raises(CheckpointError, match="step-00000003: a valid checkpoint newer"):
        resolve_resume(str(step_dir(tmp_path, 2)), tmp_path)  # going back: move 3 away first
    assert resolve_resume(str(step_dir(tmp_path, 3)), tmp_path) == step_dir(tmp_path, 3)
    for setting in ("never", str(step_dir(other, 1)), "auto"):
        assert resolve_resume(setting, tmp_path, restarted=True) == step_dir(tmp_path, 3)
    empty = tmp_path / "empty"
    assert resolve_resume(str(step_dir(other, 1)), empty, restarted=True) == step_dir(other, 1)
    assert resolve_resume("never", empty, restarted=True) is None


# ---- failed saves ----


class FullDisk:
    """A binary file that fails with ENOSPC once `room` bytes are written, as a full disk does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def no_space(monkeypatch, room=100):
    """Every binary write of the checkpoint module hits a full disk after `room` bytes."""

    def fake_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return FullDisk(f, room) if mode == "wb" else f

    monkeypatch.setattr(ckpt_write, "open", fake_open, raising=False)


def test_failed_shared_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    small(tmp_path, 1)
    write_rank_files(tmp_path, 2, 0, {"rng": capture_rng(CPU)}, token="t")
    no_space(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        finalize(tmp_path, 2, 1, {"w": torch.zeros(10_000)}, token="t")
    message = str(info.value)
    assert str(step_dir(tmp_path, 2)) in message and "No space left on device" in message
    assert f"{step_dir(tmp_path, 1)} is intact" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    assert find_latest_valid(tmp_path) == (step_dir(tmp_path, 1), [])
    assert torch.equal(load(step_dir(tmp_path, 1), rank=0).shared["w"], torch.arange(4000.0) + 1)


def test_failed_rank_write_removes_its_file(tmp_path, monkeypatch):
    small(tmp_path, 1)
    no_space(monkeypatch, room=0)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        write_rank_files(tmp_path, 2, 0, {"rng": capture_rng(CPU)}, token="t")
    assert info.value.file == tmp_path / "step-00000002.tmp-t" / "rank-0.pt"
    assert not info.value.file.exists()
    ckpt_write.abort(tmp_path, 2, token="t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_unloadable_objects_are_refused_at_save_time(tmp_path):
    with pytest.raises(TypeError, match=r"shared state\['cursor'\] is a numpy.ndarray"):
        finalize(tmp_path, 1, 0, {"cursor": np.zeros(3)}, token="t")


def test_a_same_step_checkpoint_is_replaced_after_the_new_one_verified(tmp_path):
    small(tmp_path, 2, token="a")
    save(tmp_path, 2, {"w": torch.ones(3)}, [{}], token="b")
    assert torch.equal(load(step_dir(tmp_path, 2), rank=0).shared["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]


def test_an_invalid_checkpoint_saved_over_is_kept_as_evidence(tmp_path):
    small(tmp_path, 1, token="a")
    small(tmp_path, 2, token="a")
    bitflip(step_dir(tmp_path, 2) / "state.pt")
    damaged = (step_dir(tmp_path, 2) / "state.pt").read_bytes()
    save(tmp_path, 2, {"w": torch.ones(3)}, [{}], token="b")  # the step trained again
    assert torch.equal(load(step_dir(tmp_path, 2), rank=0).shared["w"], torch.ones(3))
    evidence = tmp_path / "step-00000002.invalid-b"
    assert (evidence / "state.pt").read_bytes() == damaged
    prune(tmp_path, keep_last=1)  # neither a checkpoint nor a crashed save: it stays
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step-00000002", "step-00000002.invalid-b"]
    assert find_latest_valid(tmp_path) == (step_dir(tmp_path, 2), [])


# ---- pruning ----


def test_prune_keeps_the_newest_valid_and_sweeps_crashed_saves(tmp_path):
    for step in range(1, 6):
        small(tmp_path, step)
    os.remove(step_dir(tmp_path, 2) / "rank-0.pt")  # invalid: left as evidence, not counted
    for name in ("step-00000003.tmp-dead", "step-00000001.old-9", "step-00000009.tmp-live"):
        (tmp_path / name).mkdir()
    removed = prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == [
        "step-00000001",
        "step-00000001.old-9",
        "step-00000003",
        "step-00000003.tmp-dead",
    ]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step-00000002", "step-00000004", "step-00000005", "step-00000009.tmp-live"]
    with pytest.raises(ValueError, match="keep_last=0"):
        prune(tmp_path, keep_last=0)


# ---- mismatches ----


def test_model_and_optimizer_mismatch_name_the_keys():
    torch.manual_seed(0)
    saved = MLP(in_features=8, num_classes=5, hidden=[16])
    opt = build_optimizer(OptimConfig(), saved, CPU)
    saved(torch.randn(2, 8)).sum().backward()
    opt.step()
    wider = MLP(in_features=8, num_classes=5, hidden=[32])
    with pytest.raises(CheckpointMismatch) as info:
        restore_model(wider, saved.state_dict(), source="step-00000001")
    assert "net.0.weight [16, 8] in step-00000001, [32, 8] in the model" in str(info.value)
    deeper = MLP(in_features=8, num_classes=5, hidden=[16, 16])
    with pytest.raises(CheckpointMismatch) as info:
        restore_model(deeper, saved.state_dict())
    assert "missing from the checkpoint: net.6.weight, net.6.bias" in str(info.value)
    wider_opt = build_optimizer(OptimConfig(), wider, CPU)
    with pytest.raises(CheckpointMismatch) as info:
        restore_optimizer(wider_opt, opt.state_dict(), model=wider)
    assert "net.0.weight: exp_avg [16, 8] in checkpoint, parameter [32, 8]" in str(info.value)
    with pytest.raises(CheckpointMismatch, match="group 0: 2 parameters in checkpoint, 3"):
        restore_optimizer(build_optimizer(OptimConfig(), deeper, CPU), opt.state_dict())


# ---- weights_only ----

UNPICKLED = []


def _ran_on_load():
    UNPICKLED.append(True)
    return "arbitrary code ran"


class Payload:
    def __reduce__(self):
        return (_ran_on_load, ())


class Shell:
    """What an attack puts in a file: a shell command (a module torch blocks outright)."""

    def __reduce__(self):
        return (os.system, ("true",))


def _raw_pickle(path):
    path.write_bytes(pickle.dumps({"step": 1}, protocol=4))  # not torch.save's format


@pytest.mark.parametrize(
    "write, reason",
    [
        (lambda p: torch.save({"step": 1, "payload": Payload()}, p), "Unsupported global"),
        (lambda p: torch.save({"step": 1, "payload": Shell()}, p), "whose module posix is"),
        (_raw_pickle, "Unsupported operand"),
    ],
    ids=["unknown-global", "blocked-module", "raw-pickle"],
)
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_pickled_object_is_refused_without_fallback(tmp_path, write, reason):
    path = small(tmp_path, 1)
    # A well-formed checkpoint whose state.pt holds an arbitrary object, with a manifest that
    # matches it: only weights_only loading stands between the file and code execution.
    write(path / "state.pt")
    reseal(path)
    verify(path)
    with pytest.raises(CheckpointError) as info:
        load(path, rank=0)
    assert info.value.file == path / "state.pt"
    assert "refused by torch.load(weights_only=True)" in info.value.check
    assert reason in info.value.check, info.value.check
    # torch's advice to load the file unsafely, in any of its wordings, is never shown.
    assert "False" not in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not UNPICKLED


def reseal(path):
    """Make the manifest of checkpoint `path` match its state.pt again, as a forger would."""
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "state.pt").read_bytes()
    manifest["files"][0].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (path / "manifest.json").write_text(json.dumps(manifest))


# ---- real processes: one file per rank ----

TOKEN = "launch-1"


def draws(gen):
    return {
        "python": [random.random() for _ in range(3)],
        "numpy": torch.from_numpy(np.random.rand(3)),
        "torch": torch.rand(3),
        "loader": torch.rand(3, generator=gen),
    }


def test_ctrl_c_while_a_save_verifies_keeps_the_checkpoint_it_published(tmp_path, monkeypatch):
    """A KeyboardInterrupt in the verification after the rename (rank 0 met by a Ctrl-C there)
    leaves the checkpoint in place: it was whole and fsynced before the rename. It used to go
    back to its staging name and be deleted, and the run's newest checkpoint with it."""
    save(tmp_path, 2, {"step": 2}, [{"rank": 0}])

    def interrupted(path, **_):
        raise KeyboardInterrupt

    write_rank_files(tmp_path, 4, 0, {"rank": 0}, token="t")
    with monkeypatch.context() as patch:
        patch.setattr(ckpt_write, "verify", interrupted)
        with pytest.raises(KeyboardInterrupt):
            finalize(tmp_path, 4, 1, {"step": 4}, token="t")
    assert ckpt.newest_kept(tmp_path) == step_dir(tmp_path, 4)
    assert verify(step_dir(tmp_path, 4))["step"] == 4  # whole, its checksums included
    assert verify(step_dir(tmp_path, 2))["step"] == 2  # and the earlier one untouched


def rank_worker(rank: int, port: int, out: str):
    root = ckpt.checkpoint_root(out)
    with gloo_runtime(rank, port, 2):
        random.seed(10 + rank), np.random.seed(10 + rank), torch.manual_seed(10 + rank)
        gen = torch.Generator().manual_seed(20 + rank)
        state = {"rank": rank, "rng": capture_rng(CPU, {"loader": gen})}
        write_rank_files(root, 7, rank, state, token=TOKEN)
        expected = draws(gen)
        tdist.barrier()  # every rank's file exists before rank 0 seals the checkpoint
        if rank == 0:
            finalize(root, 7, 2, {"step": 7}, token=TOKEN)
        tdist.barrier()
        random.seed(0), np.random.seed(0), torch.manual_seed(0), gen.manual_seed(0)
        loaded = load(step_dir(root, 7), rank=rank)
        restore_rng(loaded.rank_state["rng"], CPU, {"loader": gen})
        result = {"rank": loaded.rank_state["rank"], "expected": expected, "got": draws(gen)}
        torch.save(result, f"{out}/result-{rank}.pt")


def test_two_processes_write_and_restore_their_own_rng(tmp_path):
    spawn(rank_worker, free_port(), str(tmp_path), nprocs=2)
    manifest = verify(step_dir(ckpt.checkpoint_root(tmp_path), 7))
    assert manifest["world_size"] == 2
    assert sorted(e["name"] for e in manifest["files"]) == ["rank-0.pt", "rank-1.pt", "state.pt"]
    results = [torch.load(tmp_path / f"result-{r}.pt", weights_only=True) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        for key, value in result["expected"].items():
            got = result["got"][key]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value, key
    assert not torch.equal(results[0]["expected"]["torch"], results[1]["expected"]["torch"])


# ---- data cursor ----


@pytest.mark.parametrize("n, world, epoch", [(10, 2, 0), (11, 3, 1), (7, 1, 2)])
def test_remaining_indices_from_zero_is_the_sampler_shard(n, world, epoch):
    for rank in range(world):
        sampler = ShardedSampler(n, rank, world, shuffle=True, seed=5, even=True)
        sampler.set_epoch(epoch)
        assert remaining_indices(n, 5, epoch, 0, rank, world) == list(sampler)


@pytest.mark.parametrize("n, consumed, world", [(23, 0, 2), (23, 6, 2), (23, 6, 3), (20, 19, 2)])
def test_the_sampler_resumes_past_a_consumed_prefix(n, consumed, world):
    for rank in range(world):
        sampler = ShardedSampler(n, rank, world, shuffle=True, seed=4, even=True)
        sampler.set_epoch(2, consumed)
        expected = remaining_indices(n, 4, 2, consumed, rank, world)
        assert list(sampler) == expected and len(sampler) == len(expected)
    plain = ShardedSampler(n, 1, world, shuffle=False, seed=4, even=True)
    plain.set_epoch(0, consumed)
    assert list(plain) == list(range(consumed + 1, n - (n - consumed) % world, world))
    with pytest.raises(ValueError, match="only a training sampler"):
        ShardedSampler(n, 0, world, shuffle=False, seed=4, even=False).set_epoch(0, 2)


def test_epochs_from_a_cursor_continue_where_the_batches_stopped():
    """5 batches through epochs(), then epochs(start=advance(...)) on a fresh loader: the same
    batches as going on with the first, into the next epoch."""
    n, batch = 22, 3
    data = TensorDataset(torch.arange(n))

    def stream(start=None):
        sampler = ShardedSampler(n, 0, 1, shuffle=True, seed=9, even=True)
        return epochs(DataLoader(data, batch, sampler=sampler, drop_last=True), start=start)

    straight = stream()
    expected = [next(straight)[0].tolist() for _ in range(12)]
    start = advance(DataCursor(9, 0, 0, n), 5, batch_size=batch, world_size=1)
    resumed = stream(start)
    assert [next(resumed)[0].tolist() for _ in range(7)] == expected[5:]


@pytest.mark.parametrize("n", [1, 7, 12, 13])
def test_any_cursor_on_any_new_world_covers_the_epoch_exactly_once(n):
    """Consumed prefix + what all new ranks get = the permutation minus a tail of fewer than
    new_world entries, every index once; ranks get equal counts."""
    order = epoch_order(n, 3, 4).tolist()
    for consumed in range(n + 1):
        for new_world in (1, 2, 3, 5):
            shards = [remaining_indices(n, 3, 4, consumed, r, new_world) for r in range(new_world)]
            assert len({len(s) for s in shards}) == 1
            seen = order[:consumed] + [i for s in shards for i in s]
            tail = (n - consumed) % new_world
            assert sorted(seen) == sorted(order[: n - tail]) and len(seen) == len(set(seen))


@pytest.mark.parametrize("world, batch, k", [(2, 3, 2), (3, 2, 1), (1, 4, 3)])
def test_same_world_resume_continues_each_shard_exactly(world, batch, k):
    consumed = k * batch * world  # what k batches on every rank consumed
    for rank in range(world):
        full = remaining_indices(23, 1, 0, 0, rank, world)
        assert full[: k * batch] + remaining_indices(23, 1, 0, consumed, rank, world) == full


@pytest.mark.parametrize("n, world, batch", [(23, 2, 3), (20, 3, 2), (9, 1, 4)])
def test_advance_matches_the_sampler_and_dataloader_across_epochs(n, world, batch):
    """Batches drawn through ShardedSampler + DataLoader(drop_last) for k steps: the current
    epoch's consumed samples are exactly the prefix the advanced cursor names."""
    start = DataCursor(seed=2, epoch=0, consumed=0, num_samples=n)
    for k in range(1, 12):
        per_epoch: dict[int, list[int]] = {}
        for rank in range(world):
            sampler = ShardedSampler(n, rank, world, shuffle=True, seed=2, even=True)
            data = TensorDataset(torch.arange(n))
            it = epochs(DataLoader(data, batch, sampler=sampler, drop_last=True))
            for _ in range(k):
                (batch_indices,) = next(it)
                per_epoch.setdefault(sampler.epoch, []).extend(batch_indices.tolist())
        cursor = advance(start, k, batch_size=batch, world_size=world)
        last = max(per_epoch)
        assert cursor.epoch == last
        order = epoch_order(n, 2, last).tolist()
        assert sorted(per_epoch[last]) == sorted(order[: cursor.consumed])


def test_advance_from_a_cursor_left_by_another_world():
    cursor = DataCursor(seed=0, epoch=0, consumed=12, num_samples=30)  # e.g. 2 ranks x 2 x 3
    # 3 ranks, batch 2: (30 - 12) // 3 = 6 per rank = 3 batches left in epoch 0
    assert advance(cursor, 3, batch_size=2, world_size=3) == DataCursor(0, 0, 30, 30)
    assert advance(cursor, 4, batch_size=2, world_size=3) == DataCursor(0, 1, 6, 30)
    with pytest.raises(ValueError, match="no batch"):
        advance(cursor, 1, batch_size=11, world_size=3)


# ---- config ----


def test_checkpoint_config_validates(tmp_path):
    assert CheckpointConfig().resume == "auto"
    (tmp_path / "checkpoints").mkdir()
    CheckpointConfig(every=0, keep_last=1, resume=str(tmp_path))  # a run directory
    for kwargs, key in [
        ({"every": -1}, "ckpt.every"),
        ({"keep_last": 0}, "ckpt.keep_last"),
        ({"resume": str(tmp_path / "missing")}, "ckpt.resume"),
    ]:
        with pytest.raises(ConfigError, match=key):
            CheckpointConfig(**kwargs)


@pytest.mark.parametrize(
    "fault, falls_back",
    [(OSError(errno.EIO, "Input/output error"), False), (pickle.UnpicklingError("bad"), True)],
)
def test_a_read_error_stops_the_resume_where_an_invalid_file_falls_back(
    tmp_path, monkeypatch, fault, falls_back
):
    """ckpt.resume=auto skips a newest checkpoint that is invalid (here: refused unpickling),
    but an I/O error while reading it says nothing of the file: the run stops instead of
    silently redoing the steps since the older one."""
    from mgpu.ckpt.resume import resume_point
    from mgpu.runtime.dist import Runtime

    small(tmp_path, 1), small(tmp_path, 2)
    real_load = torch.load

    def load(path, *args, **kwargs):
        if "step-00000002" in str(path):
            raise fault
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "load", load)
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    if falls_back:
        loaded, _ = resume_point(CheckpointConfig(resume="auto"), tmp_path, rt)
        assert loaded.step == 1
    else:
        with pytest.raises(CheckpointError, match="Input/output error") as caught:
            resume_point(CheckpointConfig(resume="auto"), tmp_path, rt)
        assert caught.value.read_error


# A training process's writes, each met by a Ctrl-C (SIGINT) at a random moment of the write.
INTERRUPTED_WRITES = """
import os, random, signal, sys, threading, time
from pathlib import Path
import torch
from mgpu.ckpt.write import write_rank_files
root, attempts = Path(sys.argv[1]), int(sys.argv[2])
state = {"rng": torch.get_rng_state(), "w": torch.randn(200_000)}
start = time.perf_counter()
write_rank_files(root, 0, 0, state, token="t")
took = time.perf_counter() - start  # how long a write lasts here, to aim the signals into it
outcomes = []
for step in range(1, attempts + 1):
    timer = threading.Timer(random.uniform(0, took), os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        write_rank_files(root, step, 0, state, token="t")
        timer.join()  # a Ctrl-C sent as the write ended arrives here
        time.sleep(0.01)
    except BaseException as err:  # noqa: BLE001 - what each Ctrl-C became
        timer.join()
        outcomes.append(type(err).__name__)
print(" ".join(outcomes))
"""


def test_a_ctrl_c_during_a_write_stops_after_the_file_is_whole(tmp_path):
    """Ctrl-C while torch.save writes through mgpu's hashing writer once became a RuntimeError
    (a periodic save logged it and training went on) or aborted the process; it is held until
    the file is written, then raised as KeyboardInterrupt."""
    attempts = 100
    command = [sys.executable, "-c", INTERRUPTED_WRITES, str(tmp_path), str(attempts)]
    # SIGINT at its default action, as a terminal's training process has it: a test run
    # started in the background of a shell has it ignored, and its children with it.
    reset = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=120, cwd=ROOT, preexec_fn=reset
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # no abort
    assert proc.stdout.split() == ["KeyboardInterrupt"] * attempts, proc.stdout[-3000:]
    written = [
        ckpt.staging_dir(tmp_path, step, "t") / ckpt.rank_file(0) for step in range(attempts + 1)
    ]
    for path in [p for p in written if p.exists()]:  # each one written whole
        assert torch.load(path, weights_only=True)["w"].shape == (200_000,), path
