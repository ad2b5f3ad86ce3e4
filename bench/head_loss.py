"""GPT's head and loss alone, forward and backward, on one GPU: mgpu's fused head loss
(mgpu.models.fused_loss) against the plain product and cross-entropy that torch.compile makes and
against the maintained libraries that fuse the two, where they are installed: Liger-Kernel's
fused linear cross-entropy (PyPI liger-kernel) and Apple's cut cross-entropy (PyPI
cut-cross-entropy). A library that does not import is reported as absent, with the reason.

    python bench/head_loss.py                 # GPT-2-small (16x1024 x 768), XL (8x1024 x 1600)
    python bench/head_loss.py --shapes small --sides fused liger
    python bench/head_loss.py --sweep         # the loss kernel alone, per launch shape
    python bench/head_loss.py --quick         # tiny shapes on the CPU: checks the script

Each side takes an fp32 input h [N, d] and an fp32 weight [V, d] (the tied embedding, as in
training) under bf16 autocast, and returns the mean loss; the libraries' sides cast h and the
weight to bf16 first, as autocast casts them for F.linear, so every side's gradients reach the
fp32 tensors through the same casts. Per side: the loss and both gradients against an fp32
reference without TF32 (max abs difference), peak memory above what was allocated before
(torch.cuda.max_memory_allocated: over the first calls, compile and CUDA-graph capture
included, and over one later step), and the median of interleaved rounds of CUDA-event-timed
steps. Writes bench/results/head_loss-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engines import versions  # noqa: E402
from bench.vs_plain import Timer  # noqa: E402
from mgpu.models.fused_loss import LAUNCH_SHAPES, linear_cross_entropy, loss_grad_cuda  # noqa: E402

# (rows = sequences x positions, width, vocabulary): GPT-2-small at vs_plain's batch of 16, and
# XL at experiment=gpt2_xl's micro-batch of 8; the vocabulary padded to 50304 as mgpu pads it.
SHAPES = {"small": (16 * 1024, 768, 50304), "xl": (8 * 1024, 1600, 50304)}
QUICK_SHAPES = {"small": (64, 32, 256), "xl": (32, 48, 320)}
LIBRARIES = {"liger": "liger-kernel", "cce": "cut-cross-entropy"}
SIDES = [
    "logits_compiled",
    "logits_cudagraphs",
    "fused",
    "fused_cudagraphs",
    "liger",
    "cce",
    "cce_exact",
]
QUICK_SIDES = ["logits_eager", "fused", "liger", "cce"]


def logits_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), y)


def bf16_inputs(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h and the weight as autocast hands them to a matrix multiply (the libraries' kernels take
    them so); the casts stay outside the libraries' autograd functions, so fp32 gradients
    reach the fp32 tensors through them, as in training."""
    return h.to(torch.bfloat16), w.to(torch.bfloat16)


def library_side(name: str):
    """The library side `name` as fn(h, w, y) -> mean loss, or the reason it cannot run here."""
    try:
        if name == "liger":
            from liger_kernel.transformers.fused_linear_cross_entropy import (
                LigerFusedLinearCrossEntropyLoss,
            )

            liger = LigerFusedLinearCrossEntropyLoss()

            def fn(h, w, y):
                h, w = bf16_inputs(h, w)
                with torch.autocast(h.device.type, enabled=False):
                    return liger(w, h, y)

            return fn
        from cut_cross_entropy import linear_cross_entropy as cce

        # cce: its default, which skips the gradient's entries below bf16's resolution
        # (filter_eps="high"); cce_exact: every entry.
        eps = {"filter_eps": None} if name == "cce_exact" else {}

        def fn(h, w, y):
            h, w = bf16_inputs(h, w)
            with torch.autocast(h.device.type, enabled=False):
                return cce(h, w, y, **eps)

        return fn
    except Exception as err:  # noqa: BLE001 - an absent or broken library is reported, not fatal
        return f"{type(err).__name__}: {err}"[:300]


def build_side(name: str, device: torch.device, backend: str):
    """fn(h, w, y) -> mean loss for side `name`, or a string: why it is absent."""
    if name == "logits_eager":
        return logits_loss
    if name == "logits_compiled":
        return torch.compile(logits_loss, backend=backend)
    if name == "logits_cudagraphs":
        return torch.compile(logits_loss, backend=backend, mode="reduce-overhead")
    if name == "fused":
        return linear_cross_entropy
    if name == "fused_cudagraphs":
        return torch.compile(linear_cross_entropy, backend=backend, mode="reduce-overhead")
    if name in ("liger", "cce", "cce_exact"):
        if device.type != "cuda":
            return "needs CUDA (Triton kernels)"
        return library_side(name)
    raise ValueError(name)


