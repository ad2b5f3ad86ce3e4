"""The tokenizers of token files: byte-level (one token per byte value) or a Hugging Face
`tokenizer.json` (the `tokenizers` library, imported only where one is used); training a byte-level
BPE; and the metadata beside a token file (`PATH.meta.json`) that says which tokenizer made it.

A token file, its metadata and its tokenizer, as mgpu.data.prepare writes them:
  train.bin                  uint16 token ids (nanoGPT's .bin layout)
  train.bin.tokenizer.json   the tokenizer that made them (none for byte-level tokens)
  train.bin.meta.json        {"tokens", "vocab_size", "tokenizer", "tokenizer_sha256", ...}
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BYTES = "bytes"  # the tokenizer of byte-level tokens: token id = byte value
# Token ids without a tokenizer (a file another tool made, e.g. nanoGPT's GPT-2 train.bin): the
# run trains and evaluates on the ids, and nothing decodes them. A run saved before runs
# recorded their tokenizer has "" instead, which means the same.
NONE = "none"
UNDECODED = (NONE, "")
BYTE_VOCAB = 256
MAX_VOCAB = 1 << 16  # token files hold uint16 ids (nanoGPT's layout): at most 65,536 tokens
META_SUFFIX = ".meta.json"
TOKENIZER_SUFFIX = ".tokenizer.json"
RUN_TOKENIZER = "tokenizer.json"  # the copy of a run's tokenizer in its run directory
FORMAT = "mgpu token file 1"


class TokenizerError(ValueError):
    """A tokenizer or token-file metadata that cannot be used; the message says which file."""


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: str | Path, data: bytes) -> None:
    """`data` to `path`, all or nothing: a temporary file beside it, renamed over it."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class ByteTokenizer:
    """Byte-level tokens: a text's UTF-8 bytes are its tokens."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> bytes:
        return bytes(ids)


class JsonTokenizer:
    """A Hugging Face tokenizer.json. `vocab_size` counts the ids it can produce (the highest + 1);
    decode gives the text's UTF-8 bytes."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception for a bad file
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({first})") from None
        self.path = Path(path)
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Several texts at once, on the library's threads."""
        found = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in found]

    def decode(self, ids: Iterable[int]) -> bytes:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False).encode("utf-8")


Tokenizer = ByteTokenizer | JsonTokenizer


def load_tokenizer(name: str | Path) -> Tokenizer:
    """`bytes` or the path of a tokenizer.json."""
    return ByteTokenizer() if str(name) == BYTES else JsonTokenizer(name)


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path) -> JsonTokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (GPT-2's kind: the 256 byte values, then
    merges) on `texts`, save it as a tokenizer.json at `out`, and return it. A text too small
    for that many merges gives fewer tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    write_atomic(out, tokenizer.to_str(pretty=True).encode("utf-8"))
    return JsonTokenizer(out)


@dataclass
class TokenMeta:
    """What a token file's metadata says."""

    tokens: int  # token count: the file holds 2 bytes per token
    vocab_size: int  # the tokenizer's size: every token id is below it
    tokenizer: str  # bytes, or the tokenizer.json's file name, in the token file's folder
    tokenizer_sha256: str  # that file's sha256 ("" for bytes)
    source: str = ""  # the input it was made from, for the record

    def tokenizer_path(self, token_file: str) -> str:
        """data.tokenizer for this file: bytes, or the tokenizer.json beside the token file."""
        if self.tokenizer == BYTES:
            return BYTES
        return os.path.join(os.path.dirname(token_file), self.tokenizer)


def meta_path(token_file: str | Path) -> str:
    return f"{token_file}{META_SUFFIX}"


def write_meta(token_file: str | Path, meta: TokenMeta) -> None:
    text = json.dumps({"format": FORMAT, **asdict(meta)}, indent=2) + "\n"
    write_atomic(meta_path(token_file), text.encode("utf-8"))


def read_meta(token_file: str | Path) -> TokenMeta | None:
    """The token file's metadata; None if it has none (made by another tool or an older mgpu)."""
    path = meta_path(token_file)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            found: dict[str, Any] = json.load(f)
        if found.pop("format", None) != FORMAT:
            raise ValueError(f"its format is not {FORMAT!r}")
        return TokenMeta(**found)
    except (ValueError, TypeError, OSError) as err:
        raise TokenizerError(
            f"{path}: unreadable token-file metadata ({err}); prepare the token file again "
            "with python -m mgpu.data.prepare"
        ) from None


def describe_tokenizer(tokenizer: str, sha256: str) -> str:
    """A tokenizer as a message names it: byte-level, or its file and the start of its sha256."""
    if tokenizer == BYTES:
        return "byte-level tokens (data.tokenizer=bytes)"
    if tokenizer in UNDECODED:
        return f"token ids without a tokenizer (data.tokenizer={tokenizer or 'none'})"
    return f"{tokenizer} (sha256 {sha256[:12] or '-'})"


def prepare_with_run_tokenizer(tokenizer: str, run_dir: Path | str) -> str:
    """The command that makes a token file of a text with a run's own tokenizer: its run
    directory's copy (RUN_TOKENIZER), or byte-level (prepare's default)."""
    if tokenizer == BYTES:
        return "python -m mgpu.data.prepare TEXT OUT.bin"
    return f"python -m mgpu.data.prepare TEXT OUT.bin --tokenizer {Path(run_dir) / RUN_TOKENIZER}"


def other_tokens(saved: dict, now: dict, source: object, run_dir: Path | str) -> str | None:
    """Why a run that resumes from `source` (whose data config is `saved`, its run directory
    `run_dir`) cannot go on with data config `now`, or None: token ids of another tokenizer
    (or vocabulary) than the checkpoint's mean other text to its model, which would train on as
    if they did not, and the run's tokenizer.json would be replaced by the new one, so that its
    older checkpoints could no longer be sampled. Configs of other data, or saved before runs
    recorded their tokenizer, have none to compare."""
    if "tokenizer" not in saved or "tokenizer" not in now:
        return None

    def identity(data: dict) -> str:
        name = data["tokenizer"] or NONE
        return name if name in (BYTES, NONE) else data.get("tokenizer_sha256", "")

    old = describe_tokenizer(saved["tokenizer"], saved.get("tokenizer_sha256", ""))
    afresh = "train afresh in another run directory (hydra.run.dir=...)"
    if identity(saved) != identity(now):
        new = describe_tokenizer(now["tokenizer"], now.get("tokenizer_sha256", ""))
        on = "the token ids the run trained on"
        if saved["tokenizer"] not in UNDECODED:
            on = "a token file prepared with the run's tokenizer ("
            on += f"{prepare_with_run_tokenizer(saved['tokenizer'], run_dir)})"
        return (
            f"data.path={now.get('path')}: its tokens are not the run's: they were made with "
            f"{new}, and {source} trained on {old}, so each token id means other text to the "
            f"model. Resume on {on}, or {afresh}"
        )
    if saved.get("vocab_size") != now.get("vocab_size"):
        was = saved.get("vocab_size")
        return (
            f"data.vocab_size={now.get('vocab_size')}: {source} trained with data.vocab_size="
            f"{was} ({old}); resume with data.vocab_size={was}, or {afresh}"
        )
    return None


def copy_to_run(tokenizer: str, run_dir: Path) -> None:
    """Keep the run's tokenizer.json in its run directory, for mgpu.sample and mgpu.evaluate;
    the run's config.yaml holds its sha256 (data.tokenizer_sha256)."""
    write_atomic(run_dir / RUN_TOKENIZER, Path(tokenizer).read_bytes())
