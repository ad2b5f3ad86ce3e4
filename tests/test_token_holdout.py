"""A token file's eval holdout (data.eval_samples=auto: 256 windows, at most a tenth of the file),
the split a run logs, and telling text from token ids: in mgpu's config check, in a real run,
and in python -m mgpu.data.prepare."""

from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import ROOT, one_line_under_torchrun, run_train, said_by_train_py
from hydra import compose, initialize_config_dir

from mgpu.config.checks import ConfigError
from mgpu.data import TokenFile
from mgpu.data.prepare import main as prepare_main
from mgpu.data.token_file import looks_like_text
from mgpu.restore import saved_config
from mgpu.run.config import resolved_yaml, to_config

SEQ = 64


def compose_config(*overrides):
    """The real conf/ tree, data=tokens on gpt_tiny's context."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        args = ["data=tokens", f"data.seq_len={SEQ}", *overrides]
        return compose(config_name="config", overrides=args)


def prose(n_bytes: int) -> str:
    words = "the quick brown fox jumps over a lazy dog while text goes on".split()
    picks = np.random.default_rng(0).integers(0, len(words), n_bytes // 3)
    return " ".join(words[i] for i in picks)[:n_bytes]


def prepared(folder: Path, n_bytes: int, name: str = "t") -> Path:
    """A byte-level token file of `n_bytes` tokens, made as users make one."""
    (folder / f"{name}.txt").write_text(prose(n_bytes))
    prepare_main([str(folder / f"{name}.txt"), str(folder / f"{name}.bin")])
    return folder / f"{name}.bin"


@pytest.mark.parametrize(
    "tokens, given, held",
    [
        (25_000, None, 39),  # 390 windows: a tenth of them, not 256 of 390
        (SEQ * 5 + 1, None, 1),  # 5 windows: at least one
        (SEQ * 4_000 + 1, None, 256),  # a file of 2,560 windows or more: 256
        (25_000, 300, 300),  # a number is taken as is
    ],
)
def test_the_holdout_is_a_tenth_of_a_small_file(tmp_path, tokens, given, held):
    path = prepared(tmp_path, tokens)
    args = [f"data.path={path}"] + ([f"data.eval_samples={given}"] if given else [])
    composed = compose_config(*args)
    config = to_config(composed)
    assert config.data.eval_samples == held
    saved = yaml.safe_load(resolved_yaml(composed))
    assert saved["data"]["eval_samples"] == held  # the run's config.yaml records the number
    kwargs = config.data.dataset_kwargs()
    windows = (tokens - 1) // SEQ
    assert len(TokenFile("eval", **kwargs)) == held
    assert len(TokenFile("train", **kwargs)) == windows - held
    # A run saved with a number keeps it (mgpu.evaluate, a saved config of 256 from before auto)
    saved["data"]["eval_samples"] = 1
    assert saved_config(yaml.safe_dump(saved), []).data.eval_samples == 1


def test_a_run_logs_its_split(tmp_path):
    path = prepared(tmp_path, 25_000)
    run_dir = tmp_path / "run"
    args = ["data=tokens", f"data.path={path}", "data.num_workers=0", "model.n_layer=1"]
    args += ["trainer.max_steps=2", "trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    proc = run_train(args, cwd=tmp_path, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    lines = [line for line in said.splitlines() if "data=tokens" in line and "windows" in line]
    assert len(lines) == 1, said[-3000:]
    assert "train 351 windows (22,464 tokens), eval 39 windows (2,496 tokens" in lines[0]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["eval_samples"] == 39
    # Resumed with another holdout (a run from before auto held out 256): its training set
    # differs, and the refusal names the checkpoint's holdout to give.
    again = run_train(
        [*args, "trainer.max_steps=4", "data.eval_samples=256"], cwd=tmp_path, nproc=None
    )
    assert again.returncode == 2, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert "trained on 351 samples" in said and "give data.eval_samples=39" in said, said[-3000:]


def test_a_holdout_that_leaves_less_than_a_batch_is_refused(tmp_path):
    path = prepared(tmp_path, 25_000)  # 390 windows
    data = to_config(compose_config(f"data.path={path}", "data.eval_samples=340")).data
    data.check_train_batches(world_size=1)  # 50 windows: a batch of 32
    with pytest.raises(ConfigError) as refused:
        data.check_train_batches(world_size=2)
    line = str(refused.value)
    assert line.startswith("data.eval_samples=340: leaves 50 of data.path's 390 windows"), line
    assert "at most 326 (auto: 39 here)" in line and "\n" not in line
    data.batch_size = 200  # no holdout leaves 400: the batch is too big for the file
    with pytest.raises(ConfigError) as refused:
        data.check_train_batches(world_size=2)
    line = str(refused.value)
    assert line.startswith("data.batch_size=200: each of the 2 processes gets only 25 training")
    assert "lower data.batch_size (at most 25 here)" in line, line
    # train.py's check of its command line says it, before any run directory
    said = said_by_train_py(["data=tokens", f"data.path={path}", "data.eval_samples=380"], tmp_path)
    assert said.startswith("mgpu: config error: data.eval_samples=380: leaves 10 of"), said


def test_a_file_short_of_a_batch_per_process_stops_before_the_run_directory(tmp_path):
    """50 windows, 5 held out: a batch of 32 for one process, not for each of two. Under
    torchrun the config check knows the world size (WORLD_SIZE): one line, exit 2, and no run
    directory, where the training loader would say it only after the run directory exists."""
    path = prepared(tmp_path, 50 * SEQ + 1)
    run_dir = tmp_path / "run"
    args = ["data=tokens", f"data.path={path}", f"data.seq_len={SEQ}", "data.batch_size=32"]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2)
    line = one_line_under_torchrun(proc, run_dir)
    said = "data.batch_size=32: each of the 2 processes gets only 22 training samples, less "
    assert said in line and "lower data.batch_size (at most 22 here)" in line, line


@pytest.mark.parametrize("companion", ["meta.json", "tokenizer.json"])
def test_a_token_files_metadata_or_tokenizer_given_as_data_path_names_the_file(tmp_path, companion):
    """`data.path=t.bin.meta.json` (a slip of tab completion): the token file beside it is named,
    not `python -m mgpu.data.prepare t.bin.meta.json`, which prepare would refuse."""
    (tmp_path / "t.txt").write_text(prose(30_000))
    prepare_main([str(tmp_path / "t.txt"), str(tmp_path / "t.bin"), "--train-bpe", "300"])
    line = said_by_train_py(["data=tokens", f"data.path=t.bin.{companion}"], tmp_path)
    what = "metadata" if companion == "meta.json" else "tokenizer"
    said = (
        f"data.path='t.bin.{companion}': is the {what} of the token file t.bin: use data.path=t.bin"
    )
    assert line == f"mgpu: config error: {said}", line


@pytest.mark.parametrize(
    "head",
    [
        b"\x1b[31merror\x1b[0m: ",  # a log's ANSI colour escape
        b"\x1b[32mINFO\x1b[0m " * 400,  # a coloured log: many escapes, UTF-8 all the same
        "caf\xe9 au lait, ".encode("latin-1"),  # not UTF-8, but text
    ],
)
def test_text_with_control_bytes_is_text(tmp_path, head):
    text = tmp_path / "corpus.txt"
    text.write_bytes(head + prose(30_000).encode())
    assert looks_like_text(str(text))
    with pytest.raises(ConfigError, match=r"holds text.*python -m mgpu\.data\.prepare"):
        to_config(compose_config(f"data.path={text}"))


@pytest.mark.parametrize(
    "ids",
    [
        np.frombuffer(prose(30_000).encode(), dtype=np.uint8),  # byte-level
        np.random.default_rng(0).integers(0, 50_257, 15_000),  # GPT-2's ids
        np.random.default_rng(0).integers(0, 8_192, 15_000),  # a BPE of 8,192
    ],
)
def test_token_ids_are_not_text(tmp_path, ids):
    path = tmp_path / "t.bin"
    ids.astype("<u2").tofile(path)
    assert not looks_like_text(str(path))


def test_prepare_refuses_a_prepared_token_file(tmp_path, capsys):
    path = prepared(tmp_path, 5_000)
    bare = tmp_path / "bare.bin"  # a token file without its metadata: binary
    bare.write_bytes(path.read_bytes())
    capsys.readouterr()
    for given in (path, bare):
        with pytest.raises(SystemExit) as stop:
            prepare_main([str(given), str(tmp_path / "again.bin")])
        err = capsys.readouterr().err
        assert stop.value.code == 2, err
        line = err.strip().splitlines()[-1]
        assert line.startswith("python -m mgpu.data.prepare: error: "), err
        what = "is already a prepared token file" if given == path else "is binary, not text"
        assert f"input file {str(given)!r} {what}" in line, line
        assert f"train on it with data=tokens data.path={given}" in line, line
        assert not list(tmp_path.glob("again*")), "it wrote something"
