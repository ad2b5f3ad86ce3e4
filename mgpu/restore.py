"""A trained model back from disk, for the after-training commands (mgpu.evaluate, mgpu.sample,
mgpu.export): which checkpoint a path means, the run's config as that checkpoint saved it (with
the user's overrides), and the model rebuilt from it with the checkpoint's weights.

Checkpoints are verified and loaded by mgpu.ckpt.checkpoint (sha256 of every file read,
torch.load(weights_only=True)), exactly as resume does; this module adds no checks of its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from mgpu.ckpt.checkpoint import (
    MANIFEST,
    SHARED,
    CheckpointError,
    checkpoint_root,
    find_latest_valid,
    load,
)
from mgpu.ckpt.state import CheckpointMismatch, differing_parameters
from mgpu.config.checks import ConfigError
from mgpu.data.token_config import TokenFileDataConfig, reading_saved_run
from mgpu.data.tokenizer import (
    BYTE_VOCAB,
    BYTES,
    NONE,
    RUN_TOKENIZER,
    ByteTokenizer,
    JsonTokenizer,
    Tokenizer,
    TokenizerError,
    describe_tokenizer,
    prepare_with_run_tokenizer,
    sha256_file,
)
from mgpu.models import build_model
from mgpu.run.cli import composition_error
from mgpu.run.config import Config, describe_error, to_config
from mgpu.runtime.launch import LaunchError
from mgpu.runtime.stops import BAD_INPUT

log = logging.getLogger(__name__)
RUN_CONFIG = "config.yaml"  # what train.py's rank 0 writes into a run directory first


class UsageError(ValueError):
    """A command-line input that cannot work; the message says what and how to fix it."""


def resolve_checkpoint(path: Path | str) -> Path:
    """The checkpoint directory `path` means: itself, if it is one (<run dir>/checkpoints/step-N);
    for a run directory (or its checkpoints/ folder), its newest valid checkpoint, warning about
    each newer one that is not valid. Validity is checked when the checkpoint is loaded."""
    path = Path(path)
    if not path.exists():
        raise UsageError(
            f"{path}: no such file or directory; pass a run directory (outputs/<run>) or one of "
            "its checkpoints (<run dir>/checkpoints/step-N)"
        )
    if path.is_file():
        raise UsageError(
            f"{path}: a file; pass the checkpoint directory that holds it ({path.parent}) or the "
            "run directory"
        )
    if path.name.startswith("step-") or (path / MANIFEST).exists() or (path / SHARED).exists():
        return path  # a checkpoint directory: load says which check it fails, if any
    root = path if path.name == "checkpoints" else checkpoint_root(path)
    if not root.is_dir() and (path / RUN_CONFIG).is_file():
        raise UsageError(
            f"{path}: a run directory without checkpoints: its training has saved none yet; "
            "wait for its first save (ckpt.every, and the end of training) or pass another run"
        )
    if not root.is_dir():
        raise UsageError(
            f"{path}: neither a run directory (it has no checkpoints/) nor a checkpoint "
            "directory (no manifest.json); pass outputs/<run> or <run dir>/checkpoints/step-N"
        )
    newest, problems = find_latest_valid(root)
    for problem in problems:
        log.warning("skipping invalid checkpoint: %s", problem)
    if newest is None and not problems:
        why = "no checkpoint yet: its training has saved none; wait for its first save"
        raise CheckpointError(root, f"{why} (ckpt.every) or pass another run")
    if newest is None:
        why = f"no valid checkpoint ({len(problems)} invalid, above)"
        raise CheckpointError(root, f"{why}; train longer or pass another run")
    return newest


def _schema(group: str, section: dict) -> type:
    """The schema a saved model or data section is typed with: the group's custom one for a
    user's class (saved with its `kwargs`), else the one registered for its `_target_`."""
    custom, target = None, section.get("_target_")
    for entry in ConfigStore.instance().repo[group].values():
        node = entry.node
        if OmegaConf.is_missing(node, "_target_"):
            custom = OmegaConf.get_type(node)
        elif node._target_ == target and "kwargs" not in section:
            return OmegaConf.get_type(node)
    if custom is None or "kwargs" not in section:
        why = "has no schema registered in mgpu.run.config"
        raise ConfigError(f"{group}._target_", target, why)
    return custom


