"""A config's `_target_`: the import path of the class (or function) a group builds, e.g. a
user's `model._target_=mypkg.nets.TwoLayer` with its `+model.kwargs.*`. This module imports it,
checks that the arguments the config gives fit its signature, and calls it."""

from __future__ import annotations

import difflib
import inspect
import typing
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
    _check_types(key, target, factory, kwargs)


# The annotations a value from the command line is checked against, and the Python types that
# fit each (Hydra reads 16 as int, 1e-3 as float, true as bool, abc as str).
_FITS = {int: (int,), float: (int, float), bool: (bool,)}


def _check_types(key: str, target: str, factory: Any, kwargs: dict[str, Any]) -> None:
    """A value whose parameter is annotated int, float or bool and that is not one (width=abc):
    said as the key's config error, not as the TypeError deep in the user's layers."""
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # noqa: BLE001 - a forward reference it cannot resolve: nothing checked
        return
    for name, value in kwargs.items():
        fits = _FITS.get(hints.get(name))
        if fits and (not isinstance(value, fits) or (bool not in fits and isinstance(value, bool))):
            kind = hints[name].__name__
            why = f"{target} takes {name}: {kind}, and {type(value).__name__} is not one; "
            why += f"give +{key}.kwargs.{name}=<{kind}>"
            raise ConfigError(f"{key}.kwargs.{name}", value, why)


def build_from_target(key: str, target: str, kwargs: dict[str, Any], **extra: Any) -> Any:
    """`target(**extra, **kwargs)` for a `_target_` import path, naming the key if it fails."""
    try:
        factory = get_object(target)
    except Exception as err:
        raise ConfigError(f"{key}._target_", target, f"cannot be imported: {err}") from err
    check_arguments(key, target, factory, kwargs, **extra)
    return factory(**extra, **kwargs)
