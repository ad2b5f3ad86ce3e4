"""Text with a real tokenizer, as users run it: mgpu.data.prepare with --train-bpe or --tokenizer
on Python's own sources, train.py with the model's vocabulary following the data, mgpu.sample
and mgpu.evaluate decoding with the run's tokenizer. References: the `tokenizers` library used
directly, and the checkpoint's model run here."""

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT, read_scalars, run_train, said_by_train_py, said_lines
from hydra import compose, initialize_config_dir
from tokenizers import ByteLevelBPETokenizer, Tokenizer, models

from mgpu import evaluate, export
from mgpu.ckpt.checkpoint import Loaded, load
from mgpu.ckpt.resume import check_settings
from mgpu.ckpt.state import CheckpointMismatch
from mgpu.config.checks import ConfigError
from mgpu.config.schema import OptimConfig
from mgpu.data import prepare as prepare_module
from mgpu.data.prepare import main as prepare_main
from mgpu.models import GPT
from mgpu.restore import Restored, UsageError, saved_config
from mgpu.run.config import resolved_yaml, to_config
from mgpu.sample import DEFAULT_TOKENS, parse_args
from mgpu.sample import main as sample_main

STEPS = 30
TRAIN = [
    "model=gpt_tiny",
    "data=tokens",
    "data.seq_len=64",
    "data.batch_size=16",
    "data.eval_samples=32",
    "data.num_workers=0",
    f"trainer.max_steps={STEPS}",
    "trainer.eval_every=0",
    "ckpt.every=0",
]
PROMPT = "def main("


def stdlib_text(limit: int) -> str:
    """About `limit` bytes of Python's own standard library sources: real text on any machine."""
    parts, size = [], 0
    for path in sorted(Path(os.path.dirname(os.__file__)).glob("*.py")):
        text = path.read_text(encoding="utf-8")
        parts.append(text)
        size += len(text.encode("utf-8"))
        if size >= limit:
            return "".join(parts)
    raise AssertionError(f"the standard library's sources hold less than {limit} bytes")


