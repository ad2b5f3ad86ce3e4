"""The compiled training step's loss and gradients against the same model's eager forward, on the
same weights and batch, step by step: does the compiled step compute what the model says?

    python bench/loss_probe.py                                  # GPT-2 XL (experiment=gpt2_xl)
    python bench/loss_probe.py --runs fp32:model.residual=fp32 stream:model.residual=autocast
    python bench/loss_probe.py --quick                          # tiny shapes on the CPU

Each run builds mgpu's Trainer as train.py does (build_run, the experiment's config with the
run's overrides, one micro-step a step) and trains it on Python's own sources as byte tokens,
batches drawn in the same order for every run. Every --every steps, before the step, on that
step's batch and the weights it starts from:
- eager_fused: the model's own forward(inputs, targets) without torch.compile (GPT's head loss
  as configured), under the step's autocast;
- eager_logits: the cross-entropy of the eager forward's logits (the head through the logits);
- compiled: the loss of the compiled model's forward with targets, then its backward (the
  training graph Trainer.train_step runs), and the eager forward's backward: each parameter's
  gradient error, |compiled - eager| / |eager|, worst first.
Then Trainer.train_step takes the step (its loss: train_loss). A compiled step that computes
another function than the eager model shows as compiled far from eager_fused while eager_fused
and eager_logits agree.

Writes bench/results/loss_probe-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch._inductor.config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engines import versions  # noqa: E402
from bench.vs_plain import QUICK, loss_run, mgpu_trainer, python_text  # noqa: E402
from mgpu.comm.engine import unwrap  # noqa: E402
from mgpu.models.loss import cross_entropy  # noqa: E402
from mgpu.runtime.dist import distributed  # noqa: E402
from mgpu.train.numerics import autocast_dtype  # noqa: E402

BASE = ["trainer.compile=true", "trainer.grad_accum_steps=1"]


def batches(tokens: np.ndarray, batch: int, seq: int, steps: int, seed: int):
    """`steps` (inputs, targets) pairs of random windows of `tokens`, the same for every run."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
        x = np.stack([tokens[s : s + seq] for s in starts]).astype(np.int64)
        y = np.stack([tokens[s + 1 : s + seq + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x), torch.from_numpy(y)


def grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    out = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
    for p in params:
        p.grad = None
    return out


def probe(trainer, x: torch.Tensor, y: torch.Tensor, names: list[str]) -> dict:
    """The losses and gradient errors of one batch at the current weights (see the docstring)."""
    model, module = trainer.model, unwrap(trainer.model)
    params = [p for _, p in module.named_parameters()]
    for p in params:
        p.grad = None
    dtype = autocast_dtype(trainer.cfg.precision, x.device)  # the step's own autocast
    autocast = torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None)
    with autocast:
        compiled = model(x, y)  # the training graph: train mode, with targets, grad enabled
    compiled.backward()
    compiled_grads = grads(params)
    with autocast:
        eager = module.forward(x, y)  # Module.compile patches __call__; forward stays eager
    eager.backward()
    eager_grads = grads(params)
    with torch.no_grad(), autocast:
        logits = cross_entropy(module.forward(x), y)
    errors = []
    for name, c, e in zip(names, compiled_grads, eager_grads, strict=True):
        if c is None or e is None:
            errors.append((name, None if c is None and e is None else float("inf")))
            continue
        errors.append((name, float((c - e).norm() / e.norm().clamp_min(1e-30))))
    errors.sort(key=lambda t: -(t[1] if t[1] is not None else -1))
    return {
        "compiled": float(compiled.detach()),
        "eager_fused": float(eager.detach()),
        "eager_logits": float(logits),
        "grad_rel_err_worst": errors[:6],
        "grad_rel_err_median": float(np.median([e for _, e in errors if e is not None])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["fp32:model.residual=fp32", "stream:model.residual=autocast"],
        help="LABEL:KEY=VALUE,... overrides on --base, one micro-step a step",
    )
    parser.add_argument(
        "--base",
        nargs="+",
        default=["experiment=gpt2_xl"],
        help="the model's overrides (e.g. model=gpt2_small trainer.precision=bf16)",
    )
    parser.add_argument("--override", nargs="*", default=[], help="overrides for every run")
    parser.add_argument(
        "--inductor",
        nargs="*",
        default=[],
        help="torch._inductor.config settings for every run, KEY=VALUE (VALUE a Python literal)",
    )
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--seed", type=int, default=1, help="the batches' order (the weights: trainer.seed)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    for setting in args.inductor:
        key, _, value = setting.partition("=")
        *parents, last = key.split(".")
        node = torch._inductor.config
        for name in parents:
            node = getattr(node, name)
        setattr(node, last, ast.literal_eval(value))
    result: dict = {"runs": {}}
    with distributed("auto", timeout_s=600) as rt, tempfile.TemporaryDirectory() as tmp:
        cuda = rt.device.type == "cuda"
        meta = versions() if cuda else {"device": "cpu", "torch": torch.__version__}
        text = Path(tmp) / "python.txt"
        python_text(text, limit=2**20 if args.quick else None)
        tokens = np.frombuffer(text.read_bytes(), dtype=np.uint8)
        seq = 64 if args.quick else 1024
        # --quick: the fused head's torch path, and aot_eager (no C++ toolchain needed)
        quick = [*QUICK["gpt2_small"], "model.head_loss=fused", "trainer.compile_backend=aot_eager"]
        quick = quick if args.quick else []
        for entry in args.runs:
            torch.compiler.reset()
            label, setting = loss_run(entry)
            overrides = [
                *args.base,
                *BASE,
                "data=ngram",
                "data.vocab_size=256",  # byte tokens, as the loss runs of vs_plain.py train
                f"data.batch_size={args.batch}",
                *quick,
                *setting,
                *args.override,
            ]
            trainer = mgpu_trainer(overrides, rt, tmp)
            names = [n for n, _ in unwrap(trainer.model).named_parameters()]
            steps = []
            started = time.perf_counter()
            for step, (x, y) in enumerate(batches(tokens, args.batch, seq, args.steps, args.seed)):
                x, y = x.to(rt.device), y.to(rt.device)
                row: dict = {"step": step}
                if step % args.every == 0 or step == args.steps - 1:
                    row.update(probe(trainer, x, y, names))
                loss, _ = trainer.train_step(iter([(x, y)]), step)
                row["train_loss"] = float(loss)  # sync point: a probe, not a training run
                steps.append(row)
                if "compiled" in row:
                    print(json.dumps({"run": label, **row}), flush=True)
            result["runs"][label] = {
                "overrides": overrides,
                "steps": steps,
                "run_s": time.perf_counter() - started,
            }
            del trainer
            if cuda:
                torch.cuda.empty_cache()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path(args.out) / f"loss_probe-{meta['device'].replace(' ', '_')}-{stamp}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        body = {**meta, "command": " ".join(["python", *sys.argv]), "args": vars(args)}
        out.write_text(json.dumps({**body, **result}, indent=1))
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
