# shellcheck shell=bash
# Shared by the launch scripts; sourced, not run. Expects MGPU_ROOT (the checkout that holds
# train.py) to be set by the script that sources it.

PYTHON=${PYTHON:-python3}
TRAIN="$MGPU_ROOT/train.py"
# torchrun, ending a failed launch with the failed worker's one line and its exit code rather
# than torchrun's ~40-line report and exit code 1 (launch/torchrun.py says what it changes).
TORCHRUN="$MGPU_ROOT/launch/torchrun.py"

# The workers' store not shared with torchrun's agent: rank 0 hosts a new one for each restart
# (torchrun --max-restarts). mgpu meets under per-restart keys in a shared store, but on several
# nodes torchrun's restart counts can differ between them, and such a restart would stop
# (mgpu.runtime.launch.restart_hazard). Rank 0's store is also the one mgpu binds to loopback in
# single_node.sh's runs; a shared store would be one more that the agent binds on every interface.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

# The script's own name; slurm.sbatch sets LAUNCH_SCRIPT, since SLURM runs a copy of it under
# another name (slurm_script).
die() {
  echo "${LAUNCH_SCRIPT:-$(basename "$0")}: $*" >&2
  exit 2
}

# All visible GPUs, or 2 CPU processes on a machine without any.
default_nproc() {
  "$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)'
}

# A run id becomes a directory name (outputs/RUN_ID) and a prefix of torchrun's temporary log
# directory, so it must be one plain path component.
check_run_id() {
  [[ $1 =~ ^[A-Za-z0-9_-][A-Za-z0-9._-]*$ ]] ||
    die "RUN_ID='$1': use letters, digits, '.', '_' and '-' only (it names outputs/RUN_ID)"
}

# A count from the environment (NPROC, MAX_RESTARTS, ...): a whole number of at least MIN,
# said in one line here rather than as torchrun's traceback (an AssertionError for NPROC=0).
check_count() { # NAME VALUE MIN
  [[ $2 =~ ^[0-9]+$ ]] && ((10#$2 >= $3)) || die "$1='$2': give a whole number of at least $3"
}

# NNODES: a count of nodes, or MIN:MAX for an elastic range (torchrun's AssertionError for a
# range whose MIN is above its MAX).
check_nodes() {
  [[ $1 =~ ^[1-9][0-9]{0,5}(:[1-9][0-9]{0,5})?$ ]] ||
    die "NNODES='$1': give a number of nodes (NNODES=2) or a range (NNODES=2:4)"
  [[ $1 != *:* ]] || ((${1%:*} <= ${1#*:})) ||
    die "NNODES='$1': a range is MIN:MAX with MIN <= MAX (NNODES=${1#*:}:${1%:*})"
}

# A TCP port that a store can listen on and the other nodes reach: 1-65535 (0 would be a free
# port of the host's choosing, which no other node could know).
valid_port() {
  [[ $1 =~ ^[0-9]{1,5}$ ]] && ((10#$1 >= 1 && 10#$1 <= 65535))
}

# RDZV_ENDPOINT: HOST:PORT, the host a name or an IPv4 address (as torchrun reads it) or an IPv6
# one in brackets; said here rather than as torchrun's ValueError traceback.
check_endpoint() {
  [[ $1 =~ ^([A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):([^:]*)$ ]] && valid_port "${BASH_REMATCH[2]}" ||
    die "RDZV_ENDPOINT='$1': give HOST:PORT of one node, the port a number from 1 to 65535" \
      "(RDZV_ENDPOINT=node0:29400)"
}

# TORCHRUN_ARGS holds extra torchrun flags, split on spaces into the array `torchrun_extra`
# (e.g. TORCHRUN_ARGS="--log-dir=logs --rdzv-conf=join_timeout=900").
# shellcheck disable=SC2034  # used by the scripts that source this file
read -r -a torchrun_extra <<<"${TORCHRUN_ARGS:-}"
[[ -f $TRAIN ]] || die "no train.py in $MGPU_ROOT; set MGPU_ROOT to the mgpu checkout"