def train(out: Path, token_file: Path, *extra: str) -> Path:
    run_dir = out / "run"
    args = [*TRAIN, f"data.path={token_file}", f"hydra.run.dir={run_dir}", *extra]
    proc = run_train(args, cwd=out, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def sample(run_dir: Path, capsysbinary, *args) -> bytes:
    """What `python -m mgpu.sample RUN --prompt PROMPT args` writes (bytes), its main run in
    this process (launched as users run it: tests/test_after_training.py)."""
    capsysbinary.readouterr()  # what was said before
    sample_main([str(run_dir), "--prompt", PROMPT, *map(str, args)])
    return capsysbinary.readouterr().out


def greedy_text(run_dir: Path, tokenizer: Tokenizer, tokens: int) -> bytes:
    """The reference: the checkpoint's model, loaded here, continues the prompt with its most
    likely token among the tokenizer's, `tokens` times; decoded by the library."""
    (path,) = sorted((run_dir / "checkpoints").iterdir())
    shared = load(path, rank=0).shared
    arguments = yaml.safe_load(shared["config"])["model"]
    model = GPT(**{k: v for k, v in arguments.items() if k != "_target_"}).eval()
    model.load_state_dict(shared["model"])
    vocab = tokenizer.get_vocab_size()
    idx = torch.tensor([tokenizer.encode(PROMPT).ids])
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(idx[:, -model.block_size :])[:, -1, :vocab]
            idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return tokenizer.decode(idx[0, -tokens:].tolist()).encode("utf-8")


def saved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    """A byte-level BPE of 512 tokens trained by prepare on 1.2 MB of Python, and gpt_tiny
    trained on its tokens with no vocabulary set."""
    out = tmp_path_factory.mktemp("bpe")
    (out / "text.txt").write_text(stdlib_text(1_200_000), encoding="utf-8")
    prepare_main([str(out / "text.txt"), str(out / "text.bin"), "--train-bpe", "512"])
    train(out, out / "text.bin")
    return out


def test_train_bpe_from_prepare_to_sampled_text(bpe_run, capsysbinary):
    text = (bpe_run / "text.txt").read_text(encoding="utf-8")
    tok_file = bpe_run / "text.bin.tokenizer.json"
    meta = json.loads((bpe_run / "text.bin.meta.json").read_text())
    reference = Tokenizer.from_file(str(tok_file))
    assert reference.get_vocab_size() == meta["vocab_size"] == 512
    assert meta["tokenizer"] == tok_file.name and meta["tokenizer_sha256"] == sha256(tok_file)
    tokens = np.fromfile(bpe_run / "text.bin", dtype="<u2")
    assert meta["tokens"] == len(tokens) and tokens.max() < 512
    assert len(tokens) < 0.6 * len(text.encode("utf-8"))  # merges, not bytes
    assert reference.decode(tokens.tolist()) == text  # byte-level BPE: lossless
    # The model's vocabulary followed the data's, and the run recorded it and the tokenizer.
    run_dir = bpe_run / "run"
    config = saved(run_dir)
    assert config["model"]["vocab_size"] == config["data"]["vocab_size"] == 512
    assert config["data"]["tokenizer_sha256"] == sha256(tok_file)
    assert (run_dir / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    assert sample(run_dir, capsysbinary, "--tokens", 50, "--temperature", 0) == greedy_text(
        run_dir, reference, 50
    )


def test_evaluate_reports_bits_per_byte_of_the_decoded_eval_text(bpe_run, capsys):
    # in this process (launched as users run it: tests/test_after_training.py)
    evaluate.main([str(bpe_run / "run")])
    out = capsys.readouterr().out
    said = r"eval loss ([\d.]+), perplexity [\d.]+, ([\d.]+) bits per byte of text over (\d+)"
    found = re.search(said, out)
    assert found, out
    loss, bits, targets = float(found[1]), float(found[2]), int(found[3])
    # The eval split: the file's last 32 windows of 64+1 tokens; their targets, decoded.
    tokens = np.fromfile(bpe_run / "text.bin", dtype="<u2")
    first = (len(tokens) - 1) // 64 - 32
    eval_targets = tokens[first * 64 + 1 : (first + 32) * 64 + 1]
    assert targets == len(eval_targets) == 32 * 64
    tokenizer = Tokenizer.from_file(str(bpe_run / "text.bin.tokenizer.json"))
    text = tokenizer.decode(eval_targets.tolist()).encode("utf-8")
    assert bits == pytest.approx(loss * targets / len(text) / math.log(2), abs=2e-4)


def test_a_given_tokenizer_json_from_prepare_to_sampled_text(tmp_path, capsysbinary):
    """A tokenizer made elsewhere (the library's own ByteLevelBPETokenizer) of 300 tokens: the
    model's vocabulary is 320, its padding rows never sampled."""
    text = stdlib_text(500_000)  # under one piece: the tokens are the whole text's encoding
    made = ByteLevelBPETokenizer()
    made.train_from_iterator([text], vocab_size=300, show_progress=False)
    made.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    args = [str(tmp_path / "text.txt"), str(tmp_path / "text.bin")]
    prepare_main([*args, "--tokenizer", str(tmp_path / "tokenizer.json")])
    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert reference.get_vocab_size() == 300
    tokens = np.fromfile(tmp_path / "text.bin", dtype="<u2")
    assert tokens.tolist() == reference.encode(text).ids
    meta = json.loads((tmp_path / "text.bin.meta.json").read_text())
    assert meta["tokenizer_sha256"] == sha256(tmp_path / "tokenizer.json")
    run_dir = train(tmp_path, tmp_path / "text.bin")
    config = saved(run_dir)
    assert (config["model"]["vocab_size"], config["data"]["vocab_size"]) == (320, 300)
    got = sample(run_dir, capsysbinary, "--tokens", 50, "--temperature", 0)
    assert got == greedy_text(run_dir, reference, 50)


def test_a_model_vocabulary_below_the_datas_stops_in_one_line(bpe_run, tmp_path):
    args = [*TRAIN, f"data.path={bpe_run / 'text.bin'}", "model.vocab_size=256"]
    line = said_by_train_py(args, tmp_path)
    assert line.startswith("mgpu: config error: model.vocab_size=256: "), line
    assert "data.vocab_size (512)" in line and "model.vocab_size=auto" in line, line


def test_token_ids_without_a_tokenizer_train_evaluate_and_refuse_to_sample(tmp_path, capsys):
    """data.tokenizer=none: a file of ids from another tool (no metadata), as nanoGPT's GPT-2
    train.bin; ids up to 999 here (a small vocabulary keeps the run quick on a CPU). The
    evaluation and the refused sampling run in this process (python -m mgpu.evaluate and
    mgpu.sample exit with their main's code; both are launched as users run them in
    tests/test_after_training.py)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=40_000).astype("<u2")
    ids[::7] = 999  # the highest id is in the file, and has a row
    ids.tofile(tmp_path / "ids.bin")
    run_dir = train(tmp_path, tmp_path / "ids.bin", "data.tokenizer=none", "data.vocab_size=1000")
    assert saved(run_dir)["data"]["tokenizer"] == "none"
    assert saved(run_dir)["model"]["vocab_size"] == 1024  # 1000 rounded up to a multiple of 64
    assert not (run_dir / "tokenizer.json").exists()
    evaluate.main([str(run_dir)])
    out = capsys.readouterr().out
    found = re.search(r"eval loss ([\d.]+), perplexity ([\d.]+) over (\d+)", out)
    assert found, out
    (_, reference), *_ = reversed(read_scalars(run_dir)["eval/loss"])
    assert float(found[1]) == pytest.approx(reference, rel=1e-5)
    assert float(found[2]) == pytest.approx(math.exp(float(found[1])), rel=1e-4)
    with pytest.raises(SystemExit) as stop:
        sample_main([str(run_dir), "--prompt", PROMPT])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert stop.value.code not in (0, None) and len(lines) == 1, err
    assert "data.tokenizer=none" in lines[0] and out == "", err


def test_text_given_as_a_token_file_stops_in_one_line_naming_prepare(tmp_path):
    (tmp_path / "corpus.txt").write_text(stdlib_text(100_000), encoding="utf-8")
    line = said_by_train_py([*TRAIN, "data.path=corpus.txt", "data.tokenizer=bytes"], tmp_path)
    assert "data.path='corpus.txt': holds text" in line, line
    assert "python -m mgpu.data.prepare corpus.txt train.bin" in line, line


def test_token_ids_above_the_vocabulary_stop_before_the_run_directory(tmp_path):
    ids = np.arange(20_000) % 600  # ids up to 599
    ids.astype("<u2").tofile(tmp_path / "ids.bin")
    args = [*TRAIN, "data.path=ids.bin", "data.tokenizer=none", "data.vocab_size=512"]
    line = said_by_train_py(args, tmp_path)
    assert "data.vocab_size=512: is not above token id 599" in line, line
    assert "at least 600" in line, line


# ---------------------------------------------------------------- quick checks, no training


def compose_config(*overrides):
    """The real conf/ tree, data=tokens on gpt_tiny's context."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        args = ["data=tokens", "data.seq_len=64", *overrides]
        return compose(config_name="config", overrides=args)


def refused(args: list[str], capsys) -> str:
    """The line prepare's main ends with when it refuses `args` as bad input: exit 2, as
    argparse exits for a bad argument (after its usage line, for those it checks up front)."""
    with pytest.raises(SystemExit) as stop:
        prepare_main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("python -m mgpu.data.prepare: error: "), err
    return line


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def word_tokenizer(path: Path, size: int) -> None:
    vocab = {f"w{i}": i for i in range(size)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path))


def test_a_tokenizer_over_uint16_is_refused_in_one_line(tmp_path, capsys):
    word_tokenizer(tmp_path / "big.json", 70_000)
    (tmp_path / "in.txt").write_text("w1 w2\n")
    args = [str(tmp_path / "in.txt"), str(tmp_path / "o.bin"), "--tokenizer"]
    line = refused([*args, str(tmp_path / "big.json")], capsys)
    assert "70,000 tokens" in line and "65,536" in line
    assert sorted(os.listdir(tmp_path)) == ["big.json", "in.txt"]  # nothing made


@pytest.mark.parametrize("output", ["corpus.txt", "./corpus.txt", "link", "hard", "beside"])
def test_prepare_refuses_to_write_over_its_input(tmp_path, capsys, monkeypatch, output):
    """The output, or a file prepare writes beside it, naming the input (the same path, ./,
    a symlink, a hard link): refused before anything is read or written."""
    monkeypatch.chdir(tmp_path)
    Path("corpus.txt").write_text(stdlib_text(20_000), encoding="utf-8")
    if output == "link":
        Path("link.bin").symlink_to("corpus.txt")
        output = "link.bin"
    elif output == "hard":
        os.link("corpus.txt", "hard.bin")
        output = "hard.bin"
    elif output == "beside":
        Path("t.bin.tokenizer.json").symlink_to("corpus.txt")
        output = "t.bin"
    before = files(tmp_path)
    line = refused(["corpus.txt", output, "--train-bpe", "300"], capsys)
    assert f"output {output!r} would write over the input file 'corpus.txt'" in line, line
    assert files(tmp_path) == before


def test_prepare_of_a_file_into_itself_exits_2_and_keeps_the_text(tmp_path):
    """As the command runs: python -m mgpu.data.prepare same.txt same.txt --train-bpe 300."""
    text = stdlib_text(20_000)
    (tmp_path / "same.txt").write_text(text, encoding="utf-8")
    command = [sys.executable, "-m", "mgpu.data.prepare", "same.txt", "same.txt"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*command, "--train-bpe", "300"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert "would write over the input file" in proc.stderr.splitlines()[-1], proc.stderr
    assert os.listdir(tmp_path) == ["same.txt"]
    assert (tmp_path / "same.txt").read_text(encoding="utf-8") == text


def test_a_failed_prepare_leaves_the_previous_token_file_as_it_was(tmp_path, capsys, monkeypatch):
    """A prepare into a good train.bin that fails (bad input found once read, a bad tokenizer,
    Ctrl-C while writing): its three files as they were, no temporary files, and it trains."""
    monkeypatch.chdir(tmp_path)
    Path("corpus.txt").write_text(stdlib_text(20_000), encoding="utf-8")
    prepare_main(["corpus.txt", "train.bin", "--train-bpe", "300"])
    Path("latin.txt").write_bytes("café, naïve\n".encode("latin-1") * 100)  # not UTF-8
    Path("bad.json").write_text('{"model": 1}')
    before = files(tmp_path)
    for args in [
        ["latin.txt", "train.bin", "--train-bpe", "300"],  # found while training the BPE
        ["latin.txt", "train.bin", "--tokenizer", "train.bin.tokenizer.json"],  # encoding
        ["corpus.txt", "train.bin", "--tokenizer", "bad.json"],
    ]:
        with pytest.raises(SystemExit):  # its exit code and line: the test below
            prepare_main(args)
        assert files(tmp_path) == before, args

    def interrupted(*args):
        yield np.zeros(1000, dtype=np.uint16)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "encoded", interrupted)
    monkeypatch.setattr(prepare_module, "byte_ids", interrupted)
    for args in (["--train-bpe", "300"], ["--tokenizer", "train.bin.tokenizer.json"], []):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:  # one line, exit 130, as train.py's Ctrl-C
            prepare_main(["corpus.txt", "train.bin", *args])
        said = "python -m mgpu.data.prepare: interrupted (Ctrl-C); train.bin left as it was\n"
        assert stop.value.code == 130 and capsys.readouterr().err == said, args
        assert files(tmp_path) == before, args
    cfg = to_config(compose_config(f"data.path={tmp_path / 'train.bin'}"))
    assert cfg.data.vocab_size == 300


def test_an_output_that_is_a_directory_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("some text\n" * 100)
    (tmp_path / "out").mkdir()
    line = refused([str(tmp_path / "in.txt"), str(tmp_path / "out")], capsys)
    assert f"output '{tmp_path / 'out'}' is a directory" in line, line
    assert f"e.g. {tmp_path / 'out' / 'train.bin'}" in line, line
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out"] and not os.listdir(tmp_path / "out")


@pytest.mark.parametrize(
    "text, tokenizer, said",
    [
        ("latin", "--train-bpe", "input file '{dir}/in.txt': not UTF-8 text (byte 3); a "),
        ("latin", "words.json", "input file '{dir}/in.txt': not UTF-8 text (byte 3); a "),
        ("utf-8", "nope.json", "--tokenizer '{dir}/nope.json': no such file; give the path "),
        ("utf-8", "bad.json", "--tokenizer {dir}/bad.json: not a readable tokenizer.json ("),
    ],
    ids=["not-utf8-bpe", "not-utf8-tokenizer", "no-tokenizer-file", "unreadable-tokenizer"],
)
def test_bad_input_exits_2_naming_the_file_and_the_fix(tmp_path, capsys, text, tokenizer, said):
    """As for its other bad arguments: one line, exit 2, nothing written."""
    (tmp_path / "in.txt").write_bytes("café\n".encode(text) * 100)
    word_tokenizer(tmp_path / "words.json", 300)
    (tmp_path / "bad.json").write_text('{"model": 1}')
    args = [str(tmp_path / "in.txt"), str(tmp_path / "o.bin")]
    args += ["--train-bpe", "300"] if tokenizer == "--train-bpe" else ["--tokenizer"]
    line = refused(args + [str(tmp_path / tokenizer)] * (tokenizer != "--train-bpe"), capsys)
    assert said.format(dir=tmp_path) in line, line
    fix = "convert it to UTF-8" if text == "latin" else "Hugging Face tokenizer.json"
    assert fix in line, line
    assert sorted(os.listdir(tmp_path)) == ["bad.json", "in.txt", "words.json"]


def test_a_bpe_short_of_merges_says_its_vocabulary_is_smaller(tmp_path, capsys):
    """--train-bpe 4000 on 40 kB of text: fewer tokens, and the command says so."""
    (tmp_path / "in.txt").write_text(stdlib_text(20_000), encoding="utf-8")
    for n in (300, 4000):
        prepare_main([str(tmp_path / "in.txt"), str(tmp_path / "t.bin"), "--train-bpe", str(n)])
        out = capsys.readouterr().out
        made = json.loads((tmp_path / "t.bin.meta.json").read_text())["vocab_size"]
        if n == 300:
            assert made == 300 and "vocabulary 300)" in out, out
        else:
            assert 300 < made < n, made
            said = f"vocabulary {made:,}, not 4,000: the text had no more merges than that)"
            assert said in out, out


def test_a_token_file_without_metadata_needs_its_tokenizer_named(tmp_path):
    path = tmp_path / "old.bin"
    np.frombuffer(b"some bytes\n" * 2000, dtype=np.uint8).astype("<u2").tofile(path)
    with pytest.raises(ConfigError, match=r"data\.tokenizer='auto'.*old\.bin\.meta\.json"):
        to_config(compose_config(f"data.path={path}"))
    cfg = to_config(compose_config(f"data.path={path}", "data.tokenizer=bytes"))
    assert (cfg.data.vocab_size, cfg.model.vocab_size) == (256, 256)


def test_token_ids_without_a_tokenizer_need_the_vocabulary_given(tmp_path):
    path = tmp_path / "ids.bin"
    (np.arange(20_000) % 300).astype("<u2").tofile(path)
    with pytest.raises(ConfigError, match=r"data\.vocab_size='auto'.*data\.tokenizer=none"):
        to_config(compose_config(f"data.path={path}", "data.tokenizer=none"))
    cfg = to_config(
        compose_config(f"data.path={path}", "data.tokenizer=none", "data.vocab_size=300")
    )
    assert (cfg.data.tokenizer, cfg.data.vocab_size, cfg.model.vocab_size) == ("none", 300, 320)
    with pytest.raises(ConfigError, match=r"data\.vocab_size=256: is not above token id 299"):
        to_config(compose_config(f"data.path={path}", "data.tokenizer=bytes"))


@pytest.mark.parametrize("model, context", [("gpt_tiny", 64), ("gpt2_small", 1024)])
def test_the_sequence_length_follows_the_models_context(tmp_path, model, context):
    """data.seq_len=auto (the default): data=tokens on the default model no longer stops on
    1024 > model.block_size=64; the number is recorded for the run's config.yaml."""
    path = tmp_path / "ids.bin"
    (np.arange(300_000) % 256).astype("<u2").tofile(path)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        args = [f"model={model}", "data=tokens", f"data.path={path}", "data.tokenizer=bytes"]
        composed = compose(config_name="config", overrides=args)
    assert to_config(composed).data.seq_len == context
    assert yaml.safe_load(resolved_yaml(composed))["data"]["seq_len"] == context


@pytest.mark.parametrize("tokenizer", ["auto", "bytes", "none"])
def test_a_text_file_is_not_read_as_token_ids(tmp_path, tokenizer):
    text = tmp_path / "corpus.txt"
    text.write_text("Ünïcode text, line after line.\n" * 2000, encoding="utf-8")
    args = [f"data.path={text}", f"data.tokenizer={tokenizer}", "data.vocab_size=50257"]
    with pytest.raises(ConfigError, match=r"holds text.*python -m mgpu\.data\.prepare"):
        to_config(compose_config(*args))


def test_a_tokenizer_changed_since_prepare_is_refused(tmp_path):
    (tmp_path / "in.txt").write_text(stdlib_text(20_000), encoding="utf-8")
    prepare_main([str(tmp_path / "in.txt"), str(tmp_path / "t.bin"), "--train-bpe", "300"])
    to_config(compose_config(f"data.path={tmp_path / 't.bin'}"))
    tok_file = tmp_path / "t.bin.tokenizer.json"
    tok_file.write_text(tok_file.read_text() + "\n")
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*is not the tokenizer that made"):
        to_config(compose_config(f"data.path={tmp_path / 't.bin'}"))


@pytest.mark.parametrize("vocab, tokenizer", [(256, "bytes"), (50304, "")])
def test_a_run_saved_before_tokenizers_were_recorded(tmp_path, vocab, tokenizer):
    """Such a run of vocabulary 256 is byte-level (all mgpu.data.prepare wrote then); any other
    recorded no tokenizer, and mgpu.sample says so."""
    path = tmp_path / "t.bin"
    np.zeros(20_000, dtype="<u2").tofile(path)  # enough windows for seq_len and eval_samples
    args = [f"data.path={path}", "data.tokenizer=bytes", f"data.vocab_size={vocab}"]
    composed = compose_config(*args)
    to_config(composed)  # records what auto resolved to, as train.py does
    old = yaml.safe_load(resolved_yaml(composed))
    del old["data"]["tokenizer"], old["data"]["tokenizer_sha256"]
    cfg = saved_config(yaml.safe_dump(old), [])
    assert (cfg.data.tokenizer, cfg.data.vocab_size) == (tokenizer, vocab)
    restored = Restored(tmp_path / "checkpoints" / "step-1", 1, cfg, model=None)
    if tokenizer:
        assert restored.tokenizer().decode([104, 105]) == b"hi"
    else:
        with pytest.raises(UsageError, match="records no data.tokenizer"):
            restored.tokenizer()


def test_sample_generates_200_tokens_unless_told():
    assert parse_args(["run", "--prompt", "x"]).tokens == DEFAULT_TOKENS == 200


# ------------------------------------------------ a run's tokenizer is fixed once it trained


def swapped_tokenizer(source: Path, out: Path) -> Path:
    """`source` (a BPE tokenizer.json) with the ids of two byte tokens swapped: a text encodes to
    as many tokens as before (the same windows), but ids 'e' and 't' mean each other."""
    tree = json.loads(source.read_text())
    vocab = tree["model"]["vocab"]
    vocab["e"], vocab["t"] = vocab["t"], vocab["e"]
    out.write_text(json.dumps(tree))
    return out


def refused_by(main, args: list, capsys) -> str:
    """The one line a command's main (in this process) refuses `args` with, exit code 2;
    `capsys` or capsysbinary."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([str(a) for a in args])
    out, err = (s.decode() if isinstance(s, bytes) else s for s in capsys.readouterr())
    lines = err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and not out, (stop.value.code, out, err)
    return lines[0]


def test_evaluate_refuses_tokens_of_another_tokenizer_and_says_how_to_fix(
    bpe_run, tmp_path, capsys
):
    """data.path=a file made with another tokenizer: refused naming the file's tokenizer and the
    run's, each with its own hash, and how to make a file the run can read, which then works;
    data.tokenizer=auto on top (what the old line advised) does not replace the run's."""
    run_dir = bpe_run / "run"
    kept = run_dir / "tokenizer.json"
    ours, before = sha256(kept), kept.read_bytes()
    swapped = swapped_tokenizer(kept, tmp_path / "swapped.json")
    other = tmp_path / "other.bin"
    prepare_main([str(bpe_run / "text.txt"), str(other), "--tokenizer", str(swapped)])
    fix = f"python -m mgpu.data.prepare TEXT OUT.bin --tokenizer {kept}"
    line = refused_by(evaluate.main, [run_dir, f"data.path={other}"], capsys)
    said = f"mgpu.evaluate: error: data.path='{other}': its tokens are not the run's: "
    assert line.startswith(said), line
    made_with, _, trained_on = line.partition("and the run trained on")
    assert f"sha256 {sha256(swapped)[:12]}" in made_with and ours[:12] not in made_with, line
    assert f"sha256 {ours[:12]}" in trained_on and fix in trained_on, line
    for tokenizer in ("auto", str(other) + ".tokenizer.json"):
        args = [run_dir, f"data.path={other}", f"data.tokenizer={tokenizer}"]
        line = refused_by(evaluate.main, args, capsys)
        said = f"data.tokenizer='{tokenizer}': a trained checkpoint's tokenizer cannot be changed"
        assert said in line and fix in line and "copy" not in line, line
    assert kept.read_bytes() == before
    # the run's own tokenizer named again, as a relative path (config.yaml saves it absolute)
    text = (run_dir / "config.yaml").read_text()
    own_path = os.path.relpath(yaml.safe_load(text)["data"]["tokenizer"])
    assert saved_config(text, [f"data.tokenizer={own_path}"]).data.tokenizer.endswith(".json")
    # The fix: the same text prepared with the run's tokenizer is the run's own token file.
    fixed = tmp_path / "fixed.bin"
    prepare_main([str(bpe_run / "text.txt"), str(fixed), "--tokenizer", str(kept)])
    capsys.readouterr()
    evaluate.main([str(run_dir)])
    own = capsys.readouterr().out
    evaluate.main([str(run_dir), f"data.path={fixed}"])
    assert capsys.readouterr().out == own and "eval loss" in own, own


def test_sample_and_export_never_read_the_token_file(bpe_run, tmp_path, capsysbinary):
    """The run's token file prepared again at its path with another tokenizer, then its metadata
    made unreadable and the file text: sample and export (in this process) work from the
    checkpoint and the run's own tokenizer.json alone; evaluate, which reads the file, refuses."""
    run_dir = bpe_run / "run"
    names = ("text.bin", "text.bin.meta.json", "text.bin.tokenizer.json")
    kept = {name: (bpe_run / name).read_bytes() for name in names}
    expected = sample(run_dir, capsysbinary, "--tokens", 20, "--temperature", 0)
    swapped = swapped_tokenizer(run_dir / "tokenizer.json", tmp_path / "swapped.json")
    try:
        prepare_main(
            [str(bpe_run / "text.txt"), str(bpe_run / "text.bin"), "--tokenizer", str(swapped)]
        )
        for damage in ("prepared-again", "unreadable"):
            if damage == "unreadable":
                (bpe_run / "text.bin.meta.json").write_text("{ not json")
                (bpe_run / "text.bin").write_text("plain text, not token ids\n" * 1000)
            assert sample(run_dir, capsysbinary, "--tokens", 20, "--temperature", 0) == expected
            export.main([str(run_dir), str(tmp_path / f"{damage}.safetensors")])
            # the export carries the run's own tokenizer beside it, and its config names that
            config = json.loads((tmp_path / f"{damage}.json").read_text())
            assert config["data"]["tokenizer"] == f"{damage}.tokenizer.json", config["data"]
            copy = (tmp_path / f"{damage}.tokenizer.json").read_bytes()
            assert copy == (run_dir / "tokenizer.json").read_bytes()
        prepare_main(
            [str(bpe_run / "text.txt"), str(bpe_run / "text.bin"), "--tokenizer", str(swapped)]
        )
        line = refused_by(evaluate.main, [run_dir], capsysbinary)
        assert "its tokens are not the run's" in line, line
    finally:
        for name, data in kept.items():
            (bpe_run / name).write_bytes(data)


def test_a_checkpoint_away_from_its_run_exports_its_weights_without_a_tokenizer(
    bpe_run, tmp_path, capsys
):
    """A checkpoint copied out of its run directory (no tokenizer.json beside it): the weights
    are exported all the same, a warning says the export holds no tokenizer, and its config
    names the tokenizer the run recorded."""
    step = sorted((bpe_run / "run" / "checkpoints").glob("step-*"))[-1]
    shutil.copytree(step, tmp_path / "away" / "checkpoints" / step.name)
    export.main(
        [str(tmp_path / "away" / "checkpoints" / step.name), str(tmp_path / "m.safetensors")]
    )
    assert "the export holds no tokenizer" in capsys.readouterr().err
    config = json.loads((tmp_path / "m.json").read_text())
    assert config["data"]["tokenizer"].endswith("text.bin.tokenizer.json"), config["data"]
    assert (tmp_path / "m.safetensors").is_file() and not (tmp_path / "m.tokenizer.json").exists()


def test_a_run_whose_tokenizer_json_changed_is_refused_without_advice_to_copy_another(
    bpe_run, tmp_path, capsys
):
    """The run directory's tokenizer.json replaced (a copy of another tokenizer put there): sample
    refuses in one line, exit 1 (the run directory is damaged, not the command line), naming the
    hash to look for rather than a file to copy, since the file the run trained from may hold
    another tokenizer by now."""
    run_dir = tmp_path / "run"
    shutil.copytree(bpe_run / "run", run_dir)
    ours = sha256(run_dir / "tokenizer.json")
    swapped_tokenizer(bpe_run / "run" / "tokenizer.json", run_dir / "tokenizer.json")
    with pytest.raises(SystemExit) as stop:
        sample_main([str(run_dir), "--prompt", PROMPT])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 1 and len(lines) == 1, lines
    assert f"the file whose sha256 is {ours}" in lines[0], lines[0]
    assert "copy" not in lines[0].replace("a copy of the tokenizer the run trained with", "")


def resumed_onto(bpe_run: Path, tmp_path: Path, token_file: Path) -> subprocess.CompletedProcess:
    """train.py resuming a copy of bpe_run's run, for 5 more steps, on `token_file`."""
    shutil.copytree(bpe_run / "run", tmp_path / "run")
    args = [*TRAIN, f"data.path={token_file}", f"hydra.run.dir={tmp_path / 'run'}"]
    return run_train([*args, f"trainer.max_steps={STEPS + 5}"], cwd=tmp_path, nproc=None)


def test_a_resume_onto_tokens_of_another_tokenizer_is_refused_before_writing(
    bpe_run, tmp_path, capsysbinary
):
    """The run's text prepared with another tokenizer of as many tokens (so as many windows: the
    same training set by its size): refused in one line, exit 2, before the run directory's
    config.yaml, tokenizer.json or checkpoints change, so its checkpoint still samples."""
    swapped = swapped_tokenizer(bpe_run / "run" / "tokenizer.json", tmp_path / "swapped.json")
    other = tmp_path / "other.bin"
    prepare_main([str(bpe_run / "text.txt"), str(other), "--tokenizer", str(swapped)])
    assert other.stat().st_size == (bpe_run / "text.bin").stat().st_size
    proc = resumed_onto(bpe_run, tmp_path, other)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in said_lines(proc) if "its tokens are not the run's" in line]
    assert len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]
    fix = f"--tokenizer {tmp_path / 'run' / 'tokenizer.json'}), or train afresh in another run"
    assert f"sha256 {sha256(swapped)[:12]}" in lines[0] and fix in lines[0], lines[0]
    run_dir = tmp_path / "run"
    for name in ("config.yaml", "tokenizer.json"):
        assert (run_dir / name).read_bytes() == (bpe_run / "run" / name).read_bytes(), name
    assert os.listdir(run_dir / "checkpoints") == os.listdir(bpe_run / "run" / "checkpoints")
    original = sample(bpe_run / "run", capsysbinary, "--tokens", 20, "--temperature", 0)
    assert sample(run_dir, capsysbinary, "--tokens", 20, "--temperature", 0) == original


