"""A Hydra sweep's points: the overrides of each run that `train.py -m` (or launch/sweep.sh, one
launch per point) makes of `a,b`, `choice(...)` and `range(...)` values, in Hydra's order (the
last key varies fastest). train.py checks each point's config before the first one runs."""

from __future__ import annotations

import itertools

from hydra.core.override_parser.overrides_parser import OverridesParser


def sweep_points(args: list[str]) -> list[list[str]]:
    """The cartesian product of every override's values: one override list per point. Raises
    ValueError for what has no list of points (Hydra's own settings swept, `interval(...)`) and
    Hydra's errors for what its grammar cannot read."""
    per_override: list[list[str]] = []
    for override in OverridesParser.create().parse_overrides(args):
        if not override.is_sweep_override():
            per_override.append([override.input_line])
        elif override.is_hydra_override():
            raise ValueError(f"{override.input_line}: Hydra's own settings cannot be swept")
        elif override.is_discrete_sweep():
            key = override.get_key_element()
            per_override.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        else:
            # interval(...) describes a search space for an optimizer, not a list of points.
            raise ValueError(f"{override.input_line}: cannot list its points; use a,b or range()")
    return [list(point) for point in itertools.product(*per_override)]
