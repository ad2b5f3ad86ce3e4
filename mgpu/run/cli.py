"""train.py's command line checked before Hydra runs it: the overrides composed with Hydra's
compose API and validated, so that what Hydra itself would refuse in several lines per rank (an
unknown key, a value of the wrong type, an unknown group choice) is one line naming the key, the
value and the fix, said once per node, with exit code 2, before any process group or run
directory exists.
"""

from __future__ import annotations

import difflib
import importlib
import os
import signal
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from mgpu.config.checks import ConfigError, _require
from mgpu.config.schema import Precision
from mgpu.run.config import Config, describe_error, to_config
from mgpu.runtime import dist

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def check_config(cfg: DictConfig, *, multirun: bool = False) -> Config:
    """A composed config -> the validated Config, with the launch checked and every `_target_`
    imported (a user's dataset or model module that is missing is said here, not per rank after
    the process group started)."""
    config = to_config(cfg)
    for group in ("model", "data"):
        _import_target(f"{group}._target_", getattr(config, group)._target_)
    dist.check_launch(config.dist.backend.value)
    if getattr(config.model, "head_loss", None) == "fused":
        from mgpu.run.build import fused_head_risk  # the device and world this run will have

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if risk := fused_head_risk(config, device, dist.launch_env().world_size > 1):
            fixes = "model.residual=autocast, model.head_loss=logits or trainer.compile=false"
            raise ConfigError("model.head_loss", "fused", f"{risk}; set {fixes}")
    if config.trainer.precision is Precision.fp8:
        from mgpu.train.fp8 import check_fp8  # the device this rank will train on

        on_cuda = torch.cuda.is_available()
        check_fp8(
            torch.device("cuda", dist.launch_env().local_rank) if on_cuda else torch.device("cpu")
        )
        if config.trainer.fp8_skip:  # its names, before any run directory exists
            from mgpu.models import build_model
            from mgpu.train.fp8 import check_skip

            try:
                with torch.device("meta"):  # the layers' names only: no memory, no init work
                    model = build_model(config.model)
            except Exception:  # noqa: BLE001 - a model that can't be built on the meta device
                model = None  # is checked where fp8.convert converts it, on its device
            if model is not None:
                check_skip(model, config.trainer.fp8_skip)
    dist.check_sweep_launch(multirun=multirun)
    return config


def _import_target(key: str, target: str) -> None:
    """The object a `_target_` names, imported as instantiate would, or one line saying why not
    (hydra.utils.get_object would also log its own error lines)."""
    module_name, _, name = target.rpartition(".")
    try:
        module = importlib.import_module(module_name or target)
    except Exception as err:  # noqa: BLE001 - whatever the user's module raised, in one line
        why = f"cannot be imported: {type(err).__name__}: {dist.first_line(err)}"
        raise ConfigError(key, target, f"{why}; name an importable module.Class") from None
    _require(
        not name or hasattr(module, name),
        key,
        target,
        f"module {module_name} has no {name!r}; name an importable module.Class",
    )


