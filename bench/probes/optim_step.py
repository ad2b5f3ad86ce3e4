"""The optimizer's share of a training step on one GPU: global-norm clipping and the AdamW update
over GPT-2-small's parameters, as mgpu runs them today against a torch.compile'd update.

    python bench/probes/optim_step.py [--model gpt2_small]
    python bench/probes/optim_step.py --quick       # a tiny GPT on the CPU: checks the script

fused: what mgpu's Trainer does on one GPU (its optimizer from mgpu.optim.optimizer.build_optimizer,
the model's optim.* and trainer.grad_clip): the gradients' global norm (one multi-tensor norm), the
clip factor as a device scalar, then torch's fused AdamW, which divides each gradient by that
factor as it reads it and skips the update on a device flag (mgpu.train.guard). Left out on both
sides: the guard's check of the loss and the norm, a few one-value kernels a step.
compiled: the same arithmetic (norm, clip factor, the skip flag, AdamW with decoupled weight
decay and bias correction) written as one function over the parameter list and compiled by
inductor, which fuses each parameter's update into one kernel.
triton (GPU only): the norm and clip factor as mgpu computes them, then one hand-written Triton
kernel per parameter tensor that reads the parameter, gradient and both moments once and writes
them once, with the clip factor and the skip flag read from the device: the least traffic an
update can move, to weigh against fused AdamW (the step count is kept on the host here, which a
real one could not do with a device skip flag).
All sides get the same gradients each step; after the timed steps their parameters are compared
with the fused side's.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))  # bench/engines.py imports its helpers from beside it

from bench.engines import versions  # noqa: E402
from bench.head_loss import events_ms as cuda_events_ms  # noqa: E402
from bench.vs_plain import MODELS, QUICK, compose_config  # noqa: E402
from mgpu.models import build_model  # noqa: E402
from mgpu.optim.optimizer import build_optimizer  # noqa: E402
from mgpu.run.config import Config, to_config  # noqa: E402
from mgpu.train.update import CLIP_EPS  # noqa: E402


def fused_side(model: torch.nn.Module, cfg: Config):
    params = list(model.parameters())
    opt = build_optimizer(cfg.optim, model, params[0].device)
    clip = cfg.trainer.grad_clip

    def step() -> None:
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        # mgpu.train.guard's hand-over to the fused kernel: the clip factor and the skip flag
        opt.grad_scale = (norm + CLIP_EPS).div(clip).clamp(min=1.0)
        opt.found_inf = (~norm.isfinite()).float()
        opt.step()
        del opt.grad_scale, opt.found_inf

    return step


def compiled_side(model: torch.nn.Module, cfg: Config):
    params = list(model.parameters())
    o, clip = cfg.optim, cfg.trainer.grad_clip
    # as mgpu.optim.optimizer's groups
    decays = [o.weight_decay if p.dim() >= 2 else 0.0 for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    count = torch.zeros((), device=params[0].device)
    lr = torch.tensor(o.lr, device=params[0].device)
    (b1, b2), eps = o.betas, o.eps

    @torch.compile(backend=cfg.trainer.compile_backend)
    def update(params, grads, exp_avgs, exp_avg_sqs, count, lr):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        scale = ((norm + CLIP_EPS) / clip).clamp(min=1.0)
        keep = norm.isfinite()
        t = count + keep.float()
        step_size = lr / (1 - b1**t)
        root_c2 = (1 - b2**t).sqrt()
        for p, g, m, v, wd in zip(params, grads, exp_avgs, exp_avg_sqs, decays, strict=True):
            g = g / scale
            m_new = m + (1 - b1) * (g - m)
            v_new = v * b2 + (1 - b2) * g * g
            p_new = p * (1 - lr * wd) - step_size * m_new / (v_new.sqrt() / root_c2 + eps)
            p.copy_(torch.where(keep, p_new, p))
            m.copy_(torch.where(keep, m_new, m))
            v.copy_(torch.where(keep, v_new, v))
        count.copy_(t)

    def step() -> None:
        with torch.no_grad():
            update(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, count, lr)

    return step


TRITON_BLOCK, TRITON_WARPS = 4096, 8


def _adamw_kernel():
    """Built on first use: triton ships with torch's CUDA builds only."""
    import triton
    import triton.language as tl

    @triton.jit
    def adamw(p_ptr, g_ptr, m_ptr, v_ptr, n, scale_ptr, skip_ptr, lr, wd, b1, b2, eps,
              step_size, root_c2, BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        write = mask & (tl.load(skip_ptr) == 0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0) / tl.load(scale_ptr)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = m + (1 - b1) * (g - m)
        v = v * b2 + (1 - b2) * g * g
        p = p * (1 - lr * wd) - step_size * m / (tl.sqrt(v) / root_c2 + eps)
        tl.store(p_ptr + offs, p, mask=write)
        tl.store(m_ptr + offs, m, mask=write)
        tl.store(v_ptr + offs, v, mask=write)

    return triton.cdiv, adamw


def triton_side(model: torch.nn.Module, cfg: Config):
    cdiv, kernel = _adamw_kernel()
    params = list(model.parameters())
    o, clip = cfg.optim, cfg.trainer.grad_clip
    # as mgpu.optim.optimizer's groups
    decays = [o.weight_decay if p.dim() >= 2 else 0.0 for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    (b1, b2), eps = o.betas, o.eps
    count = [0]

    def step() -> None:
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        scale = (norm + CLIP_EPS).div(clip).clamp(min=1.0)
        skip = (~norm.isfinite()).to(torch.int32)
        count[0] += 1
        step_size, root_c2 = o.lr / (1 - b1 ** count[0]), (1 - b2 ** count[0]) ** 0.5
        for p, g, m, v, wd in zip(params, grads, exp_avgs, exp_avg_sqs, decays, strict=True):
            n = p.numel()
            kernel[(cdiv(n, TRITON_BLOCK),)](
                p, g, m, v, n, scale, skip, o.lr, wd, b1, b2, eps, step_size, root_c2,
                BLOCK=TRITON_BLOCK, num_warps=TRITON_WARPS,
            )  # fmt: skip

    return step


def events_ms(fn, steps: int, cuda: bool) -> float:
    """ms a call between two CUDA events (host time on CPU)."""
    if not cuda:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t) * 1e3 / steps
    return cuda_events_ms(fn, steps)


def kernel_ms(fn, steps: int) -> float:
    """The GPU's kernel time a call (torch.profiler), without the gaps: a side launched from
    Python kernel by kernel is bound by the host here, which a GPU-bound training step hides."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_small", choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT on the CPU")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    overrides = MODELS[args.model]  # vs_plain.py's run of that model
    if args.quick:
        args.steps, args.rounds = 3, 2
        overrides = [*overrides, *QUICK[args.model], "trainer.compile_backend=aot_eager"]
    device = torch.device("cpu" if args.quick else "cuda")
    cfg = to_config(compose_config(overrides))
    sides = {}
    makers = [("fused", fused_side), ("compiled", compiled_side)]
    if device.type == "cuda":
        makers.append(("triton", triton_side))
    for name, make in makers:
        torch.manual_seed(0)  # the same parameters and gradients on both sides
        model = build_model(cfg.model).to(device)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        sides[name] = (params, make(model, cfg))
    start = time.perf_counter()
    for _params, step in sides.values():
        events_ms(step, 3, device.type == "cuda")  # compile
    warmup_s = time.perf_counter() - start
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, (_params, step) in sides.items():
            ms[name].append(events_ms(step, args.steps, device.type == "cuda"))
    # Every side took the same gradients the same number of times: the parameters must agree.
    fused = sides["fused"][0]
    differs = {
        name: max((a - b).abs().max().item() for a, b in zip(fused, params, strict=True))
        for name, (params, _step) in sides.items()
        if name != "fused"
    }
    worst = max(differs.values())
    n = sum(p.numel() for p in fused)
    moved = n * 4 * (1 + 7)  # the norm reads g; the update reads p, g, m, v and writes p, m, v
    rows = {
        name: {"ms": statistics.median(t), "rounds": t, "gb_s": moved / statistics.median(t) / 1e6}
        for name, t in ms.items()
    }
    if device.type == "cuda":
        for name, (_params, step) in sides.items():
            rows[name]["kernel_ms"] = kernel_ms(step, args.steps)
    for name, row in rows.items():
        kernels = f"  kernels {row['kernel_ms']:7.3f} ms" if "kernel_ms" in row else ""
        print(f"{name:10s} {row['ms']:7.3f} ms  {row['gb_s']:7.1f} GB/s{kernels}")
    print(f"parameters {n}, largest difference from fused {differs}, warm-up {warmup_s:.0f} s")
    meta = {"device": "cpu", "torch": torch.__version__} if args.quick else versions()
    device = meta["device"].replace(" ", "_")
    path = Path(args.out) / f"optim_step-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        **meta,
        "command": " ".join(["python", *sys.argv]),
        "args": vars(args),
        "rows": rows,
        "max_abs_diff": worst,
        "max_abs_diff_from_fused": differs,
        "warmup_s": warmup_s,
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
