#!/usr/bin/env bash
# Train on one machine: one process per local GPU, or NPROC CPU processes where there is none.
#
# Usage: launch/single_node.sh [train.py overrides ...]
#   launch/single_node.sh model=gpt2_small data=tokens data.path=train.bin
#   NPROC=4 MAX_RESTARTS=3 launch/single_node.sh trainer.max_steps=5000
#
# Environment (defaults):
#   NPROC         processes to start (all visible GPUs; 2 on a machine without GPUs)
#   MAX_RESTARTS  times torchrun restarts the group after a worker fails (0)
#   PYTHON        the interpreter that has mgpu installed (python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  --max-restarts="${MAX_RESTARTS:-0}" train.py "$@"
