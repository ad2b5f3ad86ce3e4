"""Does putting the gradient all-reduce inside the compiled backward pay? The plain loop a strong
user would write with torch's compiled autograd and DDP's Python reducer (the combination
torchtitan uses for data parallelism), against the same loop on each GPU alone, in one torchrun.

    torchrun --nproc_per_node=4 bench/probes/compiled_autograd.py
    torchrun --nproc_per_node=2 bench/probes/compiled_autograd.py --quick   # CPU, gloo: checks it

Cases, each built from the same seed, warmed up, timed over rounds, and freed before the next:
  alone          each GPU trains alone: torch.compile(model), backward by autograd
  alone_ca       each GPU alone, forward and backward compiled as one function under compiled
                 autograd (what the DDP case costs without its collectives)
  ddp_ca         torch DDP with `optimize_ddp="python_reducer"`: its per-parameter all-reduce
                 hooks traced into the compiled backward, bucketed by inductor
  ddp_ca_reorder the same with inductor's compute/communication reordering pass
  ddp            torch DDP around torch.compile(model) (torch's DDPOptimizer splits the graph)
Every case steps fused AdamW after clipping the gradient norm at 1.0, bf16 autocast. After the
DDP cases, every rank's weights must equal rank 0's (the gradients really were reduced: a torch
bug once skipped them); the probe says so per case. Writes
bench/results/compiled_autograd-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

from bench.engines import versions  # noqa: E402
from mgpu.models.gpt import GPT  # noqa: E402

CASES = ["alone", "alone_ca", "ddp_ca", "ddp_ca_reorder", "ddp"]


def model_for(quick: bool) -> GPT:
    if quick:
        return GPT(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=32)
    return GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def build(case: str, args, device: torch.device):
    """The model as the case wraps and compiles it, its optimizer, and one training step."""
    torch.compiler.reset()
    torch._dynamo.config.compiled_autograd = case in ("alone_ca", "ddp_ca", "ddp_ca_reorder")
    torch._dynamo.config.optimize_ddp = "python_reducer" if "ca" in case else "ddp_optimizer"
    torch._inductor.config.reorder_for_compute_comm_overlap = case == "ddp_ca_reorder"
    torch.manual_seed(0)
    model = model_for(args.quick).to(device)
    backend = "aot_eager" if args.quick else "inductor"
    if case.startswith("ddp"):
        ids = [device.index] if device.type == "cuda" else None
        model = DDP(model, device_ids=ids, bucket_cap_mb=args.bucket_mb)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=device.type == "cuda", foreach=device.type != "cuda"
    )
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    if case in ("alone", "ddp"):
        compiled = torch.compile(model, backend=backend)

        def forward_backward(x, y):
            with amp:
                loss = compiled(x, y)
            loss.backward()
            return loss
    else:

        @torch.compile(backend=backend)
        def forward_backward(x, y):
            with amp:
                loss = model(x, y)
            loss.backward()
            return loss

    def step(x, y):
        loss = forward_backward(x, y)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return model, step


def timed(step, batch, steps: int, device: torch.device) -> float:
    """ms per step on the GPU's clock (CPU: the host's), the host waiting only at the end."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            step(*batch)
        return (time.perf_counter() - start) * 1e3 / steps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        step(*batch)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def ranks_agree(model) -> float:
    """The largest difference between this rank's weights and rank 0's (0: they agree)."""
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    gap = (flat - ref).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=100)
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU over gloo")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    cuda = not args.quick
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(__import__("os").environ["LOCAL_RANK"])) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    batch_size, seq = (4, 32) if args.quick else (16, 1024)
    vocab = 512 if args.quick else 50304
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=gen).to(device)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    rows = []
    for case in args.cases:
        started, step = time.time(), None
        try:
            model, step = build(case, args, device)
            timed(step, batch, args.warmup, device)
            times = [timed(step, batch, args.steps, device) for _ in range(args.rounds)]
            gap = ranks_agree(model) if case.startswith("ddp") else None
            row = {"case": case, "step_ms": statistics.median(times), "rounds_ms": times}
            row |= {"ranks_weight_gap": gap, "seconds": round(time.time() - started, 1)}
        except Exception as error:  # a case torch can't run is a finding, not the end
            row = {"case": case, "error": f"{type(error).__name__}: {error}"[:2000]}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del step
        dist.barrier()
    if rank == 0:
        alone = next((r["step_ms"] for r in rows if r["case"] == "alone" and "step_ms" in r), None)
        efficiency = {
            r["case"]: round(alone / r["step_ms"], 4) for r in rows if alone and "step_ms" in r
        }
        meta = versions() if cuda else {"device": "cpu", "torch": torch.__version__}
        record = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), **meta}
        record |= {"world_size": dist.get_world_size(), "bucket_mb": args.bucket_mb}
        record |= {"efficiency_vs_alone": efficiency, "rows": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        name = str(record["device"]).replace(" ", "_")
        path = args.out / f"compiled_autograd-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(record, indent=1))
        print(f"efficiency against alone: {efficiency}\nwrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