def saved_config(text: str, overrides: list[str], run_dir: Path | str = "RUN") -> Config:
    """The typed Config of a checkpoint's saved YAML with `key=value` overrides applied, validated
    as train.py validates a composed one (mgpu.run.config.to_config). `run_dir`: the run's
    directory, as messages name it."""
    tree = OmegaConf.create(text)
    typed = OmegaConf.structured(Config)
    for group in ("model", "data"):
        section = OmegaConf.to_container(tree[group])
        typed[group] = OmegaConf.structured(_schema(group, section))
    data = OmegaConf.to_container(tree.data)
    if data.get("_target_") == TokenFileDataConfig._target_ and "tokenizer" not in data:
        # Saved before runs recorded their tokenizer, when mgpu.data.prepare wrote byte-level
        # tokens only and told users to set data.vocab_size=256; mgpu.sample read every run of
        # vocabulary 256 as byte-level then, and still does. Any other run recorded none.
        tree.data.tokenizer = BYTES if data.get("vocab_size") == BYTE_VOCAB else ""
    # What training resumed from is no concern here, and a path it named may be gone since.
    tree.ckpt.resume = "auto"
    for item in overrides:
        _refuse_group_choice(item, tree)
        _refuse_tokenizer_change(item, tree, run_dir)
    try:
        merged = OmegaConf.merge(typed, tree, OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as err:
        raise _override_error(err, overrides) from None
    return to_config(merged)


def _refuse_group_choice(item: str, tree: DictConfig) -> None:
    """`model=resnet_tiny`: a group choice, which train.py composes from conf/ and a saved config
    cannot take (OmegaConf would say "Merge error: str is not a subclass of ..."): one line
    saying what the run's section is and what to do instead."""
    group, _, value = item.partition("=")
    if "." in group or group not in tree:
        return
    target = tree[group].get("_target_")
    if group == "model":
        why = (
            f"a trained checkpoint's model group cannot be changed: this run's model is "
            f"{target}, the one its weights fit; leave model=... out"
        )
    else:
        what = f" (this run's is {target})" if target else ""
        why = (
            f"a group choice, which the checkpoint's saved config cannot take: it has its "
            f"{group} settings already{what}; leave {group}=... out, or change one of them "
            f"with {group}.KEY=VALUE"
        )
    raise ConfigError(group, value, why)


def _refuse_tokenizer_change(item: str, tree: DictConfig, run_dir: Path | str) -> None:
    """`data.tokenizer=auto` (or another tokenizer): the model's token ids are those of the
    tokenizer it trained with, whatever a token file's metadata says; taking another would score
    or decode the model with the wrong text, and its sha256 would no longer name the run's."""
    key, _, value = item.partition("=")
    data = tree.get("data") or {}
    if key not in ("data.tokenizer", "data.tokenizer_sha256") or "tokenizer" not in data:
        return
    saved = str(data.get(key.split(".")[1], ""))
    if value == saved or os.path.abspath(value) == os.path.abspath(saved):
        return  # the run's own (config.yaml saves a tokenizer.json's path absolute)
    run = describe_tokenizer(data.tokenizer, data.get("tokenizer_sha256", ""))
    raise ConfigError(
        key,
        value,
        f"a trained checkpoint's tokenizer cannot be changed: the model's token ids are those "
        f"of {run}; leave {key}=... out. To use a text made with another tokenizer, prepare "
        f"it with the run's ({prepare_with_run_tokenizer(data.tokenizer, run_dir)}) and pass "
        "data.path=OUT.bin",
    )


def _override_error(err: OmegaConfBaseException, overrides: list[str]) -> Exception:
    """OmegaConf's error for an override of the saved config -> train.py's line for the same
    override (an unknown key with the nearest known one, a value of the wrong type with an
    example), by mgpu.run.cli's own wording of Hydra's error."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:  # an override Hydra's grammar cannot read
        parsed = None
    if parsed is None or not err.full_key:  # no key to name: OmegaConf's first line
        return ConfigError("override", " ".join(overrides), describe_error(err))
    wrapped = ConfigCompositionException(str(err))
    wrapped.__cause__ = err  # what composition_error reads the key and the schema from
    return composition_error(wrapped, parsed)


@dataclass
class Restored:
    """A checkpoint's model, ready to use (eval mode, on the CPU), and where it came from."""

    path: Path  # the checkpoint directory
    step: int
    config: Config
    model: nn.Module
    # The training data set's checkpoint_state (image_folder's decode share), if it saved one
    dataset_state: dict | None = None
    # data.eval_samples as the run resolved it, where an override gave another
    trained_eval_samples: int | None = None

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the run trained with: byte-level, or its run directory's copy of the
        tokenizer.json, checked against the sha256 the checkpoint's config recorded."""
        data = self.config.data
        name = getattr(data, "tokenizer", None)
        if name is None:
            raise UsageError(
                f"{self.path}: trained on {data._target_}, which has no tokenizer (no text to "
                "decode); train on text with data=tokens (python -m mgpu.data.prepare)"
            )
        if name == NONE:
            raise UsageError(
                f"{self.path}: trained with data.tokenizer=none (token ids without a tokenizer), "
                "so there is nothing to turn text into tokens and back; train on a file made by "
                "python -m mgpu.data.prepare (its tokenizer is kept) to sample from the model"
            )
        if name == "":
            raise UsageError(
                f"{self.path}: its config records no data.tokenizer (saved before mgpu recorded "
                "tokenizers), so its tokens cannot be decoded"
            )
        if name == BYTES:
            return ByteTokenizer()
        return JsonTokenizer(self.tokenizer_file())

    def tokenizer_file(self) -> Path | None:
        """The run's own copy of its tokenizer.json, checked against the sha256 the checkpoint's
        config recorded; None for a run without one (byte-level, token ids alone, other data)."""
        data = self.config.data
        name = getattr(data, "tokenizer", None)
        if name in (None, NONE, "", BYTES):
            return None
        copy = self.path.parent.parent / RUN_TOKENIZER  # <run dir>/checkpoints/step-N
        # The fix names the content, not a file: data.tokenizer's path may hold another
        # tokenizer by now (a token file prepared again), and a copy of that would decode the
        # model's ids as other text.
        fix = (
            f"put back a copy of the tokenizer the run trained with: the file whose sha256 is "
            f"{data.tokenizer_sha256} (it was {name} then; sha256sum tells whether it still is)"
        )
        if not copy.is_file():
            raise UsageError(f"{copy}: missing; {fix}")
        found = sha256_file(copy)
        if found != data.tokenizer_sha256:
            raise UsageError(
                f"{copy}: not the tokenizer the checkpoint trained with (its sha256 is "
                f"{found[:12]}, the checkpoint's config records {data.tokenizer_sha256[:12]}); "
                f"{fix}"
            )
        return copy


def restore(path: Path | str, overrides: list[str] = (), *, reads_data: bool = False) -> Restored:
    """The model of the checkpoint `path` means (resolve_checkpoint), built from its saved config
    with `overrides` applied and loaded with its weights. `reads_data`: the command reads the
    run's data (mgpu.evaluate), which is then checked against the run's tokenizer; else
    (mgpu.sample, mgpu.export) the saved config is taken as it is and no data file is read."""
    checkpoint = resolve_checkpoint(path)
    # Every process reads the shared state (rank 0's file): the model and the config are there.
    # To the CPU: it also holds the optimizer's state, which no after-training command needs
    # on a device.
    loaded = load(checkpoint, rank=0, map_location="cpu")
    for key in ("model", "config"):
        if key not in loaded.shared:
            raise CheckpointError(checkpoint, f"holds no {key!r}: not written by mgpu's trainer")
    run_dir = checkpoint.parent.parent  # <run dir>/checkpoints/step-N
    with reading_saved_run(run_dir, reads_data=reads_data):
        cfg = saved_config(loaded.shared["config"], list(overrides), run_dir)
    model = build_model(cfg.model)
    _check_same_model(model, loaded.shared["model"], checkpoint, overrides)
    model.load_state_dict(loaded.shared["model"])  # keys and shapes checked just above
    model.eval()
    # The run's holdout, resolved over the same data (data.path may be given anew, as above)
    holdout = [item for item in overrides if item.split("=")[0].lstrip("+") != "data.eval_samples"]
    trained = None
    if len(holdout) < len(overrides):
        with reading_saved_run(run_dir, reads_data=reads_data):
            saved = saved_config(loaded.shared["config"], holdout, run_dir)
        trained = getattr(saved.data, "eval_samples", None)
    dataset_state = loaded.shared.get("dataset")
    return Restored(checkpoint, loaded.step, cfg, model, dataset_state, trained)


def _check_same_model(
    model: nn.Module, saved: dict, checkpoint: Path, overrides: list[str], shown: int = 3
) -> None:
    """The model built from the (overridden) config against the checkpoint's weights: one line
    naming the first parameters that differ and the model overrides that made them differ."""
    differ = differing_parameters(model, saved)
    if not differ:
        return
    more = f" (and {len(differ) - shown} more parameters differ)" if len(differ) > shown else ""
    changed = [o for o in overrides if o.startswith("model.")]
    if changed:
        fix = "a checkpoint's model keeps the settings it trained with: leave out "
        fix += " ".join(changed)
    else:  # its own saved config builds another model: mgpu's model code changed since
        fix = "the config it saved builds another model now (mgpu's model code changed since)"
    raise CheckpointMismatch(
        f"the model does not match {checkpoint}: {'; '.join(differ[:shown])}{more}; {fix}"
    )


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line every after-training command starts from: its checkpoint argument."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument(
        "checkpoint",
        help="a run directory (its newest valid checkpoint) or <run dir>/checkpoints/step-N",
    )
    return parser


# What the after-training commands report in one line: bad input, not a bug of theirs.
EXPECTED = (
    UsageError,
    TokenizerError,
    CheckpointError,
    CheckpointMismatch,
    ConfigError,
    LaunchError,
    OmegaConfBaseException,
)


@contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """The frame of a command's work: warnings (such as a skipped invalid checkpoint) print as
    `prog: WARNING: ...`, and expected errors end the command with one line on stderr, no
    traceback, and train.py's exit status for them: 2 for a config error or a model that does
    not fit the checkpoint, else 1."""
    logging.basicConfig(level=logging.WARNING, format=f"{prog}: %(levelname)s: %(message)s")
    try:
        yield
    except EXPECTED as err:
        print(f"{prog}: error: {describe_error(err)}", file=sys.stderr, flush=True)
        bad_config = isinstance(err, OmegaConfBaseException)
        raise SystemExit(BAD_INPUT if bad_config else getattr(err, "exit_code", 1)) from None
