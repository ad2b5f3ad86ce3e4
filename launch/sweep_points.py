"""Expand Hydra sweep overrides into the sweep's points, one line each, for launch/sweep.sh.

    python launch/sweep_points.py optim.lr=1e-3,3e-4 trainer.seed=0,1 model=gpt_tiny

prints 4 lines, each one point's overrides quoted for the shell, in the order `hydra -m` would
run them (the last key varies fastest). Lists (`a,b`), `choice(...)` and `range(...)` sweep;
other overrides go to every point unchanged.
"""

import shlex
import sys
from pathlib import Path

from hydra.errors import HydraException

# mgpu from this checkout, as train.py's own folder gives it to train.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mgpu.config.sweep import sweep_points  # noqa: E402


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