@pytest.mark.parametrize("vocab", [500, 600])  # the model's 512 rows; 640
def test_a_resume_onto_a_file_prepared_again_names_its_tokenizer(bpe_run, tmp_path, vocab):
    """A file prepared again with a BPE of another size changes the model's shapes or the
    training set's size too: the line names the tokenizer, the cause, not those."""
    other = tmp_path / "other.bin"
    prepare_main([str(bpe_run / "text.txt"), str(other), "--train-bpe", str(vocab)])
    proc = resumed_onto(bpe_run, tmp_path, other)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in said_lines(proc) if "its tokens are not the run's" in line]
    assert len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]


def resumed_settings(tmp_path: Path, saved: dict, now: dict) -> None:
    """check_settings of a resume from a checkpoint whose config's data section is `saved`, onto
    a run whose data section is `now`."""
    path = tmp_path / "run" / "checkpoints" / "step-00000001"
    loaded = Loaded(path, 1, 1, {"config": yaml.safe_dump({"data": saved})}, None)
    check_settings(loaded, OptimConfig(), 10, say=False, config_text=yaml.safe_dump({"data": now}))


BPE = {"tokenizer": "a.bin.tokenizer.json", "tokenizer_sha256": "a" * 64, "vocab_size": 512}
BYTE_LEVEL = {"tokenizer": "bytes", "tokenizer_sha256": "", "vocab_size": 256}


