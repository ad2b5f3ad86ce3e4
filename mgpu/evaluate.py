"""Evaluate a checkpoint on its run's eval split, with the run's saved config, on any number of
processes: the mean loss over every eval sample exactly once (as training's evaluation counts
it); for a language model its perplexity, and for a token file with a tokenizer the loss per byte of
the text its targets decode to; for classifiers the accuracy.

python -m mgpu.evaluate RUN_DIR_OR_CHECKPOINT [key=value ...]
torchrun --nproc_per_node=2 -m mgpu.evaluate RUN_DIR_OR_CHECKPOINT [key=value ...]

Overrides change the saved config before it is used, e.g. data.path=val.bin or
data.batch_size=256. The model runs eager (not compiled), under the run's trainer.precision.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch
from torch import nn

from mgpu.config.checks import ConfigError
from mgpu.data import TokenFile, decode_split
from mgpu.data.config import ImageFolderDataConfig
from mgpu.data.loader import build_dataset, build_loader
from mgpu.data.prefetch import DeviceLoader
from mgpu.data.token_config import TokenFileDataConfig
from mgpu.data.tokenizer import UNDECODED, Tokenizer
from mgpu.models.loss import cross_entropy
from mgpu.restore import Restored, UsageError, command_parser, one_line_errors, restore
from mgpu.runtime.dist import Runtime, all_ok, all_reduce_sum_, broadcast_object, distributed
from mgpu.runtime.ending import end_process, exit_code
from mgpu.runtime.launch import default_cuda_connections
from mgpu.train.numerics import autocast_dtype

PROG = "mgpu.evaluate"
JOINED = False  # whether this process joined a process group (train.py's teardown rule)


@dataclass
class Result:
    loss: float  # mean cross-entropy per target (per token for a language model)
    accuracy: float | None  # classifiers only: one target per sample
    targets: int  # how many targets the mean is over, on all ranks together


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DeviceLoader, rt: Runtime, amp_dtype: torch.dtype | None
) -> Result:
    """One pass over this rank's shard of the eval set, summed across ranks (a collective)."""
    # loss sum, target count, correct predictions, classifier batches; float64 so the sums do
    # not lose the last digits over a large eval set.
    sums = torch.zeros(4, dtype=torch.float64, device=rt.device)
    for inputs, targets in loader:
        with torch.autocast(rt.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs)
        sums[0] += cross_entropy(logits, targets, reduction="sum").double()
        sums[1] += targets.numel()
        sums[2] += (logits.argmax(-1) == targets).sum().double()
        # A classifier scores one class per sample ([B, C] logits); a language model scores
        # every position ([B, T, V]), where the loss is the measure. Counted, so that a rank
        # without a batch of its own learns it from the others in the same all-reduce.
        sums[3] += logits.dim() == 2
    all_reduce_sum_(sums, rt)
    total, count, correct, classifier = sums.tolist()  # sync point: once, at the end
    if count == 0:
        raise UsageError("the eval split is empty on every process; set data.eval_samples")
    return Result(total / count, correct / count if classifier else None, int(count))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = command_parser(
        PROG,
        "Evaluate a checkpoint on its run's eval split (torchrun for several "
        "processes). Prints the mean loss and, for language models, the perplexity; for "
        "classifiers, the accuracy.",
    )
    parser.add_argument(
        "overrides", nargs="*", help="key=value changes to the saved config, e.g. data.path=x.bin"
    )
    args = parser.parse_args(argv)
    for item in args.overrides:
        if "=" not in item or item.startswith(("+", "~")):
            parser.error(f"{item!r}: overrides are key=value, e.g. data.batch_size=64")
    return args


def bits_per_byte(result: Result, dataset: TokenFile, tokenizer: Tokenizer) -> float:
    """The loss per byte of the text the eval targets decode to, in bits: comparable across
    tokenizers, as the loss per token is not."""
    text = tokenizer.decode(dataset.target_tokens().tolist())
    return result.loss * result.targets / len(text) / math.log(2)


def perplexity(loss: float) -> float:
    """exp of the mean loss per token: the number of equally likely tokens it amounts to."""
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float above ~709


def check_token_file(data: TokenFileDataConfig) -> None:
    """The run's token file is still there: its saved config is valid without it (mgpu.sample
    and mgpu.export never read it), and evaluating reads it."""
    if not os.path.isfile(data.path):
        why = (
            "no such file: the run's token file was moved or deleted since it trained; pass "
            "where it is now, data.path=PATH (a relative path is read from the current directory)"
        )
        raise ConfigError("data.path", data.path, why)


