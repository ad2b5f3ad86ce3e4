"""Tests for mgpu.data: the dataset contract, the n-gram source, images, token files, prepare."""

import math
import os
import pickle
import subprocess
import sys
from collections import Counter, defaultdict
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from mgpu.data import NgramTokens, SyntheticImages, TokenFile
from mgpu.data.images import normalize_uint8
from mgpu.data.loader import worker_context
from mgpu.data.prepare import main as prepare_main

REPO_ROOT = Path(__file__).resolve().parents[1]

SMALL = {
    NgramTokens: dict(vocab_size=32, seq_len=16, num_samples=50, eval_samples=10),
    SyntheticImages: dict(image_size=8, num_samples=50, eval_samples=10),
}


def assert_same_sample(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- the shared dataset contract


@pytest.mark.parametrize("cls", [NgramTokens, SyntheticImages])
def test_deterministic_across_calls_and_instances(cls):
    ds = cls("train", **SMALL[cls])
    first = [ds[i] for i in (7, 3, 0)]
    again = [ds[i] for i in (0, 3, 7)][::-1]  # other order
    fresh = cls("train", **SMALL[cls])
    for a, b, c in zip(first, again, [fresh[i] for i in (7, 3, 0)], strict=True):
        assert_same_sample(a, b)
        assert_same_sample(a, c)
    unpickled = pickle.loads(pickle.dumps(ds))
    assert_same_sample(ds[7], unpickled[7])


@pytest.mark.parametrize("cls", [NgramTokens, SyntheticImages])
def test_train_and_eval_differ(cls):
    train, evl = cls("train", **SMALL[cls]), cls("eval", **SMALL[cls])
    assert len(train) == 50 and len(evl) == 10
    assert not torch.equal(train[0][0], evl[0][0])
    assert not torch.equal(
        torch.stack([train[i][0] for i in range(10)]), torch.stack([evl[i][0] for i in range(10)])
    )
    other_seed = cls("train", **SMALL[cls], seed=99)
    assert not torch.equal(train[0][0], other_seed[0][0])


@pytest.mark.parametrize("cls", [NgramTokens, SyntheticImages])
def test_bad_split_and_index(cls):
    with pytest.raises(ValueError, match="'val'"):
        cls("val", **SMALL[cls])
    ds = cls("eval", **SMALL[cls])
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(seq_len=-1), "seq_len=-1"),
        (dict(num_samples=0), "num_samples=0"),
        (dict(vocab_size=8, branching=9), "branching=9"),
        (dict(order=4, seq_len=3), "order=4"),
    ],
)
def test_ngram_rejects_bad_args(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        NgramTokens("train", **kwargs)


def test_images_reject_bad_args():
    with pytest.raises(ValueError, match="image_size=0"):
        SyntheticImages("train", image_size=0)
    with pytest.raises(ValueError, match="noise=-1"):
        SyntheticImages("train", noise=-1.0)


# ---------------------------------------------------------------- n-gram tokens


def test_ngram_sample_layout():
    ds = NgramTokens("train", vocab_size=50, seq_len=33)
    x, y = ds[11]
    assert x.shape == y.shape == (33,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])  # targets are inputs shifted by one
    assert int(x.min()) >= 0 and int(y.max()) < 50
    assert ds.tokens_per_sample == 33 and ds.vocab_size == 50
    assert ds.entropy_nats == pytest.approx(math.log(4))


def transitions(ds, n):
    """{context tuple: Counter of next tokens} over the first n samples."""
    table = defaultdict(Counter)
    for i in range(n):
        x, y = ds[i]
        seq = torch.cat([x, y[-1:]]).tolist()
        for k in range(ds.order, len(seq)):
            table[tuple(seq[k - ds.order : k])][seq[k]] += 1
    return table


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(vocab_size=32, order=1, branching=4),
        dict(vocab_size=12, order=2, branching=3),  # exact context index
        dict(vocab_size=300, order=2, branching=5),  # 90000 contexts > 65536 rows: hashed
        dict(vocab_size=16, order=1, branching=16),  # every token is a successor
    ],
)
def test_ngram_transitions_follow_table(kwargs):
    ds = NgramTokens("train", seq_len=64, **kwargs)
    b = ds.branching
    rows = np.sort(ds.successors, axis=1)
    assert ds.successors.shape[1] == b and (np.diff(rows, axis=1) > 0).all()  # distinct per row
    assert rows.min() >= 0 and rows.max() < ds.vocab_size
    seen = transitions(ds, 300)
    for ctx, nexts in seen.items():
        assert set(nexts) <= set(ds.successors[ds.context_row(ctx)].tolist()), ctx
        if nexts.total() >= 40 * b:  # enough draws that every successor shows up
            assert len(nexts) == b, (ctx, nexts)
    well_seen = sum(nexts.total() >= 40 * b for nexts in seen.values())
    if ds.vocab_size**ds.order <= 1024:
        assert well_seen >= len(seen) // 2  # the distinct-count check above did run


