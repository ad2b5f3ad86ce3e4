"""Which of GPT-2 XL's linear layers gain from fp8, under which torchao recipe: a few XL-wide
blocks, compiled whole, one micro-batch of real shape, bf16 against fp8 variants in one process.

    python bench/probes/fp8_layers.py [--layers 4] [--batch 16] [--variants bf16 tensorwise ...]
    python bench/probes/fp8_layers.py --accum 8 --variants bf16 bf16_residual bf16_params ...
    python bench/probes/fp8_layers.py --quick   # tiny shapes on the CPU: checks the script only

Each variant builds the same model (seed 0) at XL's width (1600, 25 heads, T=1024, vocabulary
50304), converts its linear layers as trainer.fp8_recipe / trainer.fp8_skip would
(mgpu.train.fp8.convert), compiles it whole with its loss (model.head_loss=logits, as the plain
loop of bench/vs_plain.py takes it) and times forward, backward and a fused AdamW step with CUDA
events (median of rounds). A one-block bf16 model is timed too: the difference between it and
the --layers model is the blocks' share of a step, from which each variant's speed-up on the
blocks alone (what 48 of them make of an XL step) is worked out. The embedding, the head and
its loss stay bf16 in every variant. Not in the default run: bf16_cdt and tensorwise_cdt, the same
compiled with inductor's coordinate-descent tuning of its kernels' launch configurations; and
the dtype layouts of LAYOUTS (the residual stream in bf16, bf16 parameters), timed best with
--accum 8 (XL's micro-steps a step), where the gradients' accumulation shows.

Writes bench/results/fp8_layers-<device>-<time>.json with the device, versions and commit.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))  # bench/engines.py imports its helpers from beside it

from mgpu.models.gpt import GPT  # noqa: E402
from mgpu.train import fp8  # noqa: E402

# name -> (recipe, layers kept in bf16); None: bf16 throughout
VARIANTS: dict[str, tuple[str, list[str]] | None] = {
    "bf16": None,
    "tensorwise": ("tensorwise", []),
    "tw_skip_attn_proj": ("tensorwise", ["attn.c_proj"]),
    "tw_skip_mlp_proj": ("tensorwise", ["mlp.c_proj"]),
    # only the layers fed by a LayerNorm (qkv and the MLP's first): their input's cast can
    # fuse with the LayerNorm
    "tw_ln_fed": ("tensorwise", ["attn.c_proj", "mlp.c_proj"]),
    "tw_mlp_only": ("tensorwise", ["attn.c_attn", "attn.c_proj"]),
    "tw_attn_only": ("tensorwise", ["mlp.c_fc", "mlp.c_proj"]),
    "tensorwise_with_gw_hp": ("tensorwise_with_gw_hp", []),
    "rowwise": ("rowwise", []),
    "rowwise_with_gw_hp": ("rowwise_with_gw_hp", []),
}


# name -> inductor options its compile takes (the variants above take none)
TUNED = {"bf16_cdt": "bf16", "tensorwise_cdt": "tensorwise"}
CDT = {"coordinate_descent_tuning": True}

# Where a bf16 step's time outside the matrix multiplies goes, by the dtype of what it moves
# (not in the default run). name -> (fp8 variant it builds on, model.residual, parameters):
# bf16_residual: the residual stream in bf16 (model.residual=autocast); bf16_params: the
# parameters themselves in bf16, no autocast, their gradients accumulated in bf16 over the
# micro-steps (a bound: what no weight casts and no fp32 gradient traffic would give);
# bf16_params_fp32_grads: bf16 parameters whose gradients each micro-step adds into fp32 ones,
# with fp32 master weights that AdamW steps and copies back.
LAYOUTS = {
    "bf16_residual": ("bf16", "autocast", "fp32"),
    "tensorwise_residual": ("tensorwise", "autocast", "fp32"),
    "bf16_params": ("bf16", "fp32", "bf16"),
    "bf16_params_fp32_grads": ("bf16", "fp32", "bf16_fp32_grads"),
}


def layout(variant: str) -> tuple[str, str, str]:
    """(the VARIANTS entry it builds on, model.residual, parameters) of any variant."""
    return LAYOUTS.get(variant) or (TUNED.get(variant, variant), "fp32", "fp32")


def spec_of(variant: str):
    return VARIANTS[layout(variant)[0]]


def build(layers: int, width: int, heads: int, seq: int, vocab: int, variant: str, device):
    torch.manual_seed(0)
    model = GPT(
        vocab_size=vocab,
        block_size=seq,
        n_layer=layers,
        n_head=heads,
        n_embd=width,
        head_loss="logits",
        residual=layout(variant)[1],
    ).to(device)
    spec = spec_of(variant)
    if spec is not None:
        recipe, skip = spec
        fp8.convert(model, recipe, skip)
    return model


class Masters:
    """fp32 master weights and gradients for a model whose parameters are bf16: each micro-step's
    bf16 gradient is added into the fp32 one as soon as it is accumulated (and dropped), AdamW
    steps the masters, and the bf16 parameters are copied from them."""

    def __init__(self, params: list[torch.Tensor], fused: bool):
        self.params = params
        self.masters = [p.detach().float() for p in params]
        for p, m in zip(params, self.masters, strict=True):
            m.grad = torch.zeros_like(m)
            p.register_post_accumulate_grad_hook(self._hook(m))
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-4, fused=fused)

    @staticmethod
    def _hook(master: torch.Tensor):
        def add(p: torch.Tensor) -> None:
            master.grad.add_(p.grad)
            p.grad = None

        return add

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)  # the bf16 weights the next forward reads

    def zero_grad(self, set_to_none: bool = True) -> None:
        # the fp32 gradients stay allocated: the hooks add into them
        self.optimizer.zero_grad(set_to_none=False)


def time_variant(args, variant: str, layers: int, device) -> dict:
    model = build(layers, args.width, args.heads, args.seq, args.vocab, variant, device)
    options = CDT if variant in TUNED and args.backend == "inductor" else None
    params = layout(variant)[2]
    cuda = device.type == "cuda"
    if params == "fp32":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    else:
        model.to(torch.bfloat16)
        if params == "bf16":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        else:
            optimizer = Masters(list(model.parameters()), fused=cuda)
    step = torch.compile(model, backend=args.backend, options=options)
    idx = torch.randint(0, args.vocab, (args.accum, args.batch, args.seq), device=device)
    tgt = torch.randint(0, args.vocab, (args.accum, args.batch, args.seq), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=params == "fp32")

    def one() -> torch.Tensor:
        for micro in range(args.accum):
            with autocast:
                loss = step(idx[micro], tgt[micro])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    # a block weight before any step: the run's end shows whether the steps moved it
    first = model.blocks[0].mlp.c_fc.weight
    before = first.detach().clone()
    started = time.perf_counter()
    for _ in range(args.warmup):  # compiles, then fills the allocator
        loss = one()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    compile_s = time.perf_counter() - started
    rounds = []
    for _ in range(args.rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.steps):
                loss = one()
            end.record()
            end.synchronize()  # the round's end: the only host wait of a round
            rounds.append(start.elapsed_time(end) / args.steps)
        else:
            t = time.perf_counter()
            for _ in range(args.steps):
                loss = one()
            rounds.append((time.perf_counter() - t) * 1e3 / args.steps)
    result = {
        "layers": layers,
        "ms": statistics.median(rounds),
        "ms_rounds": rounds,
        "loss": float(loss),
        "warmup_s": compile_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "param_dtype": str(first.dtype),
        "weights_moved": not torch.equal(first.detach(), before),
        "spec": spec_of(variant),
        "layout": LAYOUTS.get(variant),
        "inductor_options": options,
    }
    return result


def release(cuda: bool) -> None:
    """The last variant's model, optimizer state and compiled graphs off the GPU."""
    gc.collect()
    torch.compiler.reset()
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="blocks (4; --quick: 2)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--accum", type=int, default=1, help="micro-steps a step (XL's experiment: 8)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=[*VARIANTS, *TUNED, *LAYOUTS],
        help="bf16_cdt, tensorwise_cdt: with inductor's coordinate-descent tuning; "
        f"{', '.join(LAYOUTS)}: other dtypes of the residual stream and the parameters "
        "(not default)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    args.width, args.heads, args.seq, args.vocab, args.backend = 1600, 25, 1024, 50304, "inductor"
    args.layers = args.layers or (2 if args.quick else 4)  # 2: still one block and more
    if args.quick:  # the script's paths at a CPU's size; fp8 runs emulated there
        args.width, args.heads, args.seq, args.vocab, args.backend = 64, 4, 32, 256, "aot_eager"
        args.batch, args.steps, args.rounds, args.warmup = 2, 2, 2, 1
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        from bench.engines import versions

        meta = versions()
    else:
        meta = {"device": "cpu", "torch": torch.__version__}
    try:
        import torchao

        meta["torchao"] = torchao.__version__
    except ImportError:
        meta["torchao"] = None
    if not cuda:
        # torchao's fp8 matrix multiply needs a GPU; its emulation runs the same conversion
        args.variants = [v for v in args.variants if spec_of(v) is None or meta["torchao"]]
    runs: dict[str, dict] = {}
    path = Path(args.out) / (
        f"fp8_layers-{meta['device'].replace(' ', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    one_block = time_variant(args, "bf16", 1, device)
    release(cuda)
    for variant in args.variants:
        try:
            runs[variant] = time_variant(args, variant, args.layers, device)
        except Exception as err:  # noqa: BLE001 - one variant's failure is a result too
            runs[variant] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        release(cuda)
        report(runs, one_block, args)
        body = {**meta, "command": " ".join(["python", *sys.argv]), "args": vars(args)}
        path.write_text(json.dumps({**body, "one_block_bf16": one_block, "runs": runs}, indent=1))
    print(f"wrote {path}")


def report(runs: dict[str, dict], one_block: dict, args) -> None:
    """Per variant: ms a step, and the speed-up on the blocks alone against bf16's blocks."""
    bf16 = runs.get("bf16", {}).get("ms")
    # the blocks' share of bf16's step: the --layers model less the one-block model, per block
    per_block = (bf16 - one_block["ms"]) / (args.layers - 1) if bf16 and args.layers > 1 else None
    for name, r in runs.items():
        if "error" in r:
            r["line"] = f"{name:20s} failed: {r['error']}"
        else:
            saved = (bf16 - r["ms"]) / args.layers if bf16 else None
            r["block_speedup"] = per_block / (per_block - saved) if per_block and saved else None
            r["line"] = (
                f"{name:20s} {r['ms']:8.2f} ms/step  x{bf16 / r['ms']:.3f} of bf16's step  "
                f"blocks x{r['block_speedup'] or 1:.3f}  peak {r['peak_gib'] or 0:.1f} GiB  "
                f"loss {r['loss']:.4f}  (warm-up {r['warmup_s']:.0f} s)"
                if bf16
                else f"{name:20s} {r['ms']:8.2f} ms/step"
            )
    print(f"-- {args.layers} blocks; one block bf16 {one_block['ms']:.2f} ms; "
          f"bf16 block {per_block or 0:.2f} ms")  # fmt: skip
    for r in runs.values():
        print(r["line"], flush=True)


if __name__ == "__main__":
    main()
