"""GPT's head and loss alone, forward and backward, on one GPU: the logits' cross-entropy as a
whole-model compile makes it, against model.head_loss=fused (mgpu.models.fused_loss).

    python bench/head_loss.py [--rows 16384 --width 768 --vocab 50304]   # GPT-2-small B16 T1024
    python bench/head_loss.py --sweep   # the loss kernel alone, per launch shape

Interleaved rounds of CUDA-event-timed steps, bf16 autocast, fp32 weight as in training.
Writes bench/results/head_loss-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
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
from mgpu.models.fused_loss import LAUNCH_SHAPES, linear_cross_entropy, loss_grad_cuda  # noqa: E402


def logits_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), y)


def time_ms(fn, h, w, y, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, y)
        loss.backward()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def events_ms(fn, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


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
    parser.add_argument("--rows", type=int, default=16 * 1024)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="the loss kernel per launch shape")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.sweep:
        rows = sweep(args)
        for name, row in rows.items():
            print(f"{name:46s} {row['ms']:7.3f} ms  {row['gb_s']:7.1f} GB/s (read + write)")
        write(args, rows, "head_loss_sweep")
        return
    cuda = torch.device("cuda")
    h = torch.randn(args.rows, args.width, device=cuda, requires_grad=True)
    w = (torch.randn(args.vocab, args.width, device=cuda) * 0.02).requires_grad_()
    y = torch.randint(0, args.vocab, (args.rows,), device=cuda)
    sides = {
        "logits_compiled": torch.compile(logits_loss),
        "logits_cudagraphs": torch.compile(logits_loss, mode="reduce-overhead"),
        "fused_eager": linear_cross_entropy,
        "fused_cudagraphs": torch.compile(linear_cross_entropy, mode="reduce-overhead"),
    }
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():
        time_ms(fn, h, w, y, 3)  # compile, record graphs
    for _ in range(args.rounds):
        for name, fn in sides.items():
            ms[name].append(time_ms(fn, h, w, y, args.steps))
    flop = 3 * 2 * args.rows * args.width * args.vocab  # forward and two backward products
    rows = {
        name: {"ms": statistics.median(t), "rounds": t, "tflops": flop / statistics.median(t) / 1e9}
        for name, t in ms.items()
    }
    for name, row in rows.items():
        print(f"{name:20s} {row['ms']:7.3f} ms  {row['tflops']:6.1f} TFLOP/s of head products")
    write(args, rows, "head_loss")


def write(args, rows: dict, name: str) -> None:
    meta = versions()
    device = meta["device"].replace(" ", "_")
    path = Path(args.out) / f"{name}-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**meta, "command": " ".join(["python", *sys.argv]), "args": vars(args), "rows": rows}
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
