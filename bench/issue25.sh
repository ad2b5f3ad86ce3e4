#!/usr/bin/env bash
# Issue #25's GPU measurements (GPT-2 XL, fp8, the head's loss) on one GPU, part by part:
#
#   bash bench/issue25.sh head xl_bf16          # parts in the order given
#   bash bench/issue25.sh all                   # every part (longer than one 10-minute call)
#   bash bench/issue25.sh summary [DIR]         # the summary lines of the JSON files in DIR
#
# parts (wall time on one H100, compile included: measured in job 21:20 where it says so,
# else estimated; a warm machine's inductor cache shortens a repeated compile):
#   head       bench/head_loss.py: mgpu's fused loss, the compiled logits, Liger-Kernel and
#              cut cross-entropy, GPT-2-small and XL shapes                      65 s (21:27)
#   xl_bf16    bench/vs_plain.py gpt2_xl compiled: train.py against the plain loop,
#              experiment=gpt2_xl's batch (16 x 8 micro-steps), bf16; with --profile each
#              side's kernels by group over one step, and mgpu's train_step on the resident
#              batch timed as the plain loop's (one more compile)   277 s at 2 rounds (02:22,
#              the plain loop's kernels only)
#   xl_fp8     the same under trainer.precision=fp8 (torchao), both sides 497 s (21:27, unprof.)
#   loss_bf16  GPT-2 XL, 300 steps of the experiment's micro-batch (16 x 1024 byte tokens;
#              8 x 1024 in jobs 23:00 and 00:41) of Python's own sources, one micro-step a
#              step (--loss-accum), train.py's path, bf16               ~3-5 min at 8 x 1024
#   loss_fp8   the same in fp8 (same seed and data order)                            ~3-5 min
#   loss       loss_bf16 and loss_fp8 in one process (one file with the differences) ~7-9 min
#   small      bench/vs_plain.py gpt2_small compiled (the small model's targets)  61 s (21:36)
#   loss_probe the path under investigation (bench/README.md: the fp32 stream, compiled, one
#              micro-step, fused head) bisected in one process, 100 steps each at 8 x 1024:
#              the bf16 stream first, then the fp32 stream as a second run, then the fp32
#              stream compiled without CUDA graphs (trainer.compile_mode=default); a step-50
#              loss near 3.3 against 2.8 marks the bad path          ~7 min (3 runs of ~2)
#
# Wheels: every *.whl in $WHEELS (default .whl25: torchao, liger-kernel, cut-cross-entropy,
# and hydra-core, omegaconf, antlr4 where the machine lacks them) is installed into $SITE
# without the network. Results: JSON files and each part's log under $OUT/issue25 ($OUT is
# the lent machine's folder that comes back; bench/results without it), copied to
# bench/results as well. MGPU_COMMIT names the tree in them where .git is stale or absent.
# Extra arguments for bench/vs_plain.py's XL parts: VS_PLAIN_ARGS (for example
# VS_PLAIN_ARGS="--override model.activation_checkpointing=24" should a batch of 16 not fit);
# for the loss parts: LOSS_ARGS (for example "--override trainer.compile=false" saves each
# run's compile, ~2 min, at the cost of eager steps). LOSS_STEPS: 300.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl25}
SITE=${SITE:-/tmp/site}
RES=${OUT:-bench/results}/issue25
VS_PLAIN_ARGS=${VS_PLAIN_ARGS:-}
LOSS_ARGS=${LOSS_ARGS:-}
LOSS_STEPS=${LOSS_STEPS:-300}
mkdir -p "$RES"

