"""Command that turns a text file into a uint16 token file for TokenFile (data=tokens), with the
metadata that says which tokenizer made it (mgpu.data.tokenizer).

python -m mgpu.data.prepare INPUT.txt OUTPUT.bin                          # byte-level, vocab 256
python -m mgpu.data.prepare INPUT.txt OUTPUT.bin --tokenizer tokenizer.json
python -m mgpu.data.prepare INPUT.txt OUTPUT.bin --train-bpe 8192

On a terminal a progress line comes every few seconds while the input is read. All or nothing:
the new files are written under temporary names and put in place only once all are whole.
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
from mgpu.data.token_file import looks_like_text
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
# The new files' stem until all are whole: OUTPUT.tmp, OUTPUT.tmp.meta.json, ... In OUTPUT's
# directory, so that putting each in place is an atomic rename.
NEW = ".tmp"
PROG = "python -m mgpu.data.prepare"


def files_of(token_file: str) -> list[str]:
    """A token file and the two files beside it: its metadata and its tokenizer."""
    return [token_file, meta_path(token_file), token_file + TOKENIZER_SUFFIX]


def write_ids(path: str, chunks: Iterator[np.ndarray]) -> int:
    """Write the token-id arrays to path as uint16, on disk when it returns; the token count."""
    n_tokens = 0
    with open(path, "wb") as fout:
        for ids in chunks:
            fout.write(ids.astype(TOKEN_DTYPE).tobytes())
            n_tokens += len(ids)
        fout.flush()
        os.fsync(fout.fileno())  # data on disk before a rename makes it visible
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
                    f"input file {src!r}: not UTF-8 text (byte {offset + err.start}); a "
                    "tokenizer reads text: convert it to UTF-8, or prepare it byte-level "
                    "(without --tokenizer and --train-bpe)"
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


def given_tokenizer(path: str, copy: str) -> JsonTokenizer:
    """The --tokenizer file, checked (a tokenizer.json of at most MAX_VOCAB tokens), copied to
    `copy` byte for byte, so that the copy's sha256 is the user's file's."""
    data = Path(path).read_bytes()
    try:
        vocab_size = JsonTokenizer(path).vocab_size
    except TokenizerError as err:
        raise TokenizerError(f"--tokenizer {err}; give a Hugging Face tokenizer.json") from None
    check_vocab(vocab_size, f"--tokenizer {path}")
    write_atomic(copy, data)
    return JsonTokenizer(copy)


def write_new(args: argparse.Namespace, new: str) -> TokenMeta:
    """Write the token file and its tokenizer as `new` and new + TOKENIZER_SUFFIX; the metadata
    that the output will have."""
    tok_new = new + TOKENIZER_SUFFIX
    tokenizer = None
    if args.train_bpe is not None:
        pieces = text_pieces(args.input, "training the BPE on")
        tokenizer = train_bpe(pieces, args.train_bpe, tok_new)
    elif args.tokenizer is not None:
        tokenizer = given_tokenizer(args.tokenizer, tok_new)
    if tokenizer is None:
        n_tokens = write_ids(new, byte_ids(args.input))
        return TokenMeta(n_tokens, BYTE_VOCAB, BYTES, "", args.input)
    n_tokens = write_ids(new, encoded(tokenizer, args.input))
    name = os.path.basename(args.output + TOKENIZER_SUFFIX)  # its name once in place
    return TokenMeta(n_tokens, tokenizer.vocab_size, name, sha256_file(tok_new), args.input)


def put_in_place(new: str, output: str, meta: TokenMeta) -> None:
    """Replace OUTPUT's files with the whole new ones. The old metadata goes first and the new
    comes last: a crash in between leaves a token file without metadata, which training
    refuses as unprepared (data.tokenizer=auto needs it), never reads with another file's
    tokenizer."""
    (_, meta_new, tok_new), (_, meta_file, tok_file) = files_of(new), files_of(output)
    if os.path.exists(meta_file):
        os.remove(meta_file)
    if meta.tokenizer != BYTES:
        os.replace(tok_new, tok_file)
    elif os.path.exists(tok_file):
        os.remove(tok_file)  # an earlier prepare's tokenizer: byte-level tokens have none
    os.replace(new, output)
    os.replace(meta_new, meta_file)


