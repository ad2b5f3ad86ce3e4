#!/usr/bin/env bash
# Run a Hydra-style sweep as one torchrun launch per point, one point after another, on this
# machine. `hydra -m` itself stops under torchrun with several processes (see README, Sweeps):
# here each point is a launch of its own, with its own process group and run directory.
#
# Usage: launch/sweep.sh [key=a,b ...] [other train.py overrides ...]
#   launch/sweep.sh optim.lr=1e-3,3e-4 trainer.seed=0,1    # 4 runs, in SWEEP_DIR/0 ... /3
#   NPROC=4 SWEEP_DIR=multirun/lr-scan launch/sweep.sh 'optim.lr=choice(1e-3,3e-4)' model=gpt_tiny
#
# Lists (a,b), choice(...) and range(...) sweep, as with `hydra -m`; the last key varies
# fastest. SWEEP_DIR/sweep.txt lists each point's overrides. The sweep stops at the first point
# that fails.
#
# Environment (defaults):
#   SWEEP_DIR  where the points' run directories go, SWEEP_DIR/<n> (multirun/<date>/<time>)
#   NPROC, MAX_RESTARTS, PYTHON, TORCHRUN_ARGS  as for launch/single_node.sh, for every point
set -euo pipefail
MGPU_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=common.sh
source "$MGPU_ROOT/launch/common.sh"

# One clock read for the whole sweep, so its points share one directory.
SWEEP_DIR=${SWEEP_DIR:-multirun/$(date +%Y-%m-%d/%H-%M-%S)}
# Expand all points before running any, so a malformed override fails before any work.
points=$("$PYTHON" "$MGPU_ROOT/launch/sweep_points.py" "$@")
mkdir -p "$SWEEP_DIR"
: >"$SWEEP_DIR/sweep.txt"
n=0
point=()
while IFS= read -r line; do
  printf '%d\t%s\n' "$n" "$line" >>"$SWEEP_DIR/sweep.txt"
  # sweep_points.py quotes each override with shlex, so eval only undoes that quoting.
  eval "point=($line)"
  echo "sweep.sh: point $n: ${point[*]}" >&2
  # hydra.run.dir names each point's directory (quoted for Hydra, so spaces and commas in
  # SWEEP_DIR survive), so RUN_ID is not needed; </dev/null keeps torchrun off the point list.
  env -u RUN_ID bash "$MGPU_ROOT/launch/single_node.sh" "${point[@]}" \
    "hydra.run.dir='$SWEEP_DIR/$n'" </dev/null
  n=$((n + 1))
done <<<"$points"
echo "sweep.sh: $n point(s) done in $SWEEP_DIR" >&2
