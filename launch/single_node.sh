#!/usr/bin/env bash
# Train on one machine: one process per local GPU, or NPROC CPU processes where there is none.
#
# Usage: launch/single_node.sh [train.py overrides ...]
#   launch/single_node.sh model=gpt2_small data=tokens data.path=train.bin
#   NPROC=4 MAX_RESTARTS=3 launch/single_node.sh trainer.max_steps=5000
#   RUN_ID=gpt2-a launch/single_node.sh ...   # writes outputs/gpt2-a; the same command resumes there
#
# The run writes to outputs/<date>/<time>/ (or outputs/RUN_ID/, or hydra.run.dir) under the
# directory you start it from. All its processes, and the ones torchrun restarts, share it.
#
# Environment (defaults):
#   NPROC          processes to start (all visible GPUs; 2 on a machine without GPUs)
#   MAX_RESTARTS   times torchrun restarts the workers after one fails (0)
#   RUN_ID         name of the run and its directory, letters/digits/._- (unset: the launch time)
#   PYTHON         the interpreter that has mgpu installed (python3)
#   TORCHRUN_ARGS  extra torchrun flags, e.g. "--log-dir=logs" (none)
set -euo pipefail
MGPU_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=common.sh
source "$MGPU_ROOT/launch/common.sh"

NPROC=${NPROC:-$(default_nproc)}
if [[ -n "${RUN_ID:-}" ]]; then
  check_run_id "$RUN_ID"
  # What --standalone does, but with the run's own id instead of a random one, so that
  # mgpu names the run directory after it.
  rdzv=(--nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --rdzv-id="$RUN_ID")
else
  rdzv=(--standalone)
fi
exec "$PYTHON" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node="$NPROC" \
  --max-restarts="${MAX_RESTARTS:-0}" "${torchrun_extra[@]}" "$TRAIN" "$@"