@pytest.mark.parametrize(
    "saved, now, refused",
    [
        (
            {**BPE, "tokenizer": "bytes", "tokenizer_sha256": "", "vocab_size": 256},
            BPE,
            "byte-level",
        ),
        (BPE, {**BPE, "tokenizer_sha256": "b" * 64}, "sha256 bbbbbbbbbbbb"),
        (BPE, {**BPE, "tokenizer": "none", "tokenizer_sha256": ""}, "data.tokenizer=none"),
        (BPE, {**BPE, "vocab_size": 520}, "data.vocab_size=520: "),
        # the same tokenizer, moved: a change logged, not refused
        (BPE, {**BPE, "tokenizer": "/elsewhere/t.json"}, None),
        # data without a tokenizer (images), or a checkpoint saved before runs recorded one
        ({"vocab_size": 512}, BPE, None),
    ],
)
def test_a_resume_refuses_token_ids_of_another_tokenizer(tmp_path, saved, now, refused):
    if refused is None:
        resumed_settings(tmp_path, saved, now)
        return
    with pytest.raises(CheckpointMismatch) as stop:
        resumed_settings(tmp_path, saved, now)
    line = str(stop.value)
    assert refused in line and "\n" not in line and "hydra.run.dir=" in line, line
    assert stop.value.exit_code == 2
