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
import re
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
from omegaconf import MISSING as OMEGACONF_MISSING
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from mgpu.config.checks import ConfigError, require
from mgpu.config.schema import Precision
from mgpu.config.sweep import sweep_points
from mgpu.config.targets import check_arguments
from mgpu.data.config import ImageFolderDataConfig
from mgpu.data.folder_files import FolderError, check_root
from mgpu.data.token_config import TokenFileDataConfig, no_token_file
from mgpu.models.gpt import CUDA_ONLY_ATTENTION
from mgpu.run.config import Config, describe_error, to_config
from mgpu.runtime import dist
from mgpu.runtime.preempt import PREEMPTED_EXIT_CODE
from mgpu.runtime.stops import record_for_torchrun

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
LONGEST_KEY = 200  # characters; mgpu's longest is under 40
KNOWN_KEYS = "write key=value with a key that `python train.py --help` lists"
MULTIRUN_FLAGS = ("-m", "--multirun")
SWEEP_POINTS_CHECKED = 64  # a point's check composes a config: ~0.1 s of a CPU


def check_config(cfg: DictConfig, *, multirun: bool = False) -> Config:
    """A composed config -> the validated Config, with the launch checked and every `_target_`
    imported (a user's dataset or model module that is missing is said here, not per rank after
    the process group started)."""
    config = to_config(cfg)
    for group, extra in (("model", {}), ("data", {"split": "train"})):
        sub = getattr(config, group)
        factory = _import_target(f"{group}._target_", sub._target_)
        if hasattr(sub, "kwargs"):  # a user's class (model=custom, data=custom): its arguments
            check_arguments(group, sub._target_, factory, sub.kwargs, **extra)
    attention = getattr(config.model, "attention", None)
    if attention in CUDA_ONLY_ATTENTION and not torch.cuda.is_available():
        why = "runs on CUDA GPUs only, and this machine has none; use auto, torch, flash or math"
        raise ConfigError("model.attention", attention, why)
    if isinstance(config.data, TokenFileDataConfig):  # set whole, it validates without it
        if not os.path.isfile(config.data.path):
            raise no_token_file(config.data.path)
    if hasattr(config.data, "check_train_batches"):  # token files, image folders and sets
        # a batch for every process left by the holdout: the world is known here, not in it
        config.data.check_train_batches(dist.launch_env().world_size)
    if isinstance(config.data, ImageFolderDataConfig):  # with data.classes, it validates without
        try:
            check_root("data.path", config.data.path)
        except FolderError as err:
            raise ConfigError(err.key, err.value, err.why) from None
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


def _import_target(key: str, target: str) -> Any:
    """The object a `_target_` names, imported as instantiate would, or one line saying why not
    (hydra.utils.get_object would also log its own error lines)."""
    module_name, _, name = target.rpartition(".")
    try:
        module = importlib.import_module(module_name or target)
    except Exception as err:  # noqa: BLE001 - whatever the user's module raised, in one line
        why = f"cannot be imported: {type(err).__name__}: {dist.first_line(err)}"
        raise ConfigError(key, target, f"{why}; name an importable module.Class") from None
    require(
        not name or hasattr(module, name),
        key,
        target,
        f"module {module_name} has no {name!r}; name an importable module.Class",
    )
    return getattr(module, name) if name else module


