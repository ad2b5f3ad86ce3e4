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
# Nothing of the run listens beyond loopback (README.md, "What listens on the network").
# A launch that fails ends with the failed worker's one line and exits with its exit code
# (launch/torchrun.py; docs/launching.md, "When a launch fails").
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
check_count NPROC "$NPROC" 1
check_count MAX_RESTARTS "${MAX_RESTARTS:-0}" 0
if [[ -n "${RUN_ID:-}" ]]; then
  check_run_id "$RUN_ID"
fi

# One machine needs no network, so nothing of the run listens where another machine could reach
# it. torch binds a TCP store on every interface whatever address it is given, so torchrun's
# rendezvous keeps its state in a file instead (store_type=file), and the workers meet at
# 127.0.0.1 (--local-addr becomes their MASTER_ADDR), where mgpu binds their store and points
# gloo and NCCL at the loopback interface (mgpu/runtime/launch.py, loopback_store).
# The file is this user's alone (mktemp: 0600). Where /proc is there it is removed at once, so
# that nothing is left behind: torchrun inherits it open through the exec below (bash leaves the
# descriptor open across exec) and, keeping this shell's pid, reaches it as /proc/<pid>/fd/<n>.
rdzv_file=$(mktemp "${TMPDIR:-/tmp}/mgpu-rdzv.XXXXXX")
exec {rdzv_fd}<>"$rdzv_file"
if [[ -e /proc/$$/fd/$rdzv_fd ]]; then
  rm -f "$rdzv_file"
  rdzv_file=/proc/$$/fd/$rdzv_fd
fi
# torchrun keeps only the last --rdzv-conf (and ignores PET_RDZV_CONF once one is given): the
# user's settings, in their order, go into ours rather than one of them being lost.
rdzv_conf=${PET_RDZV_CONF:+$PET_RDZV_CONF,}
extra=()
conf_next=0
for arg in "${torchrun_extra[@]}"; do
  if ((conf_next)); then
    rdzv_conf+="$arg,"
    conf_next=0
  elif [[ $arg == --rdzv[-_]conf ]]; then
    conf_next=1
  elif [[ $arg == --rdzv[-_]conf=* ]]; then
    rdzv_conf+="${arg#*=},"
  else
    extra+=("$arg")
  fi
done
rdzv_conf+=store_type=file
rdzv=(--nnodes=1 --rdzv-backend=c10d --rdzv-endpoint="$rdzv_file" --rdzv-conf="$rdzv_conf")
rdzv+=(--local-addr=127.0.0.1)
# mgpu names the run directory after a rendezvous id; without one, after the launch time.
if [[ -n "${RUN_ID:-}" ]]; then
  rdzv+=(--rdzv-id="$RUN_ID")
fi
exec "$PYTHON" "$TORCHRUN" "${rdzv[@]}" --nproc-per-node="$NPROC" \
  --max-restarts="${MAX_RESTARTS:-0}" "${extra[@]}" "$TRAIN" "$@"
