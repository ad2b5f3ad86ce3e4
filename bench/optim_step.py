"""The optimizer's share of a training step on one GPU: global-norm clipping and the AdamW update
over GPT-2-small's parameters, as mgpu runs them today against a torch.compile'd update.

    python bench/optim_step.py [--model gpt2_small]

fused: what mgpu's Trainer does on one GPU: the gradients' global norm (one multi-tensor norm),
the clip factor as a device scalar, then torch's fused AdamW, which divides each gradient by
that factor as it reads it and skips the update on a device flag (mgpu.guard).
compiled: the same arithmetic (norm, clip factor, the skip flag, AdamW with decoupled weight
decay and bias correction) written as one function over the parameter list and compiled by
inductor, which fuses each parameter's update into one kernel.
Both get the same gradients each step; after the timed steps their parameters are compared.
Writes bench/results/optim_step-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engines import versions  # noqa: E402
from bench.vs_plain import compose_config  # noqa: E402
from mgpu.config import to_config  # noqa: E402
from mgpu.models import build_model  # noqa: E402
from mgpu.optim import param_groups  # noqa: E402

CLIP, LR, BETAS, EPS, WD = 1.0, 6e-4, (0.9, 0.95), 1e-8, 0.1


def fused_side(params: list[torch.Tensor]):
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)

    def step() -> None:
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        opt.grad_scale = (norm + 1e-6).div(CLIP).clamp(min=1.0)
        opt.found_inf = (~norm.isfinite()).float()
        opt.step()
        del opt.grad_scale, opt.found_inf

    return step


def compiled_side(params: list[torch.Tensor]):
    decays = [WD if p.dim() >= 2 else 0.0 for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    count = torch.zeros((), device=params[0].device)
    lr = torch.tensor(LR, device=params[0].device)
    b1, b2 = BETAS

    @torch.compile
    def update(params, grads, exp_avgs, exp_avg_sqs, count, lr):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        scale = ((norm + 1e-6) / CLIP).clamp(min=1.0)
        keep = norm.isfinite()
        t = count + keep.float()
        step_size = lr / (1 - b1**t)
        root_c2 = (1 - b2**t).sqrt()
        for p, g, m, v, wd in zip(params, grads, exp_avgs, exp_avg_sqs, decays, strict=True):
            g = g / scale
            m_new = m + (1 - b1) * (g - m)
            v_new = v * b2 + (1 - b2) * g * g
            p_new = p * (1 - lr * wd) - step_size * m_new / (v_new.sqrt() / root_c2 + EPS)
            p.copy_(torch.where(keep, p_new, p))
            m.copy_(torch.where(keep, m_new, m))
            v.copy_(torch.where(keep, v_new, v))
        count.copy_(t)

    def step() -> None:
        with torch.no_grad():
            update(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, count, lr)

    return step


def events_ms(fn, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    cuda = torch.device("cuda")
    cfg = to_config(compose_config([f"model={args.model}", "data.vocab_size=50304"]))
    torch.manual_seed(0)
    model = build_model(cfg.model).to(cuda)
    groups = param_groups(model, WD)
    base = [p.detach() for g in groups for p in g["params"]]
    grads = [torch.randn_like(p) * 1e-3 for p in base]
    sides = {}
    for name, make in (("fused", fused_side), ("compiled", compiled_side)):
        params = [p.clone().requires_grad_() for p in base]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        sides[name] = (params, make(params))
    start = time.perf_counter()
    for _params, step in sides.values():
        events_ms(step, 3)  # compile
    warmup_s = time.perf_counter() - start
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, (_params, step) in sides.items():
            ms[name].append(events_ms(step, args.steps))
    # Every side took the same gradients the same number of times: the parameters must agree.
    fused, compiled = sides["fused"][0], sides["compiled"][0]
    worst = max((a - b).abs().max().item() for a, b in zip(fused, compiled, strict=True))
    n = sum(p.numel() for p in base)
    moved = n * 4 * (1 + 7)  # the norm reads g; the update reads p, g, m, v and writes p, m, v
    rows = {
        name: {"ms": statistics.median(t), "rounds": t, "gb_s": moved / statistics.median(t) / 1e6}
        for name, t in ms.items()
    }
    for name, row in rows.items():
        print(f"{name:10s} {row['ms']:7.3f} ms  {row['gb_s']:7.1f} GB/s")
    print(f"parameters {n}, largest difference between sides {worst:.3g}, warm-up {warmup_s:.0f} s")
    meta = versions()
    device = meta["device"].replace(" ", "_")
    path = Path(args.out) / f"optim_step-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        **meta,
        "command": " ".join(["python", *sys.argv]),
        "args": vars(args),
        "rows": rows,
        "max_abs_diff": worst,
        "warmup_s": warmup_s,
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
