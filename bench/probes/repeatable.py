"""Whether two identical `train.py` runs end bit for bit alike: the question behind resuming on
GPUs as an uninterrupted run would have gone (docs/checkpoints.md, Resume). Each case's settings
run twice through torchrun; their final weights and per-step losses are compared.

    python bench/probes/repeatable.py --gpus 2
    python bench/probes/repeatable.py --gpus 1 --cases replayed deterministic
    python bench/probes/repeatable.py --cases replayed deterministic --model model=gpt2_small
    python bench/probes/repeatable.py --quick       # one CPU process: checks the script

The model is tests/test_resume.py's GPT (one narrow block, 20 steps, the math attention): what
makes a GPU run repeat or not is which kernels run and how, not the model's size (`--model`
names another, e.g. to time what deterministic kernels cost a real step: each run's median
step_ms is recorded). Cases:
replayed (the defaults: one GPU's step, or several GPUs' step with their reductions, replayed as
CUDA graphs), eager (`trainer.cuda_graphs=false`) and deterministic (`trainer.deterministic=true`).
Answer on H200s (bench/README.md): replayed runs differ by ~3e-5, eager and deterministic ones
repeat. Writes bench/results/repeatable-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))  # bench/engines.py imports its helpers from beside it

from bench.engines import versions  # noqa: E402
from mgpu.ckpt.checkpoint import step_dir  # noqa: E402

STEPS = 20
GPT = ["model.vocab_size=256", "model.n_layer=1", "model.n_head=2", "model.n_embd=32"]
MODEL = [*GPT, "model.attention=math"]  # --model replaces these
BASE = [
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    f"ckpt.every={STEPS}",
    "data.num_workers=0",
]
CASES = {
    "replayed": [],
    "eager": ["trainer.cuda_graphs=false"],
    "deterministic": ["trainer.deterministic=true", "trainer.cudnn_benchmark=false"],
}


def train(run_dir: Path, model: list[str], overrides: list[str], gpus: int, steps: int) -> float:
    """One run; its seconds. A failed run stops the probe with its output's tail."""
    start = time.time()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={gpus}", str(ROOT / "train.py"), *model, *BASE, *overrides]
    command += [f"trainer.max_steps={steps}", f"ckpt.every={steps}", f"hydra.run.dir={run_dir}"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(command, cwd=run_dir.parent, env=env, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stdout + proc.stderr)[-3000:]
        sys.exit(f"{run_dir.name} failed (exit {proc.returncode}):\n{tail}")
    return time.time() - start


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def step_ms(run_dir: Path) -> float:
    """The run's median logged step time, its first two steps (start-up) left out."""
    times = scalars(run_dir, "time/step_ms")
    return statistics.median([v for s, v in times.items() if s > 2] or times.values())


def compare(a: Path, b: Path, steps: int) -> dict:
    """Equal weights bit for bit, the largest difference, and the first step whose loss differs."""
    x, y = (torch.load(step_dir(d / "checkpoints", steps) / "state.pt") for d in (a, b))
    pairs = [(x["model"][k].double(), v.double()) for k, v in y["model"].items()]
    la, lb = scalars(a, "train/loss"), scalars(b, "train/loss")
    return {
        "equal": all(torch.equal(p, q) for p, q in pairs),
        "max_difference": max((p - q).abs().max().item() for p, q in pairs),
        "first_differing_loss_step": next((s for s in sorted(la) if la[s] != lb.get(s)), None),
        "step_ms": [step_ms(a), step_ms(b)],  # what the case costs a step
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1, help="processes per run (one per GPU)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument(
        "--model",
        nargs="+",
        default=MODEL,
        help="the model's overrides, e.g. experiment=gpt2_small (default: the test GPT)",
    )
    parser.add_argument("--quick", action="store_true", help="one CPU process, 3 steps")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    steps = 3 if args.quick else STEPS
    gpus = 1 if args.quick else args.gpus
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            runs = [Path(tmp) / f"{case}-{i}" for i in (0, 1)]
            seconds = [train(d, args.model, CASES[case], gpus, steps) for d in runs]
            rows[case] = {"overrides": CASES[case], "seconds": seconds, **compare(*runs, steps)}
            print(case, json.dumps(rows[case]), flush=True)
    meta = {"device": "cpu", "torch": torch.__version__} if args.quick else versions()
    record = {**meta, "gpus": gpus, "steps": steps, "model": args.model, "base": BASE}
    record["cases"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    name = meta["device"].replace(" ", "_")
    path = args.out / f"repeatable-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
