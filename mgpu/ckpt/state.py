"""What a checkpoint holds and how it goes back into live objects: rank 0's training state (model,
optimizer, schedule, loss scaler, step, data cursor, resolved config), each rank's RNG states as
weights_only-loadable types, and restores that name every mismatched key instead of torch's
generic message (and a resume's model check, one line before the run writes anything). The files
themselves are mgpu.ckpt.checkpoint's."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn

from mgpu.ckpt.checkpoint import Loaded
from mgpu.data.sampler import DataCursor, ShardedSampler
from mgpu.optim.optimizer import hyperparameters, keep_hyperparameters
from mgpu.runtime.dist import BAD_INPUT, RunStopped

log = logging.getLogger(__name__)


class CheckpointMismatch(ValueError, RunStopped):
    """Saved model or optimizer state that does not fit the one being restored; names the keys.
    A resume refused for it is input that cannot work (exit code 2), as a config error is."""

    exit_code = BAD_INPUT


def capture_rng(
    device: torch.device, generators: Mapping[str, torch.Generator] | None = None
) -> dict:
    """This rank's RNG states as weights_only-loadable types. CUDA: `device` only, never another
    GPU; `generators` are extra torch.Generators by name (e.g. the DataLoader's)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }


def restore_rng(
    state: dict, device: torch.device, generators: Mapping[str, torch.Generator] | None = None
) -> None:
    """Undo capture_rng: the next draws equal those the saving process would have made."""
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        if state["cuda"] is None:
            log.warning("checkpoint has no CUDA RNG state (saved on CPU); CUDA RNG not restored")
        else:
            torch.cuda.set_rng_state(state["cuda"], device)
    for name, g in (generators or {}).items():
        if name in state["generators"]:
            g.set_state(state["generators"][name])
        else:
            log.warning("checkpoint has no state for generator %r; it keeps its seed", name)


def training_state(
    *,
    model: nn.Module,
    optimizer,
    schedule,
    scaler,
    step: int,
    cursor: DataCursor,
    config: str | None = None,
    dataset: dict | None = None,
) -> dict:
    """The replicated state rank 0 saves. `model` is the unwrapped module (comm.unwrap), so the
    keys carry no DDP or torch.compile prefix; `config` is the resolved config as YAML (left out
    when None: the checkpointer adds the run's); `dataset`: the training data set's own state
    (its checkpoint_state, e.g. image_folder's decode share), left out when None."""
    state = {
        "step": step,
        "data": cursor.to_dict(),  # also holds the epoch
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "scaler": scaler.state_dict(),
    }
    if config is not None:
        state["config"] = config
    if dataset is not None:
        state["dataset"] = dataset
    return state


def restore_training_state(
    state: dict, *, model: nn.Module, optimizer, schedule, scaler, source: str = "checkpoint"
) -> tuple[int, DataCursor]:
    """Load training_state's output into live objects; returns (step, data cursor). The
    optimizer and schedule keep the hyperparameters they were built with (this run's config:
    a new optim.lr on resume takes effect), and take the checkpoint's moments and step counts."""
    restore_model(model, state["model"], source=source)
    built = hyperparameters(optimizer)
    restore_optimizer(optimizer, state["optimizer"], model=model, source=source)
    schedule.load_state_dict(state["schedule"])
    keep_hyperparameters(optimizer, schedule, built)
    if scaler.is_enabled() and not state["scaler"]:
        log.warning("%s was saved without loss scaling; the fp16 scaler starts afresh", source)
    else:
        scaler.load_state_dict(state["scaler"])  # a no-op when this run's scaler is disabled
    return int(state["step"]), DataCursor.from_dict(state["data"])


def _listed(kind: str, keys: list[str], limit: int = 12) -> str:
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"\n  {kind}: " + ", ".join(keys[:limit]) + more


def model_differences(
    own: Mapping, saved: Mapping, source: str
) -> tuple[list[str], list[str], list[str]]:
    """The keys of a model's state dict `own` missing from `saved`, those of `saved` not in
    `own`, and each key whose shape differs, said as "key [saved] in source, [own] in the
    model"; in the model's order."""
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    reshaped = [
        f"{k} {list(saved[k].shape)} in {source}, {list(v.shape)} in the model"
        for k, v in own.items()
        if k in saved and tuple(saved[k].shape) != tuple(v.shape)
    ]
    return missing, unexpected, reshaped


def restore_model(model: nn.Module, state_dict: Mapping, *, source: str = "checkpoint") -> None:
    """model.load_state_dict after comparing keys and shapes, so that a mismatch names every
    missing, unexpected and reshaped key instead of torch's generic message."""
    own = model.state_dict()
    missing, unexpected, reshaped = model_differences(own, state_dict, source)
    if missing or unexpected or reshaped:
        msg = f"the model does not match {source}:"
        msg += _listed("missing from the checkpoint", missing) if missing else ""
        msg += _listed("not in the model", unexpected) if unexpected else ""
        msg += _listed("shape differs", reshaped) if reshaped else ""
        if any(k.startswith(("module.", "_orig_mod.")) for k in [*own, *state_dict]):
            msg += "\n  (save and restore the unwrapped module: mgpu.comm.engine.unwrap(model))"
        raise CheckpointMismatch(msg)
    model.load_state_dict(state_dict, strict=True)


def differing_parameters(model: nn.Module, saved: Mapping) -> list[str]:
    """Each parameter (or buffer) of `model` and a checkpoint's `saved` weights that differ, in
    a few words: reshaped ones first (both shapes), then missing and unexpected ones."""
    missing, unexpected, reshaped = model_differences(model.state_dict(), saved, "the checkpoint")
    return [
        *reshaped,
        *(f"{k} is missing from the checkpoint" for k in missing),
        *(f"{k} in the checkpoint is not in the model" for k in unexpected),
    ]


def check_same_model(loaded: Loaded, model: nn.Module, config: str, resume: str) -> None:
    """The model this run built against the one its checkpoint holds, before the run writes
    anything (a refused resume leaves the run directory as it was): one line naming the first
    parameter that differs, both shapes, and the model settings that changed since
    (`config`: this run's resolved config, as YAML), and how to go on (`resume`: ckpt.resume,
    auto for the run directory's own checkpoint)."""
    source = str(loaded.path)
    differ = differing_parameters(model, loaded.shared["model"])
    if not differ:
        return
    more = f" (and {len(differ) - 1} more parameters differ)" if len(differ) > 1 else ""
    changed = _changed_settings(loaded.shared.get("config"), config, "model")
    since = f"; changed since: {changed}" if changed else ""
    classes = _changed_classes(loaded.shared.get("config"), config)
    since += f"; {classes}" if classes else ""
    raise CheckpointMismatch(
        f"the model does not match {source}: {differ[0]}{more}{since}. Resume with the model "
        f"settings it was trained with, or train this model afresh {_afresh(resume)}"
    )


def _changed_settings(
    saved: str | None,
    current: str,
    group: str,
    limit: int = 4,
    skip: tuple[str, ...] = (),
    both: bool = False,
) -> str:
    """`group.key old -> new` for each setting of a config group that differs between two
    resolved configs (YAML), at most `limit` of them, but those in `skip` (and with `both`,
    keys one of them lacks: added since); "" without a saved config."""
    if not saved:
        return ""
    old = OmegaConf.to_container(OmegaConf.create(saved)).get(group, {})
    new = OmegaConf.to_container(OmegaConf.create(current)).get(group, {})
    keys = [k for k in {**old, **new} if old.get(k) != new.get(k) and k not in skip]
    keys = [k for k in keys if k in old and k in new] if both else keys
    said = [f"{group}.{k} {old.get(k)} -> {new.get(k)}" for k in keys[:limit]]
    return ", ".join(said) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _changed_classes(saved: str | None, current: str, shown: int = 3) -> str:
    """An image folder's classes (data.classes, found again at every start) that changed since
    the checkpoint: what was added and what is gone, and how to keep the checkpoint's labels."""
    if not saved:
        return ""
    old = OmegaConf.to_container(OmegaConf.create(saved)).get("data", {}).get("classes")
    new = OmegaConf.to_container(OmegaConf.create(current)).get("data", {}).get("classes")
    if not old or not new or old == new:
        return ""
    if sorted(old) == sorted(new):  # data.classes given in another order: other labels
        return (
            f"the same {len(old)} classes in another order (data.classes): set data.classes "
            "to the checkpoint's list (data.classes in its run's config.yaml)"
        )
    added, gone = [c for c in new if c not in old], [c for c in old if c not in new]
    said = [f"{what}: {', '.join(names[:shown])}{' ...' * (len(names) > shown)}"
            for what, names in (("added", added), ("gone", gone)) if names]  # fmt: skip
    fixes = ["put the missing folders back"] if gone else []
    if added:  # the checkpoint's list keeps out what was added, never brings back what is gone
        fixes.append(
            "move the added folders out of data.path, or set data.classes to the checkpoint's "
            "list (data.classes in its run's config.yaml)"
        )
    return (
        f"the class folders changed ({len(old)} -> {len(new)} classes; {'; '.join(said)}): "
        + "; and ".join(fixes)
    )


def restore_optimizer(
    optimizer, state_dict: Mapping, *, model: nn.Module | None = None, source: str = "checkpoint"
) -> None:
    """optimizer.load_state_dict after comparing parameter groups and state shapes; with `model`
    a mismatch is named by parameter name, else by index."""
    # A sharded optimizer's state is in the unsharded format, over the user's parameters.
    groups = getattr(optimizer, "full_groups", None)
    own_groups = [{"params": g} for g in groups] if groups else optimizer.param_groups
    params = [p for group in own_groups for p in group["params"]]
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    label = [names.get(id(p), f"parameter #{i}") for i, p in enumerate(params)]
    saved_groups = state_dict["param_groups"]
    problems = []
    if len(saved_groups) != len(own_groups):
        n, m = len(saved_groups), len(own_groups)
        problems.append(f"{n} parameter groups in {source}, {m} in the optimizer")
    for g, (saved, own) in enumerate(zip(saved_groups, own_groups, strict=False)):
        if len(saved["params"]) != len(own["params"]):
            n, m = len(saved["params"]), len(own["params"])
            problems.append(f"group {g}: {n} parameters in {source}, {m} in the optimizer")
    for index, per_param in state_dict["state"].items() if not problems else ():
        p = params[index]
        # Only states shaped like their parameter (exp_avg, momentum) are compared; scalars
        # such as Adam's step, and factored states, have other shapes by design.
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim() == p.dim() > 0:
                if value.shape != p.shape:
                    saved_shape, own_shape = list(value.shape), list(p.shape)
                    problems.append(
                        f"{label[index]}: {key} {saved_shape} in {source}, parameter {own_shape}"
                    )
    if problems:
        raise CheckpointMismatch(f"the optimizer does not match {source}:" + _listed("", problems))
    optimizer.load_state_dict(state_dict)


# Data settings that read, decode, batch or augment the samples without changing which they are
# (a resume takes their new values: mgpu.ckpt.resume.check_settings logs them).
SAMPLE_NEUTRAL = (
    "batch_size", "num_workers", "pin_memory", "prefetch_factor", "prefetch_depth",
    "device_transform", "worker_nice", "decode", "cpu_decode_share",
    "reduced_decode", "bad_files", "image_size", "scale", "ratio", "eval_crop",
    "keep_trainer_cores", "tokenizer", "tokenizer_sha256",
)  # fmt: skip


def check_same_data(
    loaded: Loaded,
    sampler: ShardedSampler,
    config_text: str,
    resume: str = "auto",
    held_out: str | None = None,
) -> None:
    """A checkpoint's cursor only means something over the same samples in the same order, and
    its evaluations only over samples it never trained on: `held_out` is the data set's digest of
    the images an image folder holds out now (mgpu.data.folder_files.held_out_digest), which the
    checkpoint kept from its own start. `config_text`: this run's resolved config (YAML), to tell
    a changed holdout from changed data in what is said."""
    # An image folder's classes are found again at every start: a class folder renamed, or one
    # added as another goes, keeps the model's shapes (check_same_model passes) but not what
    # its labels mean.
    classes = _changed_classes(loaded.shared.get("config"), config_text)
    if classes:
        raise CheckpointMismatch(
            f"{loaded.path} trained on other classes: {classes}; or train afresh " + _afresh(resume)
        )
    cursor = DataCursor.from_dict(loaded.shared["data"])
    if cursor.seed != sampler.seed:
        raise CheckpointMismatch(
            f"{loaded.path} trained with trainer.seed={cursor.seed}; this run has "
            f"trainer.seed={sampler.seed}. Resuming needs the same seed: give "
            f"trainer.seed={cursor.seed}"
        )
    if cursor.num_samples != sampler.num_samples:
        raise CheckpointMismatch(
            f"{loaded.path} trained on {cursor.num_samples} samples; this run has "
            f"{sampler.num_samples}. Resuming needs the same training set: "
            + _what_changed(loaded.shared.get("config", ""), config_text, _afresh(resume))
        )
    saved = (loaded.shared.get("dataset") or {}).get("held_out")
    if saved and held_out and saved != held_out:
        raise CheckpointMismatch(
            f"the images data.path holds out now are not those {loaded.path} held out (images "
            "were renamed, or as many added as removed, since), so resuming would train on "
            "images its evaluations were of. Put the folder back as it was, or train afresh "
            + _afresh(resume)
        )


def _afresh(resume: str) -> str:
    """Where a run starts afresh: a run directory with no checkpoint of its own (ckpt.resume=auto
    would find it, =never refuses to start over it), and no checkpoint named."""
    fresh = "in another run directory (hydra.run.dir=...)"
    return fresh + (", without ckpt.resume" if resume != "auto" else "")


def _what_changed(saved_config: str, config_text: str, afresh: str) -> str:
    """Why a training set differs from the checkpoint's, as far as the two configs tell: another
    holdout (data.eval_samples=auto has followed the data's size since such a run started),
    other data settings, or else the data themselves; and how to go on."""
    saved = OmegaConf.create(saved_config or "{}").get("data", {})
    now = OmegaConf.create(config_text or "{}").get("data", {})
    if bool(saved.get("eval_path")) != bool(now.get("eval_path")):  # a holdout, or none
        was = f"data.eval_path={saved.get('eval_path')}" if saved.get("eval_path") else "none"
        return (
            f"data.eval_path decides whether data.path holds images out (the checkpoint's run: "
            f"{was}); resume with the checkpoint's, or train afresh {afresh}"
        )
    held = saved.get("eval_samples") if not saved.get("eval_path") else None
    if isinstance(held, int) and "path" in saved and now.get("eval_samples") != held:
        return (
            f"the checkpoint's run held out data.eval_samples={held} of data.path, this one "
            f"{now.get('eval_samples')}: give data.eval_samples={held}"
        )
    # Settings that can change the samples, as both configs have them: paths aside (a folder
    # or file moved since holds the same data), and what only reads or shapes them.
    skip = ("path", "eval_path", *SAMPLE_NEUTRAL)
    changed = _changed_settings(saved_config, config_text, "data", skip=skip, both=True)
    if changed:
        return f"changed since: {changed}; resume with those settings, or train afresh {afresh}"
    if saved.get("classes") is not None:  # an image folder
        return (
            "images were added to or removed from data.path since; put them back (an "
            "unreadable image among them: keep it in place and resume with data.bad_files=skip, "
            f"which replaces it), or train afresh {afresh}"
        )
    return f"data.path holds other data than it did; resume on those, or train afresh {afresh}"
