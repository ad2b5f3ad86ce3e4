#!/usr/bin/env bash
# The scaling suite of one host, in one go: the engines benchmark on 4 GPUs and on every GPU
# (over NVLink, then with NCCL_P2P_DISABLE=1 as a slow-link stand-in), and the input pipeline
# fed on every GPU at once. Each part writes its own file to bench/results/.
#
#   bench/scaling.sh              # 4 GPUs and all GPUs
#   bench/scaling.sh 8            # only these counts
#
# Each part has its own time limit (PART_TIMEOUT_S, default 240 s) so that one stuck part cannot
# take the others with it; the exit status is the number of parts that failed.
set -u
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,10s/^# \{0,1\}//p' "$0"
    exit 0
fi
cd "$(dirname "$0")/.."
all=$(python3 -c 'import torch; print(torch.cuda.device_count())')
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(4 "$all")
limit=${PART_TIMEOUT_S:-240}
engines=(none torch_ddp torch_ddp_tuned torch_ddp_tuned_own_buffers mgpu mgpu_own_buffers
         mgpu_cap50 mgpu_ctas8)
common=(--rounds 4 --steps 15 --warmup 5)
failed=0

part() {  # part NAME COMMAND...: run one part under its limit, keep going whatever it does
    echo "=== $1: ${*:2}"
    timeout --kill-after=20 "$limit" "${@:2}" || { echo "=== $1 failed: $?"; failed=$((failed + 1)); }
}

for n in "${counts[@]}"; do
    visible=$(seq -s, 0 $((n - 1)))
    part "engines x$n" env CUDA_VISIBLE_DEVICES="$visible" torchrun --nproc_per_node="$n" \
        bench/engines.py --tag "nvlink-x$n" --engines "${engines[@]}" "${common[@]}"
done
part "engines x$all slow link" env NCCL_P2P_DISABLE=1 torchrun --nproc_per_node="$all" \
    bench/engines.py --tag "slowlink-x$all" "${common[@]}" \
    --engines none torch_ddp_tuned torch_ddp_bf16 mgpu mgpu_bf16
part "input pipeline x$all" torchrun --nproc_per_node="$all" bench/input_pipeline.py \
    --variants ade --steps 30 --repeats 3
exit "$failed"