def library_versions() -> dict:
    found = {}
    for pkg in ("torchao", *LIBRARIES.values(), "triton"):
        try:
            found[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            found[pkg] = None
    return found


def step_fn(fn, h, w, y, amp: bool):
    def step():
        # Each call is one training step: gradients start at None, as a training step's
        # zero_grad(set_to_none=True) leaves them, so backward writes them instead of adding
        # into the last call's. Under CUDA graphs the last call's gradients live in the graphs'
        # memory pool, which the next replay overwrites: adding into them stopped both
        # CUDA-graph sides in job 21:27 ("accessing tensor output of CUDAGraphs that has been
        # overwritten"). The mark tells the graphs a new step begins (a no-op for the others).
        h.grad = w.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=amp):
            loss = fn(h, w, y)
        loss.backward()
        return loss

    return step


def reference(h, w, y) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The loss and both gradients in fp32, TF32 off."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = logits_loss(h, w, y)
        loss.backward()
        return loss.item(), h.grad, w.grad
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def compare(name: str, shape: tuple[int, int, int], args, device: torch.device) -> dict:
    """One shape: every side's accuracy, memory and time."""
    rows, width, vocab = shape
    # Each shape compiles from nothing: a compiled function seen before at other shapes would be
    # recompiled with its shapes marked dynamic, into general-shape kernels.
    torch.compiler.reset()
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Hidden states as the last LayerNorm leaves them (unit scale), the tied embedding's scale.
    h = torch.randn(rows, width, generator=gen).to(device).requires_grad_()
    w = (torch.randn(vocab, width, generator=gen) * 0.02).to(device).requires_grad_()
    y = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    ref_loss, ref_gh, ref_gw = reference(h, w, y)
    cuda = device.type == "cuda"
    amp = cuda or args.quick  # bf16 autocast; on the CPU too, so the quick run takes the same path
    timer = Timer(device)
    sides, absent = {}, {}
    for side in args.sides:
        fn = build_side(side, device, args.backend)
        if isinstance(fn, str):
            absent[side] = fn
            print(f"{name} {side}: absent ({fn})", flush=True)
        else:
            sides[side] = step_fn(fn, h, w, y, amp)
    result: dict[str, dict] = {}

    def clear():
        h.grad = w.grad = None
        gc.collect()
        if cuda:
            torch.cuda.synchronize()

    def peak_above(run) -> float | None:
        """MiB allocated at the peak of run() above what was allocated before it."""
        clear()
        if not cuda:
            run()
            return None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    for side, step in list(sides.items()):
        started = time.perf_counter()
        try:
            first = peak_above(lambda step=step: [step() for _ in range(args.warmup)])
            clear()
            loss = step().detach().float().item()  # clone-free: item() copies to the host
            gh, gw = h.grad.detach().float().clone(), w.grad.detach().float().clone()
            one = peak_above(step)
        except Exception as err:  # noqa: BLE001 - a library that fails here is reported
            absent[side] = f"failed: {type(err).__name__}: {err}"[:300]
            print(f"{name} {side}: failed ({absent[side]})", flush=True)
            del sides[side]
            continue
        result[side] = {
            "warmup_s": time.perf_counter() - started,
            "loss": loss,
            "loss_abs_diff": abs(loss - ref_loss),
            "grad_h_max_abs_diff": (gh - ref_gh).abs().max().item(),
            "grad_w_max_abs_diff": (gw - ref_gw).abs().max().item(),
            "grad_h_rel_err": ((gh - ref_gh).norm() / ref_gh.norm()).item(),
            "grad_w_rel_err": ((gw - ref_gw).norm() / ref_gw.norm()).item(),
            "peak_first_mib": first,
            "peak_step_mib": one,
        }
        del gh, gw
    ms: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, step in sides.items():
            ms[side].append(timer.run(step, args.steps))
    clear()
    flop = 3 * 2 * rows * width * vocab  # forward and the two backward products
    for side, times in ms.items():
        med = statistics.median(times)
        result[side].update(ms=med, ms_rounds=times, tflops=flop / med / 1e9)
    return {
        "shape": {"rows": rows, "width": width, "vocab": vocab},
        "reference": {
            "loss": ref_loss,
            "grad_h_max_abs": ref_gh.abs().max().item(),
            "grad_w_max_abs": ref_gw.abs().max().item(),
        },
        "sides": result,
        "absent": absent,
    }