summary() {
    python3 - "$1" <<'EOF'
import json, pathlib, sys

def f(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"

folder = pathlib.Path(sys.argv[1])  # the files of this script's parts only
for path in sorted([*folder.glob("head_loss-*.json"), *folder.glob("vs_plain-*.json")]):
    r = json.loads(path.read_text())
    print(f"== {path.name} ({r.get('device')}, torch {r.get('torch')}, {r.get('git_commit', '')})")
    for name, shape in r.get("shapes", {}).items():
        for side, s in shape["sides"].items():
            print(f"head {name:5s} {side:18s} {f(s.get('ms'), '7.3f')} ms "
                  f"peak {f(s.get('peak_step_mib'), '6.0f')} MiB (first {f(s.get('peak_first_mib'), '6.0f')}) "
                  f"|dloss| {f(s.get('loss_abs_diff'), '.1e')} grad rel h {f(s.get('grad_h_rel_err'), '.1e')} "
                  f"w {f(s.get('grad_w_rel_err'), '.1e')}")
        for side, why in shape["absent"].items():
            print(f"head {name:5s} {side:18s} absent: {why[:150]}")
    # head_loss.py's files before the libraries were added keep "rows" as a dict: no table here
    for row in r.get("rows", []) if isinstance(r.get("rows"), list) else []:
        p, m = row["plain"]["whole"], row["mgpu"]
        print(f"{row['model']} {row['mode']}: ratio {f(row['ratio'], '.3f')}x | plain "
              f"{f(p['ms_per_step'], '.1f')} ms {f(p.get('tokens_per_s'), '.0f')} tok/s "
              f"MFU {f(p.get('mfu_pct'), '.1f')}% peak {f(p.get('peak_mem_gib'), '.1f')} GiB | mgpu "
              f"{f(m['ms_per_step'], '.1f')} ms {f(m.get('tokens_per_s'), '.0f')} tok/s "
              f"MFU {f(m.get('mfu_pct'), '.1f')}% peak {f(m.get('peak_mem_gib'), '.1f')} GiB "
              f"| {row.get('settings', {})}")
        for side, table in row.get("kernels", {}).items():
            print(f"  {side}'s kernels: {f(table['gpu_work_ms'], '.1f')} ms of GPU work a step: "
                  + ", ".join(f"{g} {ms:.1f}" for g, ms in table.get("groups_ms", {}).items()))
    for key, s in r.get("fp8_over_bf16", {}).items():
        print(f"{key}: fp8/bf16 throughput plain {s['plain']:.3f}x mgpu {s['mgpu']:.3f}x")
    for prec, run in r.get("runs", {}).items():
        print(f"loss {prec}: step {run['steps']} train {f(run['train_loss_last'], '.4f')} "
              f"eval {f(run['eval_loss'], '.4f')} {f(run['tokens_per_s'], '.0f')} tok/s "
              f"MFU {f(run['mfu_pct'], '.1f')}% peak {f(run['peak_mem_gib'], '.1f')} GiB "
              f"({f(run['run_s'], '.0f')} s)")
    for key, diff in r.items():
        if "_vs_" in key:
            print(f"{key}: " + ", ".join(f"{k} {v:+.2%}" if v is not None else f"{k} -"
                                         for k, v in diff.items()))
EOF
}

if [ "${1:-}" = summary ]; then
    summary "${2:-$RES}"
    exit 0
fi

for dir in "$WHEELS" ${EXTRA_WHEELS:-}; do  # EXTRA_WHEELS=.whl25/alt: torchao 0.17.0 instead
    if ls "$dir"/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --upgrade --no-index --no-deps --target "$SITE" "$dir"/*.whl 2>&1 |
            grep -v -i "warning" | tail -3
    fi
done
export PYTHONPATH=$SITE:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MGPU_COMMIT=${MGPU_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
python3 - <<'EOF'
import importlib.metadata as md
import torch
found = []
for pkg in ("torch", "triton", "torchao", "liger-kernel", "cut-cross-entropy", "hydra-core"):
    try:
        found.append(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        found.append(f"{pkg} absent")
print(", ".join(found), "| cuda", torch.version.cuda)
EOF

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(head)
[ "${parts[0]}" = all ] && parts=(head xl_bf16 xl_fp8 loss small)
t0=$(date +%s)
for part in "${parts[@]}"; do
    log=$RES/$part.log
    case $part in
        head) cmd=(python3 bench/head_loss.py) ;;
        xl_bf16) cmd=(python3 bench/vs_plain.py --models gpt2_xl --modes compiled --profile) ;;
        xl_fp8) cmd=(python3 bench/vs_plain.py --models gpt2_xl_fp8 --modes compiled --profile) ;;
        loss) cmd=(python3 bench/vs_plain.py --loss-steps "$LOSS_STEPS") ;;
        loss_bf16) cmd=(python3 bench/vs_plain.py --loss-steps "$LOSS_STEPS" --loss-precisions bf16) ;;
        loss_fp8) cmd=(python3 bench/vs_plain.py --loss-steps "$LOSS_STEPS" --loss-precisions fp8) ;;
        small) cmd=(python3 bench/vs_plain.py --models gpt2_small --modes compiled) ;;
        loss_probe) cmd=(python3 bench/vs_plain.py --loss-steps 100 --override data.batch_size=8
                         --loss-precisions stream:trainer.precision=bf16,model.residual=autocast
                         fp32:trainer.precision=bf16,model.residual=fp32
                         fp32_nographs:trainer.precision=bf16,model.residual=fp32,trainer.compile_mode=default) ;;
        *) echo "unknown part $part (head xl_bf16 xl_fp8 loss loss_bf16 loss_fp8 small loss_probe all summary)"; exit 2 ;;
    esac
    case $part in
        xl_*) cmd+=($VS_PLAIN_ARGS) ;;
        loss*) cmd+=($LOSS_ARGS) ;;
    esac
    started=$(date +%s)
    echo "== $part: ${cmd[*]}"
    "${cmd[@]}" --out "$RES" > "$log" 2>&1
    rc=$?
    echo "== $part rc=$rc $(( $(date +%s) - started )) s (total $(( $(date +%s) - t0 )) s), log $log"
    if [ $rc -ne 0 ]; then
        grep -v -i "warn" "$log" | grep -i -m5 -B2 "error\|Traceback\|out of memory" | cut -c1-300
        tail -5 "$log" | cut -c1-300
    fi
done
cp "$RES"/*.json bench/results/ 2>/dev/null
summary "$RES"
