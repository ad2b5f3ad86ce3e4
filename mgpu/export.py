"""Export a checkpoint's model weights as safetensors, with the model's config beside them, for
tools that do not read mgpu checkpoints.

python -m mgpu.export RUN_DIR_OR_CHECKPOINT OUT.safetensors

Writes OUT.safetensors (the model's state_dict) and OUT.json: {"model": the model config
(`_target_` and its arguments), "data": the run's data config (an image folder's "classes", in
the order of the model's outputs; a token file's tokenizer: the name of OUT.tokenizer.json, a
copy of the run's tokenizer written beside, where it has one), "inputs": what the model takes,
"tied": {name: the name it shares its tensor with}, "checkpoint", "step"}. Tied tensors (GPT's
token embedding is its output head) are stored once, under the first name; safetensors refuses
tensors that share memory. read() puts them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from mgpu.data.config import CustomDataConfig
from mgpu.restore import Restored, UsageError, command_parser, one_line_errors, restore

PROG = "mgpu.export"
SUFFIX = ".safetensors"
UMASK = os.umask(0o022)  # reading the umask sets it: put it straight back
os.umask(UMASK)


def untied_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's state_dict with each shared tensor kept once, and {dropped name: kept name}.

    Tensors are shared when they are views of the same memory with the same shape and layout
    (what weight tying makes); the name that comes first in the state_dict keeps it."""
    kept: dict[tuple, str] = {}
    state, tied = {}, {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), *tensor.shape)
        key += tuple(tensor.stride())
        if tensor.numel() and key in kept:
            tied[name] = kept[key]
            continue
        kept[key] = name
        state[name] = tensor.detach().contiguous()  # safetensors writes contiguous tensors only
    return state, tied


def _plain(value: object) -> object:
    """A config's enum (data.decode, ...) as the name a user types."""
    return getattr(value, "value", str(value))


def inputs(data) -> str:
    """What the exported model takes, in words: for images the pixels' scaling, which mgpu does
    on the device (mgpu.data.images.normalize_uint8), not the model."""
    if isinstance(data, CustomDataConfig):  # a user's data set: its items are theirs to say
        return (
            f"the inputs {data._target_}'s items hold (after its device_transform, if it has "
            "one); outputs: the model's own"
        )
    if hasattr(data, "image_size"):
        return (
            f"float32 [N, C, {data.image_size}, {data.image_size}] images (RGB for an image "
            "folder), each uint8 value x as (x / 255 - 0.5) / 0.25; outputs: one logit per class"
        )
    return "int64 [N, T] token ids (T up to the model's block_size); outputs: logits per token"


def export(restored: Restored, out: Path) -> Path:
    """Write `out` (.safetensors) and the config beside it (.json); returns the config's path."""
    # Imported here: only this command needs the library.
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    state, tied = untied_state(restored.model)
    data = restored.config.data
    files = [(out, lambda tmp: save_file(state, tmp, metadata=meta))]
    data_config = dataclasses.asdict(data)
    try:
        tokenizer = restored.tokenizer_file()
    except UsageError as err:  # a checkpoint away from its run directory: the weights still go
        print(f"{PROG}: warning: {err}; the export holds no tokenizer", file=sys.stderr)
        tokenizer = None
    if tokenizer is not None:  # the export decodes without the run directory: a copy beside
        copy = out.with_suffix(".tokenizer.json")
        files.append((copy, lambda tmp: shutil.copyfile(tokenizer, tmp)))
        data_config["tokenizer"] = copy.name  # beside the .json that names it
    config = {
        "model": dataclasses.asdict(restored.config.model),
        "data": data_config,
        "inputs": inputs(data),
        "tied": tied,
        "checkpoint": str(restored.path),
        "step": restored.step,
    }
    meta = {"format": "pt", "tied": json.dumps(tied), "model": json.dumps(config["model"])}
    beside = out.with_suffix(".json")
    text = json.dumps(config, indent=1, default=_plain) + "\n"
    # Each file appears whole or not at all: written under a temporary name, then renamed.
    for path, write in (*files, (beside, lambda tmp: Path(tmp).write_text(text))):
        tmp = path.with_name(path.name + ".tmp")
        try:
            write(str(tmp))
            # safetensors creates its file readable by its owner only; an export is meant to be
            # shared like any file the user writes: the mode their umask gives.
            os.chmod(tmp, 0o666 & ~UMASK)
            os.replace(tmp, path)
        except (OSError, SafetensorError) as err:  # safetensors reports its I/O errors as its own
            raise UsageError(f"{path}: cannot be written ({err})") from err
        finally:
            tmp.unlink(missing_ok=True)
    return beside


def read(path: Path | str) -> tuple[dict[str, torch.Tensor], dict]:
    """An export's state_dict with its tied names restored, and its config (the .json beside);
    `model.load_state_dict(state)` takes it as it is."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads(path.with_suffix(".json").read_text())
    state = load_file(str(path))
    for name, source in config["tied"].items():
        state[name] = state[source]
    return state, config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = command_parser(
        PROG,
        "Write a checkpoint's model weights as OUT.safetensors and its model config as OUT.json.",
    )
    parser.add_argument("out", type=Path, help="the weights file to write, e.g. model.safetensors")
    args = parser.parse_args(argv)
    if args.out.suffix != SUFFIX:
        parser.error(f"{args.out}: name it *{SUFFIX} (its config goes beside it as *.json)")
    if not args.out.parent.is_dir():
        parser.error(f"{args.out.parent}: no such directory; create it first")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with one_line_errors(PROG):
        restored = restore(args.checkpoint, reads_data=False)
        beside = export(restored, args.out)
    print(f"{restored.path} (step {restored.step}) -> {args.out}, {beside}")


if __name__ == "__main__":
    main()