def events_ms(fn, steps: int) -> float:
    """ms a call of fn over `steps` calls, between two CUDA events (optim_step.py's too)."""
    return Timer(torch.device("cuda")).run(fn, steps)


def sweep(args) -> dict:
    """The loss kernel alone on bf16 logits, per (columns a block, warps), against a copy of the
    logits (one read and one write: the traffic the kernel would move if pass 2 hit L2)."""
    cuda = torch.device("cuda")
    logits = torch.randn(args.rows, args.vocab, device=cuda).bfloat16()
    y = torch.randint(0, args.vocab, (args.rows,), device=cuda)
    sides = {"copy": lambda: logits.clone()}
    for launch in LAUNCH_SHAPES:
        name = "_".join(f"{k}{int(v)}" for k, v in launch._asdict().items())
        sides[name] = lambda launch=launch: loss_grad_cuda(logits, y, launch)
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():
        events_ms(fn, 3)
    for _ in range(args.rounds):
        for name, fn in sides.items():
            ms[name].append(events_ms(fn, args.steps))
    moved = 2 * logits.numel() * logits.element_size()
    return {
        name: {"ms": statistics.median(t), "rounds": t, "gb_s": moved / statistics.median(t) / 1e6}
        for name, t in ms.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sides", nargs="+", default=None, help=f"of {', '.join(SIDES)}")
    parser.add_argument("--rows", type=int, default=16 * 1024, help="--sweep's logits rows")
    parser.add_argument("--vocab", type=int, default=50304, help="--sweep's logits columns")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="first calls: compile, capture")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--sweep", action="store_true", help="the loss kernel per launch shape")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.sweep:
        rows = sweep(args)
        for name, row in rows.items():
            print(f"{name:46s} {row['ms']:7.3f} ms  {row['gb_s']:7.1f} GB/s (read + write)")
        write(args, {"rows": rows}, "head_loss_sweep")
        return
    shapes = SHAPES
    if args.quick:
        args.steps, args.rounds, args.warmup = 2, 2, 1
        shapes = QUICK_SHAPES
        args.sides = args.sides or QUICK_SIDES
    elif not torch.cuda.is_available():
        sys.exit("bench/head_loss.py times CUDA kernels: run it on a GPU (--quick checks it here)")
    args.sides = args.sides or SIDES
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    results = {}
    for name in args.shapes:
        results[name] = compare(name, shapes[name], args, device)
        report(name, results[name])
    write(args, {"libraries": library_versions(), "shapes": results}, "head_loss")


def report(name: str, result: dict) -> None:
    s = result["shape"]
    print(f"\n{name}: {s['rows']} rows x {s['width']} -> {s['vocab']}, bf16, forward + backward")
    print(f"{'side':<18} {'ms':>8} {'TFLOP/s':>8} {'peak MiB':>9} {'first MiB':>9} "
          f"{'|dloss|':>9} {'grad_h rel':>10} {'grad_w rel':>10}")  # fmt: skip
    for side, r in result["sides"].items():
        mib = f"{r['peak_step_mib']:9.0f}" if r["peak_step_mib"] is not None else f"{'-':>9}"
        first = f"{r['peak_first_mib']:9.0f}" if r["peak_first_mib"] is not None else f"{'-':>9}"
        errors = (
            f"{r['loss_abs_diff']:9.2e} {r['grad_h_rel_err']:10.2e} {r['grad_w_rel_err']:10.2e}"
        )
        print(f"{side:<18} {r['ms']:8.3f} {r['tflops']:8.1f} {mib} {first} {errors}")
    for side, why in result["absent"].items():
        print(f"{side:<18} absent: {why}")


def write(args, body: dict, name: str) -> None:
    meta = versions() if torch.cuda.is_available() and not args.quick else {"device": "cpu"}
    meta.setdefault("torch", torch.__version__)
    device = meta["device"].replace(" ", "_")
    path = Path(args.out) / f"{name}-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**meta, "command": " ".join(["python", *sys.argv]), "args": vars(args), **body}
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
