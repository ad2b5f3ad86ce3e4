"""Generate text from a GPT trained on a token file (data=tokens): the prompt encoded with the
run's tokenizer (byte-level, or the tokenizer.json its run directory keeps), N sampled tokens
decoded with it.

python -m mgpu.sample RUN_DIR_OR_CHECKPOINT --prompt TEXT [--tokens N]
                      [--temperature T] [--top_k K] [--seed S]

Writes the decoded text of the N generated tokens, and only that, to stdout as UTF-8 bytes; a
byte-level model's bytes are written as they are (it may stop in the middle of a UTF-8
character). The same checkpoint, arguments and seed give the same text on the same device (a
GPU if one is visible, else the CPU).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from mgpu.data.tokenizer import Tokenizer
from mgpu.models import GPT
from mgpu.restore import Restored, UsageError, command_parser, one_line_errors, restore

PROG = "mgpu.sample"
DEFAULT_TOKENS = 200


def text_gpt(restored: Restored) -> tuple[GPT, Tokenizer]:
    """The restored model, if it is a GPT with a row for every token of its run's tokenizer,
    and that tokenizer; UsageError says why not."""
    model, cfg = restored.model, restored.config
    if not isinstance(model, GPT):
        raise UsageError(
            f"{restored.path}: its model is {cfg.model._target_}, not a GPT; {PROG} generates "
            "from GPT language models (model=gpt_tiny, gpt2_small) trained on data=tokens"
        )
    tokenizer = restored.tokenizer()
    vocab = model.wte.num_embeddings
    if vocab < tokenizer.vocab_size:
        raise UsageError(
            f"{restored.path}: model.vocab_size={vocab} is smaller than its tokenizer's "
            f"{tokenizer.vocab_size} tokens (data.tokenizer={cfg.data.tokenizer})"
        )
    return model, tokenizer


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    vocab: int | None = None,
) -> torch.Tensor:
    """`tokens` new tokens after `prompt` (1-D int64), each drawn from the model's next-token
    distribution at `temperature` (0: the most likely token) among the `top_k` most likely, and
    among the first `vocab` ids only (the tokenizer's; the model's rows past it are padding)."""
    idx = prompt[None]
    for _ in range(tokens):
        # The context is at most block_size tokens: the position embedding covers no more.
        logits = model(idx[:, -model.block_size :])[:, -1, :].float()
        if vocab is not None:
            logits[:, vocab:] = float("-inf")
        if temperature == 0:
            token = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat((idx, token), dim=1)
    return idx[0, prompt.numel() :]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = command_parser(
        PROG,
        "Generate text from a GPT trained on data=tokens, encoded and decoded with its run's "
        "tokenizer; writes the generated text (not the prompt) to stdout.",
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS,
        help=f"tokens to generate (bytes, for a byte-level model; default {DEFAULT_TOKENS})",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature; 0: always the most "
        "likely token (default 1.0)"
    )  # fmt: skip
    parser.add_argument(
        "--top_k", type=int, default=None, help="sample among the K most likely tokens only"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    args = parser.parse_args(argv)
    if not args.prompt:
        parser.error("--prompt is empty; the model needs at least one token to continue")
    if args.tokens < 1:
        parser.error(f"--tokens {args.tokens}: generate at least 1")
    if args.temperature < 0:
        parser.error(f"--temperature {args.temperature}: must be >= 0")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top_k {args.top_k}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with one_line_errors(PROG):
        model, tokenizer = text_gpt(restore(args.checkpoint, reads_data=False))
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise UsageError(f"--prompt {args.prompt!r}: the run's tokenizer makes no token of it")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    prompt = torch.tensor(ids, dtype=torch.long, device=device)
    generator = torch.Generator(device).manual_seed(args.seed)
    out = generate(
        model,
        prompt,
        args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=generator,
        vocab=tokenizer.vocab_size,
    )
    sys.stdout.buffer.write(tokenizer.decode(out.tolist()))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