def test_ngram_table_fixed_by_seed_not_split():
    a, b = NgramTokens("train", seed=5), NgramTokens("eval", seed=5)
    assert np.array_equal(a.successors, b.successors)
    assert not np.array_equal(a.successors, NgramTokens("train", seed=6).successors)


@pytest.mark.parametrize(
    "kwargs, n",
    [
        (dict(vocab_size=64, order=1, branching=4), 800),
        (dict(vocab_size=16, order=2, branching=3), 600),
        (dict(vocab_size=256, order=1, branching=2), 1500),
    ],
)
def test_ngram_empirical_entropy_is_log_branching(kwargs, n):
    ds = NgramTokens("train", seq_len=64, **kwargs)
    seen = transitions(ds, n)
    total = sum(c.total() for c in seen.values())
    h = 0.0
    for nexts in seen.values():
        m = nexts.total()
        h -= sum(k * math.log(k / m) for k in nexts.values()) / total
    assert h == pytest.approx(ds.entropy_nats, rel=0.05)


# ---------------------------------------------------------------- synthetic images


def test_images_dtype_shape_labels():
    ds = SyntheticImages("train", num_classes=7, image_size=12, channels=2, num_samples=300)
    labels = []
    for i in range(300):
        x, y = ds[i]
        assert x.dtype == torch.uint8 and x.shape == (2, 12, 12)
        assert y.dtype == torch.int64 and y.shape == ()
        labels.append(int(y))
    assert set(labels) == set(range(7))  # all classes drawn, none out of range
    assert ds.tokens_per_sample is None and ds.num_classes == 7


def corr(a, b):
    return float(np.corrcoef(np.ravel(a), np.ravel(b))[0, 1])


def test_images_class_means_match_templates():
    ds = SyntheticImages("train", num_classes=5, image_size=16, num_samples=1000, noise=12.0)
    t = ds.templates.numpy()
    assert t.shape == (5, 3, 16, 16)
    for a in range(5):
        for b in range(a + 1, 5):
            assert abs(corr(t[a], t[b])) < 0.8  # templates are distinct patterns
    sums, counts = np.zeros_like(t, dtype=np.float64), np.zeros(5)
    for i in range(500):
        x, y = ds[i]
        sums[int(y)] += x.numpy()
        counts[int(y)] += 1
    for k in range(5):
        mean = sums[k] / counts[k]
        own = corr(mean, t[k])
        assert own > 0.85
        assert all(own > corr(mean, t[j]) + 0.3 for j in range(5) if j != k)


def test_images_reach_dataloader_workers_as_handles_and_give_the_same_samples():
    """A worker gets the dataset pickled as multiprocessing pickles it: the template and noise
    banks (here 2.4 MB) travel as shared-memory handles, and the worker's samples are the
    process's own."""
    ds = SyntheticImages("eval", num_classes=100, image_size=64, eval_samples=8)
    assert len(ForkingPickler.dumps(ds)) < ds.templates.nbytes / 100
    loader = DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context=worker_context(ds))
    ((x, y),) = list(loader)
    expected = [ds[i] for i in range(8)]
    assert torch.equal(x, torch.stack([e[0] for e in expected]))
    assert torch.equal(y, torch.stack([e[1] for e in expected]))


def test_images_without_noise_are_shifted_templates():
    ds = SyntheticImages("eval", num_classes=3, image_size=10, noise=0.0)
    shifts = set()
    for i in range(20):
        x, y = ds[i]
        diff = x.numpy().astype(np.float64) - ds.templates[int(y)].numpy()
        assert np.ptp(diff) <= 1.0 + 1e-4  # one brightness shift for the whole image, +-rounding
        assert abs(diff.mean()) <= 16.5
        shifts.add(round(float(diff.mean()), 3))
    assert len(shifts) > 10  # the shift varies per sample


def test_normalize_uint8():
    ds = SyntheticImages("train", image_size=32)
    batch = torch.stack([ds[i][0] for i in range(32)])
    out = normalize_uint8(batch)
    assert out.dtype == torch.float32 and out.shape == batch.shape
    assert abs(out.mean().item()) < 0.2 and 0.6 < out.std().item() < 1.4
    assert batch.dtype == torch.uint8  # input left untouched
    ends = normalize_uint8(torch.tensor([0, 255], dtype=torch.uint8))
    assert torch.allclose(ends, torch.tensor([-2.0, 2.0]))


# ---------------------------------------------------------------- token files and prepare


def write_bin(path, tokens):
    np.asarray(tokens, dtype="<u2").tofile(path)
    return str(path)


