"""A config's `_target_`: the import path of the class (or function) a group builds, e.g. a
user's `model._target_=mypkg.nets.TwoLayer` with its `+model.kwargs.*`. This module imports it,
checks that the arguments the config gives fit its signature, and calls it."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from hydra.utils import get_object

from mgpu.config.checks import ConfigError

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def check_arguments(key: str, target: str, factory: Any, kwargs: dict[str, Any], **extra: Any):
    """ConfigError naming `{key}.kwargs` unless `factory(**extra, **kwargs)` binds: a misspelt
    or missing argument of a user's class said in one line before any process starts, not as
    the TypeError of a traceback on every rank after the run directory exists."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a C type): the call itself says
        return
    try:
        signature.bind(**extra, **kwargs)
    except TypeError as err:
        params = signature.parameters
        takes = [n for n, p in params.items() if p.kind in _NAMED and n not in extra]
        anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        said = []
        for name in [] if anything else [n for n in kwargs if n not in takes]:
            close = difflib.get_close_matches(name, takes, n=1)
            said.append(
                f"takes no argument {name!r}" + (f" (did you mean {close[0]}?)" if close else "")
            )
        missing = [n for n in takes if params[n].default is params[n].empty and n not in kwargs]
        if missing:
            said.append(f"needs {', '.join(map(repr, missing))}")
        what = " and ".join(said) if said else f"cannot be called so: {err}"
        why = f"{target} {what}; it takes {takes}, each set as +{key}.kwargs.NAME=VALUE"
        raise ConfigError(f"{key}.kwargs", kwargs, why) from None


def build_from_target(key: str, target: str, kwargs: dict[str, Any], **extra: Any) -> Any:
    """`target(**extra, **kwargs)` for a `_target_` import path, naming the key if it fails."""
    try:
        factory = get_object(target)
    except Exception as err:
        raise ConfigError(f"{key}._target_", target, f"cannot be imported: {err}") from err
    check_arguments(key, target, factory, kwargs, **extra)
    return factory(**extra, **kwargs)
