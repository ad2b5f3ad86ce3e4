"""After training: mgpu.evaluate, mgpu.sample and mgpu.export run as users run them (real
processes, torchrun for two) on checkpoints that train.py wrote, compared with what the training
run itself recorded and with models loaded from the checkpoint independently of mgpu.restore."""

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, read_scalars, run_train
from safetensors.torch import load_file

from mgpu import evaluate, export, sample
from mgpu.ckpt.checkpoint import load
from mgpu.data import SyntheticImages
from mgpu.data.prepare import main as prepare_main
from mgpu.models import GPT, MLP

GPT_STEPS = 30
GPT_TRAIN = [
    f"trainer.max_steps={GPT_STEPS}",
    "trainer.log_every=10",
    "trainer.eval_every=0",  # one evaluation, at the end: the reference
    "ckpt.every=0",  # one checkpoint, at the end
    "data=tokens",
    "data.vocab_size=256",
    "data.seq_len=64",
    "data.batch_size=16",
    "data.eval_samples=63",  # odd: two evaluating processes get unequal shares
    "data.num_workers=0",
]


def tool(module: str, args: list, cwd: Path, nproc: int | None = None):
    return run_train([str(a) for a in args], cwd=cwd, nproc=nproc, program=("-m", module))


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    """A tiny GPT trained on byte-level tokens of this repository's README."""
    out = tmp_path_factory.mktemp("gpt")
    text = (ROOT / "README.md").read_bytes()
    (out / "text.txt").write_bytes((text * (40_000 // len(text) + 1))[:40_000])
    tokens = out / "text.bin"
    prepare_main([str(out / "text.txt"), str(tokens)])  # the token file training reads
    run_dir = out / "run"
    # data.path relative, as a user types it from their data's folder: the run saves it absolute,
    # and the tools below run from other directories (mgpu.run.config.resolved_yaml)
    args = [*GPT_TRAIN, "data.path=text.bin", f"hydra.run.dir={run_dir}"]
    proc = run_train(args, cwd=out, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def last_eval_loss(run_dir: Path) -> tuple[int, float]:
    return read_scalars(run_dir)["eval/loss"][-1]


def printed(stdout: str) -> dict:
    match = re.search(r"\(step (\d+)\) on (\d+) process\(es\): eval loss ([\d.]+)", stdout)
    assert match, stdout
    accuracy = re.search(r"accuracy ([\d.]+)", stdout)
    return {
        "step": int(match[1]),
        "processes": int(match[2]),
        "loss": float(match[3]),
        "accuracy": float(accuracy[1]) if accuracy else None,
    }


@pytest.mark.parametrize("nproc", [None, 2])
def test_evaluate_reproduces_the_runs_last_eval_loss(gpt_run, nproc):
    step, reference = last_eval_loss(gpt_run)
    assert step == GPT_STEPS
    # Two processes also take an override: batches of 5, so the shares end in ragged batches.
    overrides = ["data.batch_size=5"] if nproc else []
    # from the run directory: not where the run's relative data.path was given
    proc = tool("mgpu.evaluate", [gpt_run, *overrides], gpt_run, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = printed(proc.stdout)
    assert got["step"] == GPT_STEPS and got["processes"] == (nproc or 1)
    # TensorBoard keeps float32: 7 digits; the loss is summed in another order on 2 processes.
    assert math.isclose(got["loss"], reference, rel_tol=1e-5), (got, reference)
    assert got["accuracy"] is None  # a language model: the loss is the measure


def checkpoint_model(run_dir: Path) -> GPT:
    """The run's model from its checkpoint, loaded directly (not through mgpu.restore)."""
    (path,) = sorted((run_dir / "checkpoints").iterdir())
    shared = load(path, rank=0).shared
    model = GPT(**arguments(yaml.safe_load(shared["config"])["model"]))
    model.load_state_dict(shared["model"])
    return model.eval()


def arguments(model_config: dict) -> dict:
    """A saved model config's constructor arguments."""
    return {k: v for k, v in model_config.items() if k != "_target_"}


def sampled(gpt_run, seed: int) -> list[str]:
    """mgpu.sample's arguments: 48 bytes after a prompt, drawn from the 50 likeliest."""
    return [
        str(gpt_run),
        "--prompt",
        "The ",
        "--tokens",
        "48",
        "--seed",
        str(seed),
        "--top_k",
        "50",
    ]


def test_sample_writes_the_requested_bytes_deterministically_for_a_seed(gpt_run, capsysbinary):
    # Bytes, not text: a byte-level model need not write valid UTF-8. Once as users run it...
    proc = subprocess.run(
        [sys.executable, "-m", "mgpu.sample", *sampled(gpt_run, 1)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout) == 48
    # ...then again in this process, on one thread as that process ran: the same seed writes
    # the same bytes in another process, another seed others.
    runs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, seed in [("again", 1), ("other", 2)]:
            sample.main(sampled(gpt_run, seed))
            runs[name] = capsysbinary.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert len(runs["again"]) == len(runs["other"]) == 48
    assert proc.stdout == runs["again"]
    assert proc.stdout != runs["other"]


def test_greedy_sampling_is_the_models_argmax(gpt_run):
    """Greedy decoding (temperature 0) is the model's argmax, byte after byte: a reference
    computed here from the checkpoint's model."""
    model = checkpoint_model(gpt_run)
    idx = torch.tensor([list(b"The ")])
    with torch.no_grad():
        for _ in range(16):
            idx = torch.cat((idx, model(idx)[:, -1].argmax(-1, keepdim=True)), dim=1)
    expected = bytes(idx[0, 4:].tolist())
    got = sample.generate(model, torch.tensor(list(b"The ")), 16, temperature=0)
    assert bytes(got.tolist()) == expected
    # A prompt longer than the model's context (64): the newest 64 bytes are the context.
    long = torch.tensor(list(b"x" * 100 + b"The "))
    got = sample.generate(model, long, 3, temperature=0)
    with torch.no_grad():
        first = model(long[None, -model.block_size :])[0, -1].argmax()
    assert len(got) == 3 and got[0] == first


def test_export_round_trips_to_the_same_logits(gpt_run, tmp_path):
    out = tmp_path / "model.safetensors"
    proc = tool("mgpu.export", [gpt_run, out], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads(out.with_suffix(".json").read_text())
    assert config["tied"] == {"lm_head.weight": "wte.weight"}
    assert config["step"] == GPT_STEPS
    assert config["data"]["vocab_size"] == 256 and "token ids" in config["inputs"]
    umask = os.umask(0o022)
    os.umask(umask)
    for path in (out, out.with_suffix(".json")):  # as any file the user writes
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
    # As a user without mgpu reads it: safetensors, then the tied names from the json.
    state = load_file(str(out))
    assert "lm_head.weight" not in state  # stored once
    for name, source in config["tied"].items():
        state[name] = state[source]
    fresh = GPT(**arguments(config["model"]))
    fresh.load_state_dict(state)
    fresh.eval()
    assert fresh.lm_head.weight is fresh.wte.weight  # still tied after loading
    reference = checkpoint_model(gpt_run)
    x = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(x), reference(x))
    # mgpu's own reader gives the same state
    again, _ = export.read(out)
    assert sorted(again) == sorted(reference.state_dict())
    assert all(torch.equal(again[k], v) for k, v in reference.state_dict().items())


def corrupted(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run whose checkpoint's state.pt has one byte flipped (same size)."""
    copy = tmp_path / "corrupt"
    shutil.copytree(run_dir, copy)
    (state,) = (copy / "checkpoints").glob("step-*/state.pt")
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    return copy


def test_an_invalid_checkpoint_is_refused_by_name(gpt_run, tmp_path, capsys):
    copy = corrupted(gpt_run, tmp_path)
    (state,) = (copy / "checkpoints").glob("step-*/state.pt")
    with pytest.raises(SystemExit) as stop:
        evaluate.main([str(state.parent)])  # python -m mgpu.evaluate's exit code is main's
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{state}: checksum mismatch" in err, err
    # A run directory means its newest VALID checkpoint: here there is none.
    for main, extra in [
        (sample.main, ["--prompt", "a", "--tokens", "1"]),
        (export.main, [str(tmp_path / "x.safetensors")]),
    ]:
        with pytest.raises(SystemExit) as stop:
            main([str(copy), *extra])
        assert stop.value.code == 1
    assert not (tmp_path / "x.safetensors").exists()


class NotATensor:
    """Stands for any object that torch.load(weights_only=True) refuses to build."""


def test_a_checkpoint_is_loaded_weights_only(gpt_run, tmp_path, capsys):
    """A checkpoint whose files match their manifest but hold an arbitrary object is refused by
    the weights_only load, not unpickled."""
    copy = tmp_path / "run"
    shutil.copytree(gpt_run, copy)
    (state,) = (copy / "checkpoints").glob("step-*/state.pt")
    shared = torch.load(state, weights_only=True)
    torch.save({**shared, "extra": NotATensor()}, state)
    manifest = json.loads((state.parent / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == "state.pt":
            entry["size"] = state.stat().st_size
            entry["sha256"] = hashlib.sha256(state.read_bytes()).hexdigest()
    (state.parent / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as stop:
        export.main([str(copy), str(tmp_path / "x.safetensors")])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert f"{state}: refused by torch.load(weights_only=True)" in err, err
    assert "NotATensor" in err


@pytest.mark.parametrize(
    "what, message",
    [
        ("missing", "no such file or directory"),
        ("file", "a file; pass the checkpoint directory that holds it"),
        ("empty dir", "neither a run directory"),
        ("run dir, no checkpoints", "a run directory without checkpoints"),
        ("run dir, empty checkpoints/", "no checkpoint yet"),
    ],
)
def test_bad_paths_get_one_line_that_says_what_to_pass(tmp_path, capsys, what, message):
    path = tmp_path / "x"
    if what == "file":
        path.write_text("not a checkpoint")
    elif what != "missing":
        path.mkdir()
    if what.startswith("run dir"):
        (path / "config.yaml").write_text("{}")  # train.py's rank 0 writes it first
    if what == "run dir, empty checkpoints/":
        (path / "checkpoints").mkdir()
    with pytest.raises(SystemExit) as stop:
        evaluate.main([str(path)])
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mgpu.evaluate: error: ") and message in err[0]


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory) -> Path:
    """A few steps of a small MLP on the synthetic images: a classifier."""
    out = tmp_path_factory.mktemp("mlp")
    run_dir = out / "run"
    args = [
        "model=mlp",
        "model.hidden=[32]",
        "data=images",
        "data.batch_size=16",
        "data.eval_samples=40",
        "data.num_workers=0",
        "trainer.max_steps=4",
        "trainer.eval_every=0",
        "ckpt.every=0",
        f"hydra.run.dir={run_dir}",
    ]
    proc = run_train(args, cwd=out, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_evaluate_reports_a_classifiers_accuracy(classifier_run, capsys):
    # in this process: launched as users run it, evaluate is test_evaluate_reproduces_...'s
    evaluate.main([str(classifier_run)])
    got = printed(capsys.readouterr().out)
    assert math.isclose(got["loss"], last_eval_loss(classifier_run)[1], rel_tol=1e-5)
    # Reference: the checkpoint's model on every eval image, computed here.
    (path,) = sorted((classifier_run / "checkpoints").iterdir())
    shared = load(path, rank=0).shared
    cfg = yaml.safe_load(shared["config"])
    model = MLP(**arguments(cfg["model"]))
    model.load_state_dict(shared["model"])
    data = cfg["data"]
    images = SyntheticImages(
        "eval",
        **{k: data[k] for k in ("num_classes", "image_size", "channels", "num_samples")},
        **{k: data[k] for k in ("eval_samples", "noise", "seed")},
    )
    inputs = torch.stack([images[i][0] for i in range(len(images))])
    labels = torch.tensor([int(images[i][1]) for i in range(len(images))])
    with torch.no_grad():
        predicted = model.eval()(images.device_transform(inputs)).argmax(-1)
    assert got["accuracy"] == pytest.approx((predicted == labels).float().mean().item(), abs=1e-4)


def test_sample_refuses_a_model_that_is_not_a_byte_level_gpt(classifier_run, capsys):
    with pytest.raises(SystemExit) as stop:
        sample.main([str(classifier_run), "--prompt", "a", "--tokens", "1"])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "mgpu.models.MLP, not a GPT" in err and "Traceback" not in err


def said(proc: subprocess.CompletedProcess) -> str:
    """The one line a command refused with (no traceback, nothing else on stderr)."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_a_moved_token_file_is_needed_by_evaluate_only(gpt_run, tmp_path, capsysbinary):
    """The run's token file moved away, its metadata (text.bin.meta.json) left behind: sample
    and export need the checkpoint and the tokenizer, not the file; evaluate reads it, and says
    in one line how to point it at the file's new place, which then works.

    What each command reads is the same in this process: sample, export and the evaluation that
    works run here (launched as users run them, they are the tests above); the refusal, whose
    one line and exit code are the process's, is launched."""
    tokens = gpt_run.parent / "text.bin"
    moved = tmp_path / "moved.bin"
    shutil.move(tokens, moved)
    try:
        sample.main(sampled(gpt_run, 1))  # a SystemExit (exit code 1) if it needed the file
        assert len(capsysbinary.readouterr().out) == 48
        out = tmp_path / "model.safetensors"
        export.main([str(gpt_run), str(out)])
        assert out.is_file()
        proc = tool("mgpu.evaluate", [gpt_run], tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = said(proc)
        assert f"data.path='{tokens}': no such file" in line and "data.path=PATH" in line, line
        capsysbinary.readouterr()
        evaluate.main([str(gpt_run), f"data.path={moved}"])
        stdout = capsysbinary.readouterr().out.decode()
        assert math.isclose(printed(stdout)["loss"], last_eval_loss(gpt_run)[1], rel_tol=1e-5)
    finally:
        shutil.move(moved, tokens)


@pytest.mark.parametrize(
    "override, expected",
    [
        # gpt_tiny's n_embd is 128: every parameter differs, the first three are named
        (
            "model.n_embd=64",
            "wte.weight [256, 128] in the checkpoint, [256, 64] in the model; wpe.weight",
        ),
        ("optim.lrr=3", "optim.lrr='3': is not a key of optim; did you mean optim.lr=3?"),
        ("model=resnet_tiny", "model group cannot be changed: this run's model is mgpu.models.GPT"),
        # more windows than the run held out: some of them it trained on
        ("data.eval_samples=100", "data.eval_samples=100: the run held out 63 samples"),
    ],
)
def test_an_override_that_cannot_work_is_refused_in_one_line(gpt_run, override, expected):
    """As train.py refuses the same override: one line naming it and the fix, exit code 2."""
    proc = tool("mgpu.evaluate", [gpt_run, override], gpt_run.parent)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = said(proc)
    assert line.startswith("mgpu.evaluate: error: ") and expected in line, line
    if override == "model.n_embd=64":
        assert line.count("step-") == 1, line  # the checkpoint named once, not per parameter
        assert "more parameters differ" in line and "leave out model.n_embd=64" in line, line