@pytest.mark.parametrize("extra", [0, 5])  # file ends exactly on the last window, or past it
def test_token_file_windows_reproduce_file(tmp_path, extra):
    seq_len, windows, evals = 8, 20, 3
    tokens = np.random.default_rng(0).integers(0, 1000, windows * seq_len + 1 + extra)
    path = write_bin(tmp_path / "t.bin", tokens)
    train = TokenFile("train", path, seq_len=seq_len, eval_samples=evals, vocab_size=1000)
    evl = TokenFile("eval", path, seq_len=seq_len, eval_samples=evals, vocab_size=1000)
    assert len(train) == windows - evals and len(evl) == evals
    # Window w holds tokens [w*seq_len, w*seq_len + seq_len + 1): train first, then eval.
    for w, (x, y) in enumerate(
        [train[i] for i in range(len(train))] + [evl[i] for i in range(len(evl))]
    ):
        start = w * seq_len
        assert x.dtype == y.dtype == torch.int64
        assert x.tolist() == tokens[start : start + seq_len].tolist()
        assert y.tolist() == tokens[start + 1 : start + seq_len + 1].tolist()
    assert train.tokens_per_sample == seq_len


def test_token_file_errors(tmp_path):
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError, match=r"nope\.bin.*mgpu\.data\.prepare"):
        TokenFile("train", missing)
    small = write_bin(tmp_path / "small.bin", np.zeros(4 * 8 + 1))  # exactly 4 windows
    with pytest.raises(ValueError, match=r"33 tokens.*seq_len=8.*eval_samples=4"):
        TokenFile("train", small, seq_len=8, eval_samples=4)
    assert len(TokenFile("train", small, seq_len=8, eval_samples=3)) == 1
    big = np.zeros(100)
    big[57] = 300
    high = write_bin(tmp_path / "high.bin", big)
    with pytest.raises(ValueError, match=r"token 300.*vocab_size=256"):
        TokenFile("train", high, seq_len=8, eval_samples=2, vocab_size=256)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 201)
    with pytest.raises(ValueError, match="multiple of 2"):
        TokenFile("train", str(odd), seq_len=8, eval_samples=2)
    with pytest.raises(ValueError, match="'test'"):
        TokenFile("test", high)
    text = tmp_path / "corpus.txt"
    text.write_text("words on a line\n" * 200)
    with pytest.raises(ValueError, match=r"holds text.*mgpu\.data\.prepare .*corpus\.txt"):
        TokenFile("train", str(text), seq_len=8, eval_samples=2)


def test_token_file_pickles_into_workers(tmp_path):
    tokens = np.arange(64 * 4 + 1) % 251
    path = write_bin(tmp_path / "w.bin", tokens)
    ds = TokenFile("train", path, seq_len=4, eval_samples=8, vocab_size=256)
    ds[0]  # opens the memmap in this process; pickling must still work
    assert_same_sample(pickle.loads(pickle.dumps(ds))[5], ds[5])
    # spawn pickles the dataset into each worker (fork would not exercise that).
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="spawn")
    xs = torch.cat([x for x, _ in loader])
    assert xs.shape == (len(ds), 4)
    assert xs.flatten().tolist() == tokens[: len(ds) * 4].tolist()


def test_prepare_command_round_trip(tmp_path):
    text = "héllo, wörld\n" * 40  # non-ascii: tokens are bytes, not characters
    src, dst = tmp_path / "in.txt", tmp_path / "out.bin"
    src.write_text(text, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "mgpu.data.prepare", str(src), str(dst)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    n = len(text.encode("utf-8"))
    assert str(n) in proc.stdout.replace(",", "")
    assert f"data=tokens data.path={dst}" in proc.stdout
    assert "byte-level, vocabulary 256" in proc.stdout
    assert np.fromfile(dst, dtype="<u2").tolist() == list(text.encode("utf-8"))
    assert not Path(str(dst) + ".tmp").exists()
    ds = TokenFile("eval", str(dst), seq_len=16, eval_samples=2, vocab_size=256)
    x, y = ds[1]
    start = (n - 1) // 16 * 16 - 16  # the last window
    assert bytes(x.tolist()) == text.encode("utf-8")[start : start + 16]


def test_prepare_errors(tmp_path, capsys):
    """Input that cannot work: exit 2 and the reason as the last line, as for bad arguments."""
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    text = tmp_path / "in.txt"
    text.write_text("some text")
    for args, said in [
        ([str(tmp_path / "missing.txt"), str(tmp_path / "o.bin")], "missing.txt' not found"),
        ([str(empty), str(tmp_path / "o.bin")], "is empty; there is nothing to tokenize"),
        ([str(text), str(tmp_path / "no" / "o.bin")], "does not exist; create it first"),
    ]:
        with pytest.raises(SystemExit) as exc:
            prepare_main(args)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exc.value.code == 2 and last.endswith(said), last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "in.txt"]  # nothing made
    with pytest.raises(SystemExit) as exc:
        prepare_main(["--help"])
    assert exc.value.code == 0 and "byte-level" in capsys.readouterr().out
