"""Memory-mapped uint16 token file (nanoGPT `.bin` layout: flat little-endian uint16, no header).

Cut into non-overlapping windows of seq_len+1 tokens; the last `eval_samples` windows are eval.
"""

import functools
import logging
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from mgpu.data.tokenizer import META_SUFFIX, TOKENIZER_SUFFIX

TOKEN_DTYPE = np.dtype("<u2")
SCAN_CHUNK = 1 << 24  # tokens per chunk of the construction-time max-token scan
TEXT_PROBE = 1 << 16  # bytes read from the start of a file to tell text from token ids
# Control bytes any text holds: tab, line feed, form feed, carriage return.
TEXT_CONTROLS = frozenset(b"\t\n\f\r")
# Text may hold a few other control bytes (a log's ANSI colour escapes, 0x1b; a stray NUL):
# at most this share of the probe's bytes. Token ids hold far more: an id below 256 puts a NUL
# in its pair, one below 8192 a control byte, and a byte of any id is one of them 1 time in 8.
TEXT_STRAY = 0.01
EVAL_WINDOWS = 256  # data.eval_samples=auto: this many of the file's last windows held out,
EVAL_MOST = 0.1  # but never more than this share of a small file's windows: the rest trains

log = logging.getLogger(__name__)


def max_token(path: str) -> int:
    """The highest token id in the file, scanned once per file version in a process (the config
    check and the dataset both ask, and a file may hold billions of tokens)."""
    stat = os.stat(path)
    return _max_token(path, stat.st_size // TOKEN_DTYPE.itemsize, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _max_token(path: str, n_tokens: int, mtime_ns: int) -> int:
    if n_tokens == 0:
        return -1  # no token at all: an empty file cannot be mapped (and is refused elsewhere)
    data = np.memmap(path, dtype=TOKEN_DTYPE, mode="r", shape=(n_tokens,))
    try:
        # Chunked so a multi-GB file never needs to be resident at once.
        return max(int(data[s : s + SCAN_CHUNK].max()) for s in range(0, n_tokens, SCAN_CHUNK))
    finally:
        del data  # closes the map; workers reopen their own lazily


def looks_like_text(path: str) -> bool:
    """Whether the file starts as text rather than uint16 token ids (module constants say how
    they differ). UTF-8 text (a character cut at the probe's end aside) may hold any other
    control bytes but NULs, which an ANSI-coloured log is full of and byte-level token ids put
    in every other byte; text in another encoding may hold a few control bytes of any kind."""
    with open(path, "rb") as f:
        head = f.read(TEXT_PROBE)
    if not head:
        return False
    most = TEXT_STRAY * len(head)
    try:
        head.decode("utf-8")
        utf8 = True
    except UnicodeDecodeError as err:
        utf8 = err.start >= len(head) - 3  # only a multi-byte character cut by the probe
    if utf8 and head.count(0) <= most:
        return True
    return sum(b < 0x20 and b not in TEXT_CONTROLS for b in head) <= most


def text_error(path: str) -> str:
    """What to say about a text file given as a token file: a token file's metadata or
    tokenizer (JSON text) is named as such, since preparing it as text would not help."""
    for suffix, what in ((META_SUFFIX, "metadata"), (TOKENIZER_SUFFIX, "tokenizer")):
        token_file = path[: -len(suffix)]
        if path.endswith(suffix) and os.path.isfile(token_file):
            return f"is the {what} of the token file {token_file}: use data.path={token_file}"
    return (
        "holds text, not token ids (uint16, nanoGPT's .bin layout): make a token file of it "
        f"with python -m mgpu.data.prepare {path} train.bin, then set data.path=train.bin"
    )


def count_windows(n_tokens: int, seq_len: int) -> int:
    """The non-overlapping windows of seq_len + 1 tokens (input and shifted target) that
    `n_tokens` tokens hold: TokenFile's cut."""
    return max(n_tokens - 1, 0) // seq_len


def auto_eval_samples(windows: int) -> int:
    """data.eval_samples=auto for a file of `windows` windows."""
    return max(1, min(EVAL_WINDOWS, int(EVAL_MOST * windows)))


def eval_windows(windows: int, eval_samples: int | str) -> int:
    """The windows held out: `eval_samples`, or auto's number for the file."""
    return auto_eval_samples(windows) if eval_samples == "auto" else eval_samples


def check_token_file(path: str, seq_len: int, eval_samples: int | str) -> int:
    """The number of tokens in `path`; ValueError (FileNotFoundError) saying how to fix a file
    that is missing, empty, odd-sized or too short for seq_len and eval_samples. The config
    check calls it too, so that these stop before any process group or run directory exists."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"token file {path!r} not found; create it from a text file with "
            f"`python -m mgpu.data.prepare INPUT.txt {path}`"
        )
    if looks_like_text(path):
        raise ValueError(f"token file {path!r} {text_error(path)}")
    n_bytes = os.path.getsize(path)
    if n_bytes % TOKEN_DTYPE.itemsize:
        raise ValueError(
            f"token file {path!r} has {n_bytes} bytes, not a multiple of 2; it "
            f"is not a flat uint16 token file (truncated write?)"
        )
    n_tokens = n_bytes // TOKEN_DTYPE.itemsize
    windows = count_windows(n_tokens, seq_len)
    held = eval_windows(windows, eval_samples)
    if windows <= held:
        empty = "is empty" if n_tokens == 0 else f"has {n_tokens} tokens"
        said = held if eval_samples != "auto" else f"auto ({held} here)"
        raise ValueError(
            f"token file {path!r} {empty}, too few for data.seq_len={seq_len} and "
            f"data.eval_samples={said}: that needs more than {held} windows of "
            f"{seq_len}+1 tokens, i.e. at least {(held + 1) * seq_len + 1} tokens; "
            f"use a bigger file or lower data.seq_len or data.eval_samples"
        )
    return n_tokens


class TokenFile(Dataset):
    """Windows of a `.bin` token file; inputs = window[:-1], targets = window[1:] (int64)."""

    def __init__(
        self,
        split: str,
        path: str,
        seq_len: int = 1024,
        eval_samples: int | str = "auto",
        vocab_size: int = 50304,
    ):
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} is not a known split; use 'train' or 'eval'")
        held = {} if eval_samples == "auto" else dict(eval_samples=eval_samples)
        for name, value in dict(seq_len=seq_len, vocab_size=vocab_size, **held).items():
            if value <= 0:
                raise ValueError(f"{name}={value} must be a positive integer")
        path = os.fspath(path)
        n_tokens = check_token_file(path, seq_len, eval_samples)
        windows = count_windows(n_tokens, seq_len)
        eval_samples = eval_windows(windows, eval_samples)
        highest = max_token(path)
        if highest >= vocab_size:
            raise ValueError(
                f"token file {path!r} holds token {highest}, which is >= "
                f"vocab_size={vocab_size}; set vocab_size to at least {highest + 1}"
            )
        self.split = split
        self.path = path
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.tokens_per_sample = seq_len
        self.sample_shape = (seq_len,)  # an input's shape (for FLOPs)
        self.n_tokens = n_tokens
        self.num_windows = windows
        # Train takes windows [0, windows - eval_samples), eval the rest: never overlapping.
        self._first = 0 if split == "train" else windows - eval_samples
        self._len = windows - eval_samples if split == "train" else eval_samples
        self._data = None  # np.memmap, opened lazily in each process
        if split == "train":  # the whole split, said once: the eval split is built beside it
            train = windows - eval_samples
            log.info(
                "data=tokens %s: train %d windows (%s tokens), eval %d windows (%s tokens, "
                "data.eval_samples) of data.seq_len=%d",
                path, train, f"{train * seq_len:,}", eval_samples, f"{eval_samples * seq_len:,}",
                seq_len,
            )  # fmt: skip

    def __getstate__(self) -> dict:
        # DataLoader workers get a pickled copy; each opens its own map on first use.
        state = self.__dict__.copy()
        state["_data"] = None
        return state

    def __len__(self) -> int:
        return self._len

    def window(self, i: int) -> int:
        """Index in the whole file of this split's i-th window (tokens start at window*seq_len)."""
        return self._first + i

    def target_tokens(self) -> np.ndarray:
        """Every target of this split, in file order: its windows are consecutive, so their
        targets are one stretch of the file (for counting the text they decode to)."""
        start = self._first * self.seq_len + 1
        data = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r", shape=(self.n_tokens,))
        return np.array(data[start : start + self._len * self.seq_len])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} out of range for {self.split} split of {self._len}")
        if self._data is None:
            self._data = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r", shape=(self.n_tokens,))
        start = self.window(i) * self.seq_len
        chunk = torch.from_numpy(self._data[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]
