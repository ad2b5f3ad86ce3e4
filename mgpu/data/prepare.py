"""Command that turns a text file into a uint16 token file for TokenFile (data=tokens), with the
metadata that says which tokenizer made it (mgpu.data.tokenizer).

python -m mgpu.data.prepare INPUT.txt OUTPUT.bin                          # byte-level, vocab 256
python -m mgpu.data.prepare INPUT.txt OUTPUT.bin --tokenizer tokenizer.json
python -m mgpu.data.prepare INPUT.txt OUTPUT.bin --train-bpe 8192

On a terminal a progress line comes every few seconds while the input is read.
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mgpu.data.progress import Progress
from mgpu.data.tokenizer import (
    BYTE_VOCAB,
    BYTES,
    MAX_VOCAB,
    TOKENIZER_SUFFIX,
    JsonTokenizer,
    TokenizerError,
    TokenMeta,
    meta_path,
    sha256_file,
    train_bpe,
    write_atomic,
    write_meta,
)

READ_CHUNK = 1 << 24  # bytes per read, so big inputs stream instead of loading whole
MB = 10**6  # progress is counted in these
PIECE = 1 << 20  # characters per piece a tokenizer encodes; pieces end at a line's end
TOKEN_DTYPE = np.dtype("<u2")  # nanoGPT .bin layout; must match mgpu.data.token_file


def write_ids(dst: str, chunks: Iterator[np.ndarray]) -> int:
    """Write the token-id arrays to dst as uint16, atomically; return the token count."""
    tmp = dst + ".tmp"  # same directory as dst, so os.replace is an atomic rename
    n_tokens = 0
    try:
        with open(tmp, "wb") as fout:
            for ids in chunks:
                fout.write(ids.astype(TOKEN_DTYPE).tobytes())
                n_tokens += len(ids)
            fout.flush()
            os.fsync(fout.fileno())  # data on disk before the rename makes it visible
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)  # an interrupted or failed write leaves no half-written file behind
    return n_tokens


def reading(src: str, what: str) -> Progress:
    """A progress line every few seconds (on a terminal) while `src` is read, in MB."""
    return Progress(f"{what} {src}", os.path.getsize(src) // MB, "MB")


def byte_ids(src: str) -> Iterator[np.ndarray]:
    progress, offset = reading(src, "tokenizing"), 0
    with open(src, "rb") as fin:
        while chunk := fin.read(READ_CHUNK):
            offset += len(chunk)
            progress.update(offset // MB)
            yield np.frombuffer(chunk, dtype=np.uint8)


def text_pieces(src: str, what: str = "tokenizing") -> Iterator[str]:
    """The input's text in pieces of about PIECE characters, each ending at a line's end where
    the text has one. Each piece is encoded on its own, so no token spans two pieces: a
    tokenizer's output differs from encoding the text whole at most at each piece's end."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, rest = 0, ""
    progress = reading(src, what)
    with open(src, "rb") as fin:
        while True:
            chunk = fin.read(READ_CHUNK)
            progress.update((offset + len(chunk)) // MB)
            try:
                rest += decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                raise TokenizerError(
                    f"{src}: not UTF-8 text (byte {offset + err.start}); a tokenizer reads text: "
                    "convert it to UTF-8, or prepare it byte-level (without --tokenizer and "
                    "--train-bpe)"
                ) from None
            offset += len(chunk)
            while len(rest) > PIECE or (not chunk and rest):
                cut = rest.rfind("\n", 0, PIECE) + 1 if len(rest) > PIECE else len(rest)
                cut = cut or PIECE  # a line longer than a piece: cut inside it
                yield rest[:cut]
                rest = rest[cut:]
            if not chunk:
                return


def encoded(tokenizer: JsonTokenizer, src: str) -> Iterator[np.ndarray]:
    """The input's token ids, piece by piece; a batch of pieces, one per CPU, at a time."""
    per_batch = os.cpu_count() or 1
    batch: list[str] = []
    for piece in text_pieces(src):
        batch.append(piece)
        if len(batch) == per_batch:
            yield from map(np.asarray, tokenizer.encode_batch(batch))
            batch = []
    yield from map(np.asarray, tokenizer.encode_batch(batch))


def check_vocab(size: int, what: str) -> None:
    if size > MAX_VOCAB:
        raise TokenizerError(
            f"{what} has {size:,} tokens; token files hold uint16 ids (nanoGPT's layout), so at "
            f"most {MAX_VOCAB:,}: use a tokenizer of at most {MAX_VOCAB:,} tokens"
        )


def given_tokenizer(path: str) -> bytes:
    """The bytes of a --tokenizer file, checked: a tokenizer.json of at most MAX_VOCAB tokens."""
    if not os.path.isfile(path):
        raise TokenizerError(f"--tokenizer {path!r}: no such file")
    check_vocab(JsonTokenizer(path).vocab_size, f"--tokenizer {path}")
    return Path(path).read_bytes()


def prepare(args: argparse.Namespace) -> TokenMeta:
    """Write the token file, its tokenizer (OUTPUT.tokenizer.json) and, last, its metadata."""
    output = args.output
    tok_file = output + TOKENIZER_SUFFIX
    # Read first: the given file may be the one this output had before.
    given = given_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    # No metadata while the file is rewritten: a half-done prepare is refused as unprepared
    # (data.tokenizer=auto needs the metadata), never read with another file's tokenizer.
    for stale in (meta_path(output), tok_file):
        if os.path.exists(stale):
            os.remove(stale)
    tokenizer = None
    if args.train_bpe is not None:
        tokenizer = train_bpe(
            text_pieces(args.input, "training the BPE on"), args.train_bpe, tok_file
        )
    elif given is not None:
        write_atomic(tok_file, given)  # the very file, so its sha256 is the user's file's
        tokenizer = JsonTokenizer(tok_file)
    if tokenizer is None:
        n_tokens = write_ids(output, byte_ids(args.input))
        return TokenMeta(n_tokens, BYTE_VOCAB, BYTES, "", args.input)
    n_tokens = write_ids(output, encoded(tokenizer, args.input))
    name, sha = os.path.basename(tok_file), sha256_file(tok_file)
    return TokenMeta(n_tokens, tokenizer.vocab_size, name, sha, args.input)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mgpu.data.prepare",
        description="Tokenize a text file into a flat uint16 .bin file for data=tokens: "
        "byte-level (token = byte value, vocab 256) by default, or with a Hugging Face "
        "tokenizer.json. Beside OUTPUT it writes OUTPUT.meta.json (which tokenizer, its size) "
        "and OUTPUT.tokenizer.json (the tokenizer, unless byte-level).",
    )
    parser.add_argument("input", help="the text file (any file, read as raw bytes, byte-level)")
    parser.add_argument("output", help="the .bin file to write (replaced atomically)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--tokenizer", metavar="FILE", help="a Hugging Face tokenizer.json to encode the text with"
    )
    which.add_argument(
        "--train-bpe",
        type=int,
        metavar="N",
        help="train a byte-level BPE of N tokens on the input (257 to 65536) and encode with it",
    )
    args = parser.parse_args(argv)
    if args.train_bpe is not None and not BYTE_VOCAB < args.train_bpe <= MAX_VOCAB:
        parser.error(
            f"--train-bpe {args.train_bpe}: a byte-level BPE has the {BYTE_VOCAB} byte tokens "
            f"plus merges, and token files hold at most {MAX_VOCAB} tokens: give N in "
            f"({BYTE_VOCAB}, {MAX_VOCAB}], e.g. 8192"
        )
    # Input that cannot work: one line and exit 2, as for the arguments above, before any work.
    if not os.path.isfile(args.input):
        parser.error(f"input file {args.input!r} not found")
    if os.path.getsize(args.input) == 0:
        parser.error(f"input file {args.input!r} is empty; there is nothing to tokenize")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        parser.error(f"output directory {out_dir!r} does not exist; create it first")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        meta = prepare(args)
    except TokenizerError as err:
        sys.exit(f"error: {err}")
    write_meta(args.output, meta)
    made = "byte-level" if meta.tokenizer == BYTES else f"tokenizer {meta.tokenizer}"
    print(f"wrote {meta.tokens:,} tokens to {args.output} ({made}, vocabulary {meta.vocab_size:,})")
    print(f"train on it with: data=tokens data.path={args.output}")


if __name__ == "__main__":
    main()
