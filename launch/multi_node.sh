#!/usr/bin/env bash
# Train on several machines: run this same command on every node. torchrun's c10d rendezvous
# gathers the nodes and numbers them (node ranks follow the nodes' host names, so no node needs
# a --node-rank); all of them write to one run directory, outputs/RUN_ID.
#
# Usage (on every node, from the same directory on a shared filesystem):
#   NNODES=2 RDZV_ENDPOINT=node0:29400 RUN_ID=gpt2-a launch/multi_node.sh [train.py overrides ...]
#   NNODES=2:4 RDZV_ENDPOINT=node0:29400 RUN_ID=gpt2-a MAX_RESTARTS=3 launch/multi_node.sh ...
#     elastic: starts once 2 nodes have joined, admits up to 4, and restarts the workers (in the
#     same run directory) whenever a node joins or leaves
#
# A launch that fails ends with the failed worker's one line and exits with its exit code
# (launch/torchrun.py; docs/launching.md, "When a launch fails").
#
# Environment (defaults):
#   NNODES          nodes, or MIN:MAX for an elastic range (required)
#   RDZV_ENDPOINT   host:port of the rendezvous store, reachable from every node; the node that
#                   owns that address hosts it (required)
#   RUN_ID          the run's name, the same on every node: the rendezvous id and outputs/RUN_ID;
#                   letters/digits/._- (required). Running the same command again resumes there
#   NPROC_PER_NODE  processes per node (all visible GPUs; 2 on a node without GPUs)
#   MAX_RESTARTS    times torchrun restarts the workers after a failure (0)
#   LOCAL_ADDR      this node's address as the others reach it (torchrun looks up its FQDN)
#   PYTHON          the interpreter that has mgpu installed (python3)
#   TORCHRUN_ARGS   extra torchrun flags, e.g. "--rdzv-conf=join_timeout=900" (none)
set -euo pipefail
MGPU_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=common.sh
source "$MGPU_ROOT/launch/common.sh"

[[ -n "${NNODES:-}" ]] || die "set NNODES (e.g. NNODES=2, or NNODES=2:4 for an elastic range)"
[[ -n "${RDZV_ENDPOINT:-}" ]] || die "set RDZV_ENDPOINT=host:port of one node, the same on all"
[[ -n "${RUN_ID:-}" ]] || die "set RUN_ID=name, the same on every node (it names outputs/RUN_ID)"
check_run_id "$RUN_ID"
check_nodes "$NNODES"
check_endpoint "$RDZV_ENDPOINT"
NPROC_PER_NODE=${NPROC_PER_NODE:-$(default_nproc)}
check_count NPROC_PER_NODE "$NPROC_PER_NODE" 1
check_count MAX_RESTARTS "${MAX_RESTARTS:-0}" 0
local_addr=()
if [[ -n "${LOCAL_ADDR:-}" ]]; then
  local_addr=(--local-addr="$LOCAL_ADDR")
fi
exec "$PYTHON" "$TORCHRUN" --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RUN_ID" \
  --max-restarts="${MAX_RESTARTS:-0}" "${local_addr[@]}" "${torchrun_extra[@]}" "$TRAIN" "$@"
