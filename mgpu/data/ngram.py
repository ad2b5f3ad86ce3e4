"""Learnable synthetic token sequences drawn from a fixed random n-gram source.

Every context has exactly `branching` distinct successors, each with probability 1/branching, so
the true conditional entropy is exactly ln(branching) nats per token (the loss floor a model can
reach), whatever the stationary distribution of contexts.
"""

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

SPLIT_IDS = {"train": 0, "eval": 1}
TABLE_STREAM = 2  # rng stream id of the successor table; never a split id, so never a sample's
MAX_ROWS = 65536  # contexts beyond this many share rows through a hash
HASH_BASE = 1_000_003  # odd prime base of the polynomial context hash


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name}={value} must be a positive integer")


def _split_id(split: str) -> int:
    if split not in SPLIT_IDS:
        raise ValueError(f"split={split!r} is not a known split; use 'train' or 'eval'")
    return SPLIT_IDS[split]


def _distinct_rows(rng: np.random.Generator, rows: int, vocab: int, k: int) -> np.ndarray:
    """[rows, k] int64 table; each row is a uniform random set of k distinct tokens < vocab."""
    if k * k < 8 * vocab:
        # Floyd's sampling, vectorized over rows: k draws, cost ~rows*k^2/2, cheap for small k.
        out = np.empty((rows, k), dtype=np.int64)
        for col, j in enumerate(range(vocab - k, vocab)):
            t = rng.integers(0, j + 1, size=rows)
            taken = (out[:, :col] == t[:, None]).any(axis=1)
            out[:, col] = np.where(taken, j, t)  # j cannot be taken yet: earlier draws are < j
        return out
    # Large k relative to vocab: the k smallest of random keys, in row chunks to bound memory.
    chunks = []
    for start in range(0, rows, 1024):
        keys = rng.random((min(1024, rows - start), vocab), dtype=np.float32)
        chunks.append(np.argpartition(keys, k - 1, axis=1)[:, :k].astype(np.int64))
    return np.concatenate(chunks)


class NgramTokens(Dataset):
    """Token sequences from a random n-gram source; sample i is a pure function of (args, i)."""

    def __init__(
        self,
        split: str,
        vocab_size: int = 256,
        seq_len: int = 64,
        order: int = 1,
        branching: int = 4,
        num_samples: int = 100_000,
        eval_samples: int = 1024,
        seed: int = 1234,
    ):
        self._split_id = _split_id(split)
        _check_positive(
            vocab_size=vocab_size,
            seq_len=seq_len,
            order=order,
            branching=branching,
            num_samples=num_samples,
            eval_samples=eval_samples,
        )
        if branching > vocab_size:
            raise ValueError(
                f"branching={branching} exceeds vocab_size={vocab_size}; a context "
                f"cannot have more distinct successors than there are tokens"
            )
        if seq_len < order:
            raise ValueError(
                f"seq_len={seq_len} is shorter than order={order}; a sample would "
                f"hold no n-gram transition, so use seq_len >= order"
            )
        self.split = split
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.order = order
        self.branching = branching
        self.seed = seed
        self.tokens_per_sample = seq_len
        self.sample_shape = (seq_len,)  # an input's shape (for FLOPs)
        self.entropy_nats = math.log(branching)
        self._len = num_samples if split == "train" else eval_samples

        # Few enough contexts: base vocab_size makes the hash an exact mixed-radix index (no
        # collisions). Otherwise contexts share rows, which still leaves each one exactly
        # `branching` distinct successors, so the entropy stays ln(branching).
        exact = vocab_size**order <= MAX_ROWS
        self._rows = vocab_size**order if exact else MAX_ROWS
        self._base = vocab_size if exact else HASH_BASE
        self._top = pow(self._base, order - 1, self._rows)  # weight of the oldest context token
        table_rng = np.random.default_rng([seed, TABLE_STREAM, 0])  # fixed by seed, not split
        self.successors = _distinct_rows(table_rng, self._rows, vocab_size, branching)
        # The walk below is sequential python; nested-list indexing is far faster than numpy
        # scalar indexing there.
        self._succ = self.successors.tolist()

    def __len__(self) -> int:
        return self._len

    def context_row(self, context: Sequence[int]) -> int:
        """Row of `successors` that holds the successors of `context` (the last `order` tokens)."""
        if len(context) != self.order:
            raise ValueError(f"context has {len(context)} tokens, expected order={self.order}")
        h = 0
        for tok in context:
            h = (h * self._base + int(tok)) % self._rows
        return h

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} out of range for {self.split} split of {self._len}")
        rng = np.random.default_rng([self.seed, self._split_id, i])
        order, succ = self.order, self._succ
        toks = rng.integers(0, self.vocab_size, size=order).tolist()
        picks = rng.integers(0, self.branching, size=self.seq_len + 1 - order).tolist()
        if order == 1:
            t, append = toks[0], toks.append
            for c in picks:
                t = succ[t][c]
                append(t)
        else:
            h, base, rows, top = self.context_row(toks), self._base, self._rows, self._top
            for c in picks:
                t = succ[h][c]
                # Rolling hash: drop the oldest context token, shift, append t.
                h = ((h - toks[-order] * top) * base + t) % rows
                toks.append(t)
        seq = torch.tensor(toks, dtype=torch.int64)
        return seq[:-1], seq[1:]