def check_command_line(args: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Compose and validate `args` as train.py's overrides; ConfigError (or LaunchError) if they
    cannot work. A sweep (`-m`) is checked point by point, up to SWEEP_POINTS_CHECKED of them,
    before its first point trains: a bad value of a later point would be met only after the
    points before it ran. Hydra's other flags (--cfg, --help, ...), a sweep's later points and
    sweeps without a list of points are left to Hydra and ValidateOnRunStart below, which check
    each run as Hydra starts it."""
    if any(arg.startswith("-") and arg not in MULTIRUN_FLAGS for arg in args):
        return
    args = [arg for arg in args if arg not in MULTIRUN_FLAGS]
    parser = OverridesParser.create()
    for arg in args:  # one at a time: the error names the one that fails
        try:
            parser.parse_overrides([arg])
        except HydraException as err:
            raise _override_error(arg, str(err)) from None
    overrides = parser.parse_overrides(args)
    if any(o.is_sweep_override() for o in overrides):
        try:
            points = sweep_points(args)
        except ValueError:  # interval(...): a search space, for a sweeper plugin to sample
            return
        for point in points[:SWEEP_POINTS_CHECKED]:
            check_command_line(point, conf_dir)
        return
    for override in overrides:
        if len(override.key_or_group) > LONGEST_KEY:  # Hydra would look for a file of its name
            why = f"a key of {len(override.key_or_group)} characters, longer than any setting"
            raise ConfigError("override", override.input_line, f"{why}; {KNOWN_KEYS}")
        _check_group_choice(override, conf_dir)
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = compose(config_name="config", overrides=args)
    except MissingConfigException as err:  # a choice inside a config file: Hydra's words
        raise ConfigError("defaults", "", dist.first_line(err)) from None
    except ConfigCompositionException as err:
        raise composition_error(err, overrides) from None
    check_config(cfg)


# What Hydra's override grammar says before the character it could not read: the text it read,
# its caret under that character on the next line (the lexer's errors), or the input it met
# (the parser's).
_LEXER = "LexerNoViableAltException: "
_MET = re.compile(r"(?:mismatched|extraneous) input '(.+?)'|no viable alternative at input '(.+?)'")


def _override_error(arg: str, said: str) -> ConfigError:
    """An override Hydra's grammar refuses -> one line naming the character that it could not
    read, whether it is in the key or the value, and the fix: a key is ASCII (the grammar reads
    no other letters); a value with characters the grammar reserves (shell metacharacters among
    them) is quoted for Hydra, inside the shell's quotes."""
    lines = said.splitlines()
    at = None
    if lines[0].startswith(_LEXER) and len(lines) > 1 and "^" in lines[1]:
        at = lines[1].index("^") - len(_LEXER)
    elif met := _MET.search(said):
        found = arg.find(met.group(1) or met.group(2))
        at = found if found >= 0 else None
    equals = arg.find("=")
    if at is None or not 0 <= at < len(arg):
        why = "Hydra's override grammar cannot read it; write key=value, and quote a value "
        why += "with spaces or symbols for Hydra: \"key='a value'\""
        return ConfigError("override", arg, why)
    char = arg[at]
    if equals < 0 or at < equals:
        why = f"{char!r} (character {at + 1}) cannot be in a key: keys are ASCII letters, digits, "
        why += f"'_' and '.'; {KNOWN_KEYS}"
        return ConfigError("override", arg, why)
    key, value = arg[:equals], arg[equals + 1 :]
    quoted = "\\'".join(value.split("'"))
    why = f"{char!r} (character {at + 1}) cannot be in a value unquoted; quote the value for "
    why += f"Hydra, inside the shell's quotes: \"{key}='{quoted}'\""
    return ConfigError("override", arg, why)


def group_choices(group_dir: Path) -> list[str]:
    """A config group's choices: its YAML files' names. Not the schemas mgpu stores in Hydra's
    ConfigStore under the same group (gpt_schema, ...), which Hydra lists among them."""
    return sorted(p.stem for p in group_dir.glob("*.yaml"))


def config_groups(conf_dir: Path = CONF_DIR) -> str:
    """`train.py --help`'s list of the config groups and their choices, a line each (conf/
    config.yaml's hydra.help.template: Hydra's own list would offer the schemas as choices)."""
    groups = sorted(p for p in conf_dir.iterdir() if p.is_dir())
    return "\n".join(f"{g.name}: {', '.join(group_choices(g))}" for g in groups)


if not OmegaConf.has_resolver("mgpu_config_groups"):
    OmegaConf.register_new_resolver("mgpu_config_groups", config_groups)


def _check_group_choice(override: Override, conf_dir: Path) -> None:
    """`model=gpt2`: one of the group's choices (group_choices), or one line saying which are."""
    group = override.key_or_group
    try:
        is_group = (conf_dir / group).is_dir()
    except OSError:  # a key too long to be a file name (ENAMETOOLONG): no group; compose says
        is_group = False
    if override.is_delete() or not is_group:
        return
    choice = override.get_value_element_as_str()
    choices = group_choices(conf_dir / group)
    if choice in choices or (group == "experiment" and choice == "null"):
        return
    # Several may fit (model=gpt2: the four GPT-2 sizes): those it begins, then close ones.
    close = [c for c in choices if c.startswith(choice)]
    close += [c for c in difflib.get_close_matches(choice, choices, n=4) if c not in close]
    hint = f"did you mean {' or '.join(f'{group}={c}' for c in close[:4])}? " if close else ""
    raise ConfigError(group, choice, f"is not a {group} config; {hint}choose one of {choices}")


def composition_error(err: ConfigCompositionException, overrides: list[Override]) -> Exception:
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
        if not is_dataclass(schema):  # a dict of the user's own keys (model.kwargs, ...)
            fix = f"a key of your own is added with a '+': +{key}={value}"
        where = f"a key of {parent[:-1]}" if parent else "an mgpu setting"
        return ConfigError(key, value, f"is not {where}; {fix}")
    if isinstance(cause, ValidationError):
        example = _default(schema, name)
        hint = f"; e.g. {key}={example}" if example is not None else ""
        return ConfigError(key, value, f"{describe_error(cause).split(': ', 1)[-1]}{hint}")
    return ConfigError(key, value, describe_error(cause))


def _default(schema: Any, name: str) -> Any:
    """A setting's default, as an example of its values; None for one without (a required
    setting's default is OmegaConf's "???", no example)."""
    for f in fields(schema) if is_dataclass(schema) else ():
        if f.name == name and f.default not in (MISSING, OMEGACONF_MISSING):
            return getattr(f.default, "name", f.default)
    return None


def stop_on_bad_command_line(args: list[str]) -> None:
    """train.py's first step: a bad command line ends this process with one line, said by local
    rank 0 only (once per node, not once per rank), and exit code 2."""
    try:
        check_command_line(args)
    except (ConfigError, OmegaConfBaseException, dist.LaunchError) as err:
        stop_with_config_error(err)


def release_sigterm(held: list[int], advice: str) -> None:
    """SIGTERM's default action back, once the config checks passed; a SIGTERM that came
    meanwhile (`held`) is a preemption before the first step: nothing of this launch to save,
    so one line from rank 0 with `advice` (resume_advice's) and exit 75, as a preemption's.
    torchrun stops the other workers as soon as one exits with an error, and would kill the one
    that says it (local rank 0) before it could: train.py holds SIGTERM back from its first
    line until its checks and Hydra's (ValidateOnRunStart) ran.

    From here until Preemption takes SIGTERM over, the default action: the process group's join
    and the first collectives block in C++, where a Python handler would run only once they
    return (up to dist.timeout_s), while the kill ends them at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if held:
        if os.environ.get("RANK", "0") == "0":
            print(
                f"preempted (SIGTERM) while starting, before the first step: nothing to save; "
                f"exit code {PREEMPTED_EXIT_CODE}, {advice}",
                file=sys.stderr,
            )
            sys.stderr.flush()
        os._exit(PREEMPTED_EXIT_CODE)


def clipped(line: str, longest: int = 300) -> str:
    """`line` with each run of more than `longest` characters without a space (a 10,000
    character value, said once by mgpu and again in OmegaConf's words) cut to its start and
    its length: the line stays one a terminal shows."""
    return re.sub(
        rf"\S{{{longest + 1},}}",
        lambda m: f"{m[0][:60]}...[{len(m[0])} characters]...{m[0][-6:]}",
        line,
    )


def check_run_dir(key: str, path: str) -> None:
    """The run directory Hydra is about to create (or use) can be written: each of its names
    short enough for the filesystem, and the nearest folder of it that exists writable (not on
    a read-only filesystem, not another user's). ConfigError otherwise, before Hydra's own
    traceback from creating it or from opening its log files there."""
    target = Path(path).absolute()
    limit = 255  # NAME_MAX on Linux filesystems; pathconf needs a folder that exists
    if long := next((part for part in target.parts if len(part.encode()) > limit), None):
        why = f"a name of {len(long.encode())} bytes in it, over the {limit} a file name may have"
        raise ConfigError(key, path, f"{why}; choose a shorter {key}=PATH")
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(key, path, f"{existing} is a file, not a folder; choose {key}=PATH")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        why = f"{existing} is on a read-only filesystem"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable by this user"
    else:
        return
    raise ConfigError(key, path, f"{why}; choose a run directory that can be written: {key}=PATH")


def config_error_line(err: Exception) -> str:
    """The one line a config error is said in."""
    return f"mgpu: config error: {clipped(describe_error(err))}"


def stop_with_config_error(err: Exception) -> NoReturn:
    """The one line of a config error, on local rank 0's console (the other ranks stay quiet),
    and exit code 2; under torchrun every rank records it for torchrun's report, and under
    launch/torchrun.py, which then ends with it, no rank says it itself. os._exit, not
    sys.exit: Python's own shutdown puts SIGTERM's default action back, and torchrun's SIGTERM,
    sent as the first rank exits, would then end a rank that is exiting on its own with -15
    instead of 2."""
    line = config_error_line(err)
    env = dist.launch_env()
    recorded = record_for_torchrun(line, env.error_file)
    if env.local_rank == 0 and not (recorded and env.launcher_says_errors):
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


class ValidateOnRunStart(Callback):
    """Hydra calls this after composing the config and before it creates the run directory: the
    check for what check_command_line leaves to Hydra (its flags, sweeps)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        multirun = config.hydra.mode.name == "MULTIRUN"
        try:
            check_config(config, multirun=multirun)
            key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
            check_run_dir(key, str(OmegaConf.select(config, key)))
        except (ConfigError, OmegaConfBaseException, dist.LaunchError) as err:
            stop_with_config_error(err)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.on_run_start(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep's job, with its swept values: checked before it runs (on_multirun_start saw
        only the base config). A single run was checked in on_run_start already."""
        if config.hydra.mode.name == "MULTIRUN":
            self.on_run_start(config)
