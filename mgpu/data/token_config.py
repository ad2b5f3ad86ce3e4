"""data=tokens' schema: a token file, the tokenizer that made it (its metadata, or named), its
vocabulary and the sequence length, checked against the file before any process group exists."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from mgpu.config.checks import ConfigError, auto_or_positive_int, require
from mgpu.data.config import DataConfig, short_of_a_batch
from mgpu.data.token_file import (
    TOKEN_DTYPE,
    auto_eval_samples,
    check_token_file,
    count_windows,
    eval_windows,
    looks_like_text,
    max_token,
    text_error,
)
from mgpu.data.tokenizer import (
    BYTES,
    NONE,
    UNDECODED,
    TokenizerError,
    TokenMeta,
    describe_tokenizer,
    load_tokenizer,
    meta_path,
    prepare_with_run_tokenizer,
    read_meta,
    sha256_file,
)

NO_FILE = "no such file; make one from a text file with python -m mgpu.data.prepare"


def no_token_file(path: str) -> ConfigError:
    """data.path names no file: a folder (the token file in it was meant), or nothing."""
    if os.path.isdir(path):
        example = os.path.join(path, "train.bin")
        return ConfigError("data.path", path, f"is a folder; name the token file in it, e.g. "
                           f"data.path={example}")  # fmt: skip
    return ConfigError("data.path", path, NO_FILE)


@dataclass(frozen=True)
class SavedRun:
    """A trained run whose saved config an after-training command reads back (mgpu.restore)."""

    run_dir: Path
    # mgpu.evaluate reads the token file; mgpu.sample and mgpu.export never do: they work after
    # it has gone, or been prepared again with another tokenizer.
    reads_data: bool


# Set while a saved config is validated (reading_saved_run): its values were resolved when the
# run trained, and its tokenizer is the run's, fixed, not one to check the file's against.
_SAVED_RUN: ContextVar[SavedRun | None] = ContextVar("saved_run", default=None)


@contextmanager
def reading_saved_run(run_dir: Path, *, reads_data: bool) -> Iterator[None]:
    """The token file configs validated inside are `run_dir`'s saved one (SavedRun)."""
    token = _SAVED_RUN.set(SavedRun(Path(run_dir), reads_data))
    try:
        yield
    finally:
        _SAVED_RUN.reset(token)


