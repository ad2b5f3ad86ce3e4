"""Command that turns any text file into a byte-level uint16 token file for TokenFile.

python -m mgpu.data.prepare INPUT.txt OUTPUT.bin
"""

import argparse
import os
import sys

import numpy as np

READ_CHUNK = 1 << 24  # bytes per read, so big inputs stream instead of loading whole
TOKEN_DTYPE = np.dtype("<u2")  # nanoGPT .bin layout; must match mgpu.data.token_file


def write_tokens(src: str, dst: str) -> int:
    """Write src's bytes as uint16 tokens to dst atomically; return the token count."""
    tmp = dst + ".tmp"  # same directory as dst, so os.replace is an atomic rename
    n_tokens = 0
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(READ_CHUNK):
                fout.write(np.frombuffer(chunk, dtype=np.uint8).astype(TOKEN_DTYPE).tobytes())
                n_tokens += len(chunk)
            fout.flush()
            os.fsync(fout.fileno())  # data on disk before the rename makes it visible
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)  # an interrupted or failed write leaves no half-written file behind
    return n_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mgpu.data.prepare",
        description="Tokenize a text file byte-level (token = byte value, vocab 256) into a "
        "flat uint16 .bin file for data=tokens.",
    )
    parser.add_argument("input", help="any text (or binary) file, read as raw bytes")
    parser.add_argument("output", help="the .bin file to write (replaced atomically)")
    args = parser.parse_args(argv)

    if not os.path.isfile(args.input):
        sys.exit(f"error: input file {args.input!r} not found")
    if os.path.getsize(args.input) == 0:
        sys.exit(f"error: input file {args.input!r} is empty; there is nothing to tokenize")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        sys.exit(f"error: output directory {out_dir!r} does not exist; create it first")

    n_tokens = write_tokens(args.input, args.output)
    print(f"wrote {n_tokens:,} tokens to {args.output}")
    print(f"train on it with: data=tokens data.path={args.output} data.vocab_size=256")


if __name__ == "__main__":
    main()
