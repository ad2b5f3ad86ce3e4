"""Expand Hydra sweep overrides into the sweep's points, one line each, for launch/sweep.sh.

    python launch/sweep_points.py optim.lr=1e-3,3e-4 trainer.seed=0,1 model=gpt_tiny

prints 4 lines, each one point's overrides quoted for the shell, in the order `hydra -m` would
run them (the last key varies fastest). Lists (`a,b`), `choice(...)` and `range(...)` sweep;
other overrides go to every point unchanged.
"""

import itertools
import shlex
import sys

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException


def sweep_points(args: list[str]) -> list[list[str]]:
    """The cartesian product of every override's values: one override list per point."""
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


def main(argv: list[str]) -> int:
    if any("\n" in arg for arg in argv):  # sweep.sh reads the points back one line each
        print(
            "sweep.sh: an override holds a line break, which sweep.sh cannot pass on",
            file=sys.stderr,
        )
        return 2
    try:
        points = sweep_points(argv)
    except (HydraException, ValueError) as err:
        print(f"sweep.sh: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    for point in points:
        print(shlex.join(point))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
