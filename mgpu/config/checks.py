"""Config validation helpers shared by every schema module: the error a bad value raises, naming
the key, the value and the fix, and the checks the schemas' __post_init__ run."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from mgpu.runtime.dist import BAD_INPUT, RunStopped


class ConfigError(ValueError, RunStopped):
    """A config value that cannot work; the message names the key, the value and the fix."""

    exit_code = BAD_INPUT

    def __init__(self, key: str, value: Any, why: str):
        super().__init__(f"{key}={value!r}: {why}")


def require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(key, value, why)


def positive(key: str, value: float, example: str) -> None:
    require(value > 0, key, value, f"must be > 0, e.g. {key}={example}")


def positive_fields(config: Any, group: str, keys: tuple[str, ...]) -> None:
    """positive() for each of a config dataclass's `keys`, its default as the example."""
    defaults = {f.name: f.default for f in fields(config)}
    for key in keys:
        positive(f"{group}.{key}", getattr(config, key), str(defaults[key]))


def non_negative(key: str, value: float, example: str) -> None:
    require(value >= 0, key, value, f"must be >= 0, e.g. {key}={example}")


def auto_or_bool(key: str, value: Any) -> bool | str:
    """A key that takes auto, true or false (as typed, or as Hydra parsed it): auto or a bool."""
    text = str(value).lower()
    require(text in ("auto", "true", "false"), key, value, "must be auto, true or false")
    return "auto" if text == "auto" else text == "true"


def auto_or_positive_int(key: str, value: Any, auto: str) -> None:
    """A count that may be left to mgpu: auto (which `auto` explains) or an integer > 0."""
    ok = value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    require(ok, key, value, f"must be auto ({auto}) or a positive integer")
