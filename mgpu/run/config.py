"""The whole Config: every group's schema composed into one, the checks across groups (does the
model fit the data), and the composed Hydra config turned into it (to_config), with unknown keys
refused; the schemas registered with Hydra. Errors in one line (describe_error)."""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, read_write
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from mgpu.config.checks import ConfigError, require
from mgpu.config.schema import CheckpointConfig, DistConfig, Engine, OptimConfig, TrainerConfig
from mgpu.data.config import (
    CustomDataConfig,
    DataConfig,
    ImageDataConfig,
    ImageFolderDataConfig,
    ImageShardsDataConfig,
    NgramDataConfig,
)
from mgpu.data.token_config import TokenFileDataConfig
from mgpu.models.config import (
    ClassifierConfig,
    CustomModelConfig,
    GPTModelConfig,
    MLPModelConfig,
    ModelConfig,
    ResNetModelConfig,
)
from mgpu.runtime import dist

log = logging.getLogger(__name__)


@dataclass
class Config:
    # One of the built-in model schemas or CustomModelConfig, chosen by `model=...`. The field
    # names their base class: OmegaConf 2.3 refuses a Union of dataclasses ("Unions of
    # containers are not supported"), and a subclass assigned to a base-typed field is allowed.
    model: ModelConfig = MISSING
    data: DataConfig = MISSING  # likewise: one of the data schemas, chosen by `data=...`
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        _check_model_fits_data(self.model, self.data)
        check_dist_fits_trainer(self.dist, self.trainer)

    def pins_cpus(self, local_ranks: int) -> bool:
        """dist.cpu_affinity for a launch of `local_ranks` processes on this node. auto: on where
        DataLoader workers decode the user's images (data=image_folder, data=image_shards) and
        the node has a CPU for each of its ranks. Four ranks of compiled ResNet-50 on a
        realistic JPEG folder, 16 cores each, ran 25.22 ms a step pinned against 35.36 unpinned
        (21.07 with batches ready; one run each, bench/README.md "Real images on 4 GPUs"):
        unpinned, 4 x 14 decoding workers and the ranks' launch and copy threads migrate across
        all 64 cores. One rank keeps every CPU it may use, pinned or not."""
        if self.dist.cpu_affinity != "auto":
            return self.dist.cpu_affinity
        if not isinstance(self.data, ImageFolderDataConfig):
            return False
        if len(os.sched_getaffinity(0)) < local_ranks:
            log.info("dist.cpu_affinity=auto: off, fewer CPUs than the %d ranks here", local_ranks)
            return False
        return True


def check_dist_fits_trainer(dist_cfg: DistConfig, trainer: TrainerConfig) -> None:
    """torch DDP's static graph cannot take micro-steps that skip the reduction: its reducer
    stops the first such backward with an internal assertion (torch 2.11 and 2.13), after the
    run directory exists. Said here, before anything starts."""
    if dist_cfg.engine is Engine.torch_ddp and dist_cfg.ddp_static_graph:
        require(
            trainer.grad_accum_steps == 1,
            "dist.ddp_static_graph",
            True,
            f"torch DDP's static graph fails on the micro-steps of trainer.grad_accum_steps="
            f"{trainer.grad_accum_steps} that skip the reduction; set dist.ddp_static_graph=false"
            f" or trainer.grad_accum_steps=1",
        )


# The data group's choices, by the schema each composes to: errors name the one a user chose.
DATA_SCHEMAS = {
    "ngram": NgramDataConfig,
    "images": ImageDataConfig,
    "tokens": TokenFileDataConfig,
    "image_folder": ImageFolderDataConfig,
    "image_shards": ImageShardsDataConfig,
    "custom": CustomDataConfig,
}
IMAGES = "data=images (synthetic), data=image_folder or data=image_shards (your own)"
TOKENS = "data=ngram (synthetic) or data=tokens (your own)"


def data_choice(data: DataConfig) -> str:
    """The data group choice that composed `data`."""
    return next(name for name, schema in DATA_SCHEMAS.items() if type(data) is schema)


def _check_model_fits_data(model: ModelConfig, data: DataConfig) -> None:
    """Resolve model.vocab_size=auto and model.num_classes=auto from the data, and
    data.seq_len=auto from the model; catch a model/data pairing that would only fail deep
    inside the first step."""
    classifier = isinstance(model, (ResNetModelConfig, MLPModelConfig))
    if classifier and isinstance(data, (NgramDataConfig, TokenFileDataConfig)):
        raise ConfigError("data", data_choice(data), f"an image model needs image data: {IMAGES}")
    if isinstance(data, ImageFolderDataConfig):
        _check_model_fits_folder(model, data)
    # A user's dataset (data=custom) tells its vocabulary and classes by the kwargs it is built
    # with, a user's model its context likewise.
    custom = isinstance(data, CustomDataConfig)
    if isinstance(model, ClassifierConfig) and not isinstance(data, ImageFolderDataConfig):
        classes = data.kwargs.get("num_classes") if custom else getattr(data, "num_classes", None)
        model.follow_classes(classes, data._target_)
    if isinstance(data, TokenFileDataConfig):
        is_gpt, is_custom = isinstance(model, GPTModelConfig), isinstance(model, CustomModelConfig)
        context = model.block_size if is_gpt else None
        data.follow_model(model.kwargs.get("block_size") if is_custom else context, model._target_)
    if isinstance(model, GPTModelConfig):
        if isinstance(data, ImageDataConfig):
            raise ConfigError("data", "images", f"a GPT model needs token data: {TOKENS}")
        vocab = data.kwargs.get("vocab_size") if custom else getattr(data, "vocab_size", None)
        model.follow_data(vocab, data._target_)
        if isinstance(data, (NgramDataConfig, TokenFileDataConfig)):
            require(
                data.seq_len <= model.block_size,
                "data.seq_len",
                data.seq_len,
                f"exceeds model.block_size ({model.block_size}), the model's context; set "
                "data.seq_len=auto (follows it), lower it, or raise model.block_size",
            )
    if isinstance(model, ClassifierConfig):
        model.follow_inputs(*_image_shape(data), data._target_)