def prepare(args: argparse.Namespace) -> TokenMeta:
    """Write the token file, its tokenizer (OUTPUT.tokenizer.json) and its metadata, all under
    temporary names first: until every one is whole, OUTPUT's earlier files stay as they were
    (a text that turns out not to be UTF-8 fails only once it is read)."""
    new = args.output + NEW
    try:
        meta = write_new(args, new)
        write_meta(new, meta)
        put_in_place(new, args.output, meta)
    finally:
        for path in files_of(new):  # what a failure, or Ctrl-C, left half-written
            if os.path.exists(path):
                os.remove(path)
    return meta


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tokenize a text file into a flat uint16 .bin file for data=tokens: "
        "byte-level (token = byte value, vocab 256) by default, or with a Hugging Face "
        "tokenizer.json. Beside OUTPUT it writes OUTPUT.meta.json (which tokenizer, its size) "
        "and OUTPUT.tokenizer.json (the tokenizer, unless byte-level).",
    )
    parser.add_argument("input", help="the text file (read as raw bytes, byte-level)")
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
    # A token file prepared again would be read as bytes: each id's two bytes become two
    # tokens of nonsense, written without a word.
    if os.path.isfile(meta_path(args.input)):
        parser.error(
            f"input file {args.input!r} is already a prepared token file (its metadata, "
            f"{meta_path(args.input)}, is beside it); train on it with data=tokens "
            f"data.path={args.input}"
        )
    if not looks_like_text(args.input):
        parser.error(
            f"input file {args.input!r} is binary, not text: prepare tokenizes text. If it is "
            f"token ids already, train on it with data=tokens data.path={args.input} "
            "data.tokenizer=... (docs/data.md: a token file without metadata)"
        )
    if args.tokenizer is not None and not os.path.isfile(args.tokenizer):
        parser.error(
            f"--tokenizer {args.tokenizer!r}: no such file; give the path of a Hugging Face "
            "tokenizer.json"
        )
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        parser.error(f"output directory {out_dir!r} does not exist; create it first")
    if os.path.isdir(args.output):
        parser.error(
            f"output {args.output!r} is a directory; name the token file to write, e.g. "
            f"{os.path.join(args.output, 'train.bin')}"
        )
    # Any name of the input (the same path, ./, a symlink, a hard link) among the files this
    # writes, temporaries too, would be written over while it is read.
    for path in files_of(args.output) + files_of(args.output + NEW):
        if os.path.exists(path) and os.path.samefile(path, args.input):
            which = "" if path == args.output else f" ({path} is the input)"
            parser.error(
                f"output {args.output!r} would write over the input file {args.input!r}{which}; "
                "name another output, e.g. train.bin"
            )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        meta = prepare(args)
    except KeyboardInterrupt:  # one line, as train.py says it; 128 + SIGINT, as a shell
        print(f"{PROG}: interrupted (Ctrl-C); {args.output} left as it was", file=sys.stderr)
        sys.exit(130)
    except TokenizerError as err:
        # bad input found only once read (not UTF-8, a tokenizer that cannot be used): said
        # as argparse says a bad argument, and exit 2 as it does
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
    made = "byte-level" if meta.tokenizer == BYTES else f"tokenizer {meta.tokenizer}"
    vocab = f"vocabulary {meta.vocab_size:,}"
    if args.train_bpe is not None and meta.vocab_size < args.train_bpe:
        vocab += f", not {args.train_bpe:,}: the text had no more merges than that"
    print(f"wrote {meta.tokens:,} tokens to {args.output} ({made}, {vocab})")
    print(f"train on it with: data=tokens data.path={args.output}")


if __name__ == "__main__":
    main()