@dataclass
class TokenFileDataConfig(DataConfig):
    _target_: str = "mgpu.data.TokenFile"
    path: str = MISSING  # uint16 tokens, nanoGPT .bin layout (`python -m mgpu.data.prepare`)
    # Tokens a sample holds: auto (the model's context, model.block_size; the run's config.yaml
    # records the number) or a number up to it.
    seq_len: Any = "auto"
    # The file's last windows, held out for evaluation (never trained on). auto: 256, but never
    # more than a tenth of the file's windows (mgpu.data.token_file.auto_eval_samples); the
    # run's config.yaml records the number, so a resumed run or mgpu.evaluate keeps it.
    eval_samples: Any = "auto"
    # Every token id in the file is below this. auto: the size of the file's tokenizer.
    vocab_size: Any = "auto"
    # The tokenizer that made the file: auto (the one its metadata, PATH.meta.json, names), bytes
    # (byte-level tokens), a tokenizer.json (for a file without metadata), or none (token ids
    # only, e.g. nanoGPT's GPT-2 train.bin: data.vocab_size must be given; mgpu.evaluate
    # reports the loss and perplexity, and mgpu.sample, having nothing to decode with,
    # refuses). The run's config.yaml records what was found, and the run directory keeps a
    # copy of the tokenizer.json (mgpu.sample and mgpu.evaluate decode with it). "": none
    # recorded (a run saved before runs recorded their tokenizer).
    tokenizer: str = "auto"
    tokenizer_sha256: str = ""  # the tokenizer.json's sha256; found and recorded by mgpu

    def __post_init__(self) -> None:
        super().__post_init__()
        auto_or_positive_int("data.seq_len", self.seq_len, "the model's context, model.block_size")
        why = "256 windows, at most a tenth of the file's"
        auto_or_positive_int("data.eval_samples", self.eval_samples, why)
        auto_or_positive_int("data.vocab_size", self.vocab_size, "the file's tokenizer's size")
        if self._reads_no_file():
            return
        self._resolve_tokenizer()
        if os.path.isfile(self.path):  # a saved config's file may be gone: checked where read
            self._check_ids()
        if self.seq_len != "auto":  # else once the model's context is known (follow_model)
            self._check_windows()

    def _reads_no_file(self) -> bool:
        """A saved run's config, every value resolved, read by a command that needs no data."""
        saved = _SAVED_RUN.get()
        resolved = "auto" not in (self.seq_len, self.eval_samples, self.vocab_size, self.tokenizer)
        return saved is not None and not saved.reads_data and resolved

    def follow_model(self, block_size: int | None, model_name: str) -> None:
        """Resolve seq_len=auto from the model's context (None: the model gives none)."""
        if self.seq_len != "auto":
            return
        why = (
            f"follows the model's context (model.block_size; model.kwargs.block_size for "
            f"model=custom), which {model_name} does not give; set data.seq_len"
        )
        require(block_size is not None, "data.seq_len", "auto", why)
        self.seq_len = block_size
        self._check_windows()

    def _check_windows(self) -> None:
        """The file holds enough windows of seq_len + 1 tokens for the eval split and more;
        eval_samples=auto resolved from them. A saved config's file may be gone (its
        eval_samples is a number there)."""
        if os.path.isfile(self.path) and not self._reads_no_file():
            try:
                check_token_file(self.path, self.seq_len, self.eval_samples)
            except ValueError as err:
                raise ConfigError("data.path", self.path, str(err)) from None
            self.eval_samples = eval_windows(self._windows(), self.eval_samples)

    def _windows(self) -> int:
        """The file's windows of seq_len + 1 tokens (TokenFile's cut)."""
        return count_windows(os.path.getsize(self.path) // TOKEN_DTYPE.itemsize, self.seq_len)

    def check_train_batches(self, world_size: int) -> None:
        """Training gets a whole batch on each of `world_size` processes from the windows the
        holdout leaves: said here, before any run directory exists (the training loader would
        say so only after). For training only: mgpu.evaluate reads the held-out windows alone,
        at any batch size."""
        if not os.path.isfile(self.path) or self.eval_samples == "auto":
            return  # no file: said in one line where it is read
        windows, need = self._windows(), self.batch_size * world_size
        train = windows - self.eval_samples
        if train >= need:
            return
        if windows - need < 1:  # no holdout leaves enough: the batch is too big for the file
            raise short_of_a_batch(self.batch_size, world_size, train // world_size)
        auto = auto_eval_samples(windows)
        also = f" (auto: {auto} here)" if windows - auto >= need else ""
        raise ConfigError(
            "data.eval_samples",
            self.eval_samples,
            f"leaves {train} of data.path's {windows} windows to train on, fewer than one "
            f"batch (data.batch_size={self.batch_size}) for each of {world_size} process(es); "
            f"set it to at most {windows - need}{also}, or lower data.batch_size",
        )

    def _check_ids(self) -> None:
        """Every token id has a row: an id at or above the vocabulary would fail deep in the
        first step (or only on the batch that holds it), after the run directory exists."""
        highest = max_token(self.path)
        require(
            highest < self.vocab_size,
            "data.vocab_size",
            self.vocab_size,
            f"is not above token id {highest}, which data.path={self.path} holds: set "
            f"data.vocab_size to the size of the tokenizer that made the file (at least "
            f"{highest + 1}), or prepare the file again with python -m mgpu.data.prepare",
        )

    def _resolve_tokenizer(self) -> None:
        """auto from the file's metadata, a tokenizer.json given by path hashed, and the
        metadata, where the file has one, checked against what is set. A saved config (every
        value resolved) reads nothing but the metadata: its token file may be gone."""
        given = self.tokenizer not in ("auto", BYTES, *UNDECODED) and not self.tokenizer_sha256
        if (given or "auto" in (self.tokenizer, self.vocab_size)) and not os.path.isfile(self.path):
            raise no_token_file(self.path)
        try:
            meta = read_meta(self.path)
        except TokenizerError as err:
            raise ConfigError("data.path", self.path, str(err)) from None
        if meta is None and os.path.isfile(self.path) and looks_like_text(self.path):
            raise ConfigError("data.path", self.path, text_error(self.path))
        if self.tokenizer == NONE:
            why = (
                "follows the file's tokenizer, and data.tokenizer=none names none: set "
                "data.vocab_size to the number of token ids of the tool that made the file "
                "(50257 for GPT-2's)"
            )
            require(self.vocab_size != "auto", "data.vocab_size", "auto", why)
        if self.tokenizer == "auto":
            found = meta_path(self.path)
            why = (
                f"reads the file's tokenizer from {found}, which is missing (the file was not "
                "made by python -m mgpu.data.prepare, or by an older one): prepare it again, or "
                "set data.tokenizer=bytes (byte-level tokens), data.tokenizer=TOKENIZER.json, "
                "or data.tokenizer=none data.vocab_size=N (token ids only; N=50257 for GPT-2's)"
            )
            require(meta is not None, "data.tokenizer", "auto", why)
            self.tokenizer = meta.tokenizer_path(self.path)
            if self.tokenizer != BYTES:
                self.tokenizer_sha256 = self._hash("data.tokenizer")
        elif given:
            self.tokenizer_sha256 = self._hash("data.tokenizer")
        if meta is not None:
            self._check_meta(meta)
        if self.vocab_size == "auto":
            why = "follows data.tokenizer, and none is recorded; set data.vocab_size"
            require(self.tokenizer not in UNDECODED, "data.vocab_size", "auto", why)
            self.vocab_size = meta.vocab_size if meta else self._tokenizer_size()

    def _tokenizer_size(self) -> int:
        try:
            return load_tokenizer(self.tokenizer).vocab_size
        except TokenizerError as err:
            raise ConfigError("data.tokenizer", self.tokenizer, str(err)) from None

    def _hash(self, key: str) -> str:
        require(os.path.isfile(self.tokenizer), key, self.tokenizer, "no such file")
        return sha256_file(self.tokenizer)

    def _check_meta(self, meta: TokenMeta) -> None:
        """What the file's metadata says against the file, where it exists (a saved config's may
        be gone, its metadata kept), and against what is set."""
        if os.path.isfile(self.path):
            size = os.path.getsize(self.path)
            why = (
                f"holds {size // 2:,} tokens, and its metadata ({meta_path(self.path)}) says "
                f"{meta.tokens:,}: it was rewritten since; prepare it again"
            )
            require(size == 2 * meta.tokens, "data.path", self.path, why)
        theirs = meta.tokenizer if meta.tokenizer == BYTES else meta.tokenizer_sha256
        ours = self.tokenizer if self.tokenizer == BYTES else self.tokenizer_sha256
        saved = _SAVED_RUN.get()
        if saved is not None and ours != theirs:
            # A trained run's tokenizer is fixed: the file is what is wrong, not data.tokenizer.
            made_by = describe_tokenizer(meta.tokenizer_path(self.path), meta.tokenizer_sha256)
            run = describe_tokenizer(self.tokenizer, self.tokenizer_sha256)
            raise ConfigError(
                "data.path",
                self.path,
                f"its tokens are not the run's: its metadata ({meta_path(self.path)}) says "
                f"they were made with {made_by}, and the run trained on {run}, so their ids "
                "mean other text to this model. Prepare the text with the run's tokenizer ("
                f"{prepare_with_run_tokenizer(self.tokenizer, saved.run_dir)}) and pass "
                "data.path=OUT.bin",
            )
        require(
            ours == theirs,
            "data.tokenizer",
            self.tokenizer,
            f"is not the tokenizer that made data.path={self.path} (its metadata names "
            f"{meta.tokenizer_path(self.path)}, sha256 {meta.tokenizer_sha256[:12] or '-'}; "
            f"this one's is {self.tokenizer_sha256[:12] or '-'}); prepare the file with this "
            "one (python -m mgpu.data.prepare ... --tokenizer), or to train on the file's own "
            "tokenizer leave data.tokenizer=auto",
        )
        if self.vocab_size != "auto":
            require(
                self.vocab_size >= meta.vocab_size,
                "data.vocab_size",
                self.vocab_size,
                f"is below the {meta.vocab_size} tokens of the file's tokenizer; set "
                f"data.vocab_size=auto (follows the file) or at least {meta.vocab_size}",
            )

    def resolved(self) -> dict[str, Any]:
        """What the file's metadata said, the model's context and the holdout, for the run's
        saved config."""
        keys = ("seq_len", "eval_samples", "vocab_size", "tokenizer", "tokenizer_sha256")
        return {key: getattr(self, key) for key in keys}

    def dataset_kwargs(self) -> dict[str, Any]:
        kwargs = super().dataset_kwargs()
        del kwargs["tokenizer"], kwargs["tokenizer_sha256"]  # the config's business, not the data's
        return kwargs