def _image_shape(data: DataConfig) -> tuple[int | None, int | None]:
    """The channels and side of the data's images, None where the data does not say."""
    if isinstance(data, ImageDataConfig):
        return data.channels, data.image_size
    if isinstance(data, ImageFolderDataConfig):
        return 3, data.image_size  # every image decoded to RGB
    if isinstance(data, CustomDataConfig):
        return data.kwargs.get("channels"), data.kwargs.get("image_size")
    return None, None


# The data keys that name the user's files (mgpu's token and image data sets)
DATA_FILES = ("path", "eval_path", "tokenizer")  # a tokenizer.json's path (not auto/bytes/none)
TOKENIZER_WORDS = ("auto", "bytes", "none")  # data.tokenizer's values that name no file


def resolved_yaml(cfg: DictConfig, files_from: Path | None = None) -> str:
    """The composed config without Hydra's own node, resolved, as YAML: what the ranks compare at
    start-up (as given: nodes may start in other directories of one layout) and, with
    `files_from` (the working directory), what the run directory's config.yaml and every
    checkpoint hold: there a relative data.path, data.eval_path or data.tokenizer that names a
    file or folder from `files_from` is made absolute, so mgpu.evaluate, a resume or a look at
    the config from another directory finds the same data."""
    resolved = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    if files_from is not None and isinstance(resolved.get("data"), DictConfig):
        resolved = OmegaConf.create(OmegaConf.to_container(resolved, resolve=True))
        for key in DATA_FILES:
            value = resolved.data.get(key)
            # "" (no eval folder) and absolute paths stay; a relative one that names nothing too
            named = isinstance(value, str) and value and value not in TOKENIZER_WORDS
            if named and os.path.exists(files_from / value):
                resolved.data[key] = os.path.abspath(files_from / value)
    return OmegaConf.to_yaml(resolved, resolve=True)


def _check_model_fits_folder(model: ModelConfig, data: ImageFolderDataConfig) -> None:
    classes = len(data.classes)
    if isinstance(model, GPTModelConfig):
        raise ConfigError("data", data_choice(data), f"a GPT model needs token data: {TOKENS}")
    if isinstance(model, ClassifierConfig):
        model.follow_classes(classes, f"data.path={data.path}")


def to_config(cfg: DictConfig) -> Config:
    """Composed Hydra config -> validated typed Config (runs every __post_init__ check)."""
    _reject_unknown_keys(cfg)
    # Converting group by group leaves out Hydra's own `hydra` node, and building Config last
    # runs the cross-group checks in Config.__post_init__.
    parts = {f.name: OmegaConf.to_object(cfg[f.name]) for f in fields(Config)}
    config = Config(**parts)
    _record_resolved(cfg, config)
    return config


def _record_resolved(cfg: DictConfig, config: Config) -> None:
    """Write what the model and data schemas resolved into the composed config, so that the
    run's config.yaml, made from it, records it: data=image_folder's class list (the labels must
    not change when a folder is added later), data=tokens' tokenizer and vocabulary, and
    model.vocab_size=auto's number."""
    with read_write(cfg):
        for group in ("model", "data"):
            resolved = getattr(getattr(config, group), "resolved", None)
            for key, value in resolved().items() if resolved else ():
                cfg[group][key] = value


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """`+optim.lrr=1` adds a key the schema lacks; OmegaConf would drop it without a word."""
    top = {f.name for f in fields(Config)} | {"hydra"}
    for key in cfg.keys():
        require(key in top, str(key), cfg[key], f"is not an mgpu setting; known: {sorted(top)}")
    for group in top - {"hydra"}:
        schema = OmegaConf.get_type(cfg[group])
        known = {f.name for f in fields(schema)}
        for key in cfg[group].keys():
            close = difflib.get_close_matches(str(key), known, n=1)
            fix = f"did you mean {group}.{close[0]}?" if close else f"known: {sorted(known)}"
            why = f"is not a key of {group} ({schema.__name__}); {fix}"
            require(key in known, f"{group}.{key}", cfg[group][key], why)


def describe_error(err: Exception) -> str:
    """One line for a config error, whether ours or OmegaConf's."""
    if isinstance(err, OmegaConfBaseException):
        key = getattr(err, "full_key", None)
        first = str(err).splitlines()[0]
        if isinstance(err, MissingMandatoryValue):
            return f"{key} is required and has no value: set it on the command line, {key}=..."
        return f"{key}: {first}" if key else first
    return str(err)


def register() -> None:
    """Put the schemas into Hydra's ConfigStore and the run-name resolver into OmegaConf."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, name, node in [
        ("model", "gpt_schema", GPTModelConfig),
        ("model", "resnet_schema", ResNetModelConfig),
        ("model", "mlp_schema", MLPModelConfig),
        ("model", "custom_schema", CustomModelConfig),
        *(("data", f"{name}_schema", schema) for name, schema in DATA_SCHEMAS.items()),
    ]:
        cs.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("mgpu_run_name"):
        OmegaConf.register_new_resolver("mgpu_run_name", dist.launch_run_name)


register()