def check_command_line(args: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Compose and validate `args` as train.py's overrides; ConfigError (or LaunchError) if they
    cannot work. Hydra's own flags (--multirun, --cfg, --help, ...) and sweeps are left to Hydra
    and ValidateOnRunStart below, which check those runs as Hydra starts them."""
    if any(arg.startswith("-") for arg in args):
        return
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException as err:  # "Error parsing override 'X'", then the parser's words
        lines = str(err).splitlines()
        bad = next((arg for arg in args if f"'{arg}'" in lines[0]), " ".join(args))
        why = f"{lines[-1] if len(lines) < 3 else lines[1]}; write key=value"
        raise ConfigError("override", bad, why) from None
    if any(o.is_sweep_override() for o in overrides):
        return
    for override in overrides:
        _check_group_choice(override, conf_dir)
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = compose(config_name="config", overrides=args)
    except MissingConfigException as err:  # a choice inside a config file: Hydra's words
        raise ConfigError("defaults", "", dist.first_line(err)) from None
    except ConfigCompositionException as err:
        raise _composition_error(err, overrides) from None
    check_config(cfg)


def _check_group_choice(override: Override, conf_dir: Path) -> None:
    """`model=gpt2`: the choices are the group's YAML files, not the schemas mgpu stores in
    Hydra's ConfigStore under the same group (gpt_schema, ...), which Hydra would list too."""
    group = override.key_or_group
    if override.is_delete() or not (conf_dir / group).is_dir():
        return
    choice = override.get_value_element_as_str()
    choices = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
    if choice in choices or (group == "experiment" and choice == "null"):
        return
    # Several may fit (model=gpt2: the four GPT-2 sizes): those it begins, then close ones.
    close = [c for c in choices if c.startswith(choice)]
    close += [c for c in difflib.get_close_matches(choice, choices, n=4) if c not in close]
    hint = f"did you mean {' or '.join(f'{group}={c}' for c in close[:4])}? " if close else ""
    raise ConfigError(group, choice, f"is not a {group} config; {hint}choose one of {choices}")


def _composition_error(err: ConfigCompositionException, overrides: list[Override]) -> Exception:
    """Hydra's error for one override -> ConfigError naming the key, the value and the fix."""
    cause = err.__cause__
    if not isinstance(cause, OmegaConfBaseException) or not getattr(cause, "full_key", None):
        return ConfigError("override", " ".join(o.input_line for o in overrides), str(err))
    key = cause.full_key
    given = {o.key_or_group: o for o in overrides}
    value = given[key].input_line.split("=", 1)[1] if key in given else None
    schema = getattr(cause, "object_type", None)
    known = [f.name for f in fields(schema)] if is_dataclass(schema) else []
    name = key.rsplit(".", 1)[-1]
    parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):  # a key the schema lacks
        close = difflib.get_close_matches(name, known, n=1)
        fix = f"did you mean {parent}{close[0]}={value}?" if close else f"known: {known}"
        where = f"a key of {parent[:-1]}" if parent else "an mgpu setting"
        return ConfigError(key, value, f"is not {where}; {fix}")
    if isinstance(cause, ValidationError):
        example = _default(schema, name)
        hint = f"; e.g. {key}={example}" if example is not None else ""
        return ConfigError(key, value, f"{describe_error(cause).split(': ', 1)[-1]}{hint}")
    return ConfigError(key, value, describe_error(cause))


def _default(schema: Any, name: str) -> Any:
    for f in fields(schema) if is_dataclass(schema) else ():
        if f.name == name and f.default is not MISSING:
            return getattr(f.default, "name", f.default)
    return None


def stop_on_bad_command_line(args: list[str]) -> None:
    """train.py's first step: a bad command line ends this process with one line, said by local
    rank 0 only (once per node, not once per rank), and exit code 2."""
    try:
        check_command_line(args)
    except (ConfigError, OmegaConfBaseException, dist.LaunchError) as err:
        stop_with_config_error(err)


def release_sigterm(held: list[int]) -> None:
    """SIGTERM's default action back, once the config checks passed, and any SIGTERM that came
    meanwhile (`held`) delivered. torchrun stops the other workers as soon as one exits with an
    error, and would kill the one that says it (local rank 0) before it could: train.py holds
    SIGTERM back from its first line until its checks and Hydra's (ValidateOnRunStart) ran."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if held:
        signal.raise_signal(signal.SIGTERM)


def stop_with_config_error(err: Exception) -> NoReturn:
    """The one line of a config error, on local rank 0's console (the other ranks stay quiet),
    and exit code 2. os._exit, not sys.exit: Python's own shutdown puts SIGTERM's default
    action back, and torchrun's SIGTERM, sent as the first rank exits, would then end a rank
    that is exiting on its own with -15 instead of 2."""
    if dist.launch_env().local_rank == 0:
        print(f"mgpu: config error: {describe_error(err)}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


class ValidateOnRunStart(Callback):
    """Hydra calls this after composing the config and before it creates the run directory: the
    check for what check_command_line leaves to Hydra (its flags, sweeps)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_config(config, multirun=config.hydra.mode.name == "MULTIRUN")
        except (ConfigError, OmegaConfBaseException, dist.LaunchError) as err:
            stop_with_config_error(err)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.on_run_start(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep's job, with its swept values: checked before it runs (on_multirun_start saw
        only the base config). A single run was checked in on_run_start already."""
        if config.hydra.mode.name == "MULTIRUN":
            self.on_run_start(config)