def holds_out(data) -> bool:
    """Whether the run's eval split is samples held out of its own training data."""
    own = isinstance(data, (TokenFileDataConfig, ImageFolderDataConfig))
    return own and not getattr(data, "eval_path", "")


def check_eval_samples(restored: Restored) -> None:
    """Another data.eval_samples than the run's holds out other samples of its data, some of
    which it trained on."""
    data, trained = restored.config.data, restored.trained_eval_samples
    folder = isinstance(data, ImageFolderDataConfig)
    if holds_out(data) and trained is not None and data.eval_samples != trained:
        raise ConfigError(
            "data.eval_samples",
            data.eval_samples,
            f"the run held out {trained} samples of data.path and trained on the rest, so "
            "another number evaluates samples it trained on; leave it out"
            + (", or evaluate other images with data.eval_path=DIR" if folder else ""),
        )


def check_same_held_out(restored: Restored, dataset) -> None:
    """The images held out of the folder now are those the run held out (the checkpoint's
    digest of their names; older checkpoints have none)."""
    saved = (restored.dataset_state or {}).get("held_out")
    now = getattr(dataset, "held_out", None)
    if holds_out(restored.config.data) and saved and now and saved != now:
        raise ConfigError(
            "data.path",
            restored.config.data.path,
            "images were added, removed or renamed since the run trained, so the images held "
            "out now are not those it held out, and some of them it trained on; evaluate with "
            "the folder as it was, or on images it never saw with data.eval_path=DIR",
        )


def run(restored: Restored) -> None:
    cfg = restored.config
    if isinstance(cfg.data, TokenFileDataConfig):
        check_token_file(cfg.data)  # before any process group: said in one line, exit 2
    check_eval_samples(restored)
    # A token file's text, decoded with the run's tokenizer; other data have none.
    decodes = isinstance(cfg.data, TokenFileDataConfig) and cfg.data.tokenizer not in UNDECODED
    tokenizer = restored.tokenizer() if decodes else None
    with distributed(cfg.dist.backend.value, cfg.dist.timeout_s) as rt:
        global JOINED
        JOINED = rt.has_process_group
        # Each process resolved the path on its own; a run that saved in between would give
        # the processes different checkpoints.
        mine = str(restored.path)
        if not all_ok(broadcast_object(mine, rt) == mine, rt):
            raise UsageError(
                "the processes found different newest checkpoints (a save finished meanwhile); "
                "pass the checkpoint directory itself"
            )
        model = restored.model.to(rt.device)
        try:
            dataset = build_dataset(cfg.data, "eval")
        except (OSError, ValueError) as err:
            # The saved data.path may be relative to where training ran.
            raise UsageError(f"the run's eval data: {err} (data.path=... overrides it)") from err
        check_same_held_out(restored, dataset)
        loader = build_loader(cfg.data, dataset, rt, seed=cfg.trainer.seed, train=False)
        # data.cpu_decode_share=auto: the training run's share, so that the images decoded on
        # the CPU are those its evaluations decoded there (before the loader's workers start)
        share = getattr(cfg.data, "cpu_decode_share", None)
        decode_split.resolve_auto(
            share, cfg.data.num_workers, [dataset], rt, restored.dataset_state
        )  # fmt: skip
        with loader:
            result = evaluate(model, loader, rt, autocast_dtype(cfg.trainer.precision, rt.device))
        if rt.is_primary:
            line = f"{restored.path} (step {restored.step}) on {rt.world_size} process(es): "
            line += f"eval loss {result.loss:.6f}"
            if result.accuracy is None:  # a language model: a loss per token
                line += f", perplexity {perplexity(result.loss):.4f}"
            if tokenizer is not None:
                line += f", {bits_per_byte(result, dataset, tokenizer):.4f} bits per byte of text"
            if result.accuracy is not None:
                line += f", accuracy {result.accuracy:.4f}"
            print(f"{line} over {result.targets} targets", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with one_line_errors(PROG):
        run(restore(args.checkpoint, args.overrides, reads_data=True))


if __name__ == "__main__":
    default_cuda_connections()  # as train.py: before anything asks CUDA for a device
    try:
        main()
        code = 0
    except SystemExit as stop:  # argparse's and one_line_errors' exits
        code = exit_code(stop)
    if not JOINED:
        sys.exit(code)
    # train.py's teardown rule: the process group is gone and every file closed; end without
    # the interpreter's teardown of torch's communication threads, which can abort.
    end_process(code)
