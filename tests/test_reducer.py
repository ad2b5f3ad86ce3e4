"""dist.engine=mgpu against torch DDP and against one process on the concatenated batch: two gloo
processes, 10 optimizer steps, for bucket sizes from one per parameter to one for everything,
gradient accumulation, tied, frozen and unused parameters, and bf16 communication."""

import contextlib
import copy
import json
from collections import Counter

import pytest
import torch
import torch.distributed as tdist
from conftest import free_port, gloo_runtime, spawn
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mgpu.comm.buckets import assign_buckets
from mgpu.comm.engine import MgpuDataParallel, wrap_model
from mgpu.config.schema import (
    DistConfig,
    Engine,
    OptimConfig,
    OptimizerName,
    Precision,
    ReduceDtype,
    TrainerConfig,
)
from mgpu.models import GPT, MLP
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.runtime.dist import Runtime
from mgpu.train.trainer import Trainer

# 10 steps: the bucket order is learned on step 2, AdamW's moments are several steps old, and
# each step costs the ranks a collective per bucket; equality to the references needs no more.
WORLD, MICRO, STEPS = 2, 4, 10


class Branchy(nn.Module):
    """An MLP with a frozen layer and a branch that only some configurations use."""

    def __init__(self, use_branch: bool):
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.body = MLP(in_features=8, num_classes=5, hidden=[16])
        self.branch = nn.Linear(8, 5)
        self.use_branch = use_branch

    def forward(self, x):
        out = self.body(torch.tanh(self.frozen(x)))
        return out + self.branch(x) if self.use_branch else out


MODELS = {
    "mlp": lambda: MLP(in_features=8, num_classes=5, hidden=[16, 16]),
    "gpt": lambda: GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16),  # tied
    "branchy_unused": lambda: Branchy(use_branch=False),
    "bn": lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5)),
}

# name: (model, engine, accum, optimizer, dist overrides)
CASES = {
    "mgpu_default": ("mlp", "mgpu", 1, "sgd", {}),
    "mgpu_bucket_per_param": ("mlp", "mgpu", 1, "sgd", {"bucket_cap_mb": 1e-6}),
    "mgpu_one_bucket": ("mlp", "mgpu", 1, "sgd", {"bucket_cap_mb": 1e3, "first_bucket_mb": 1e3}),
    "mgpu_accum4_adamw": ("mlp", "mgpu", 4, "adamw", {}),
    "ddp_accum4_adamw": ("mlp", "torch_ddp", 4, "adamw", {}),
    "mgpu_gpt_tied": ("gpt", "mgpu", 2, "sgd", {"bucket_cap_mb": 0.002}),
    "ddp_gpt_tied": ("gpt", "torch_ddp", 2, "sgd", {}),
    "mgpu_frozen_unused": ("branchy_unused", "mgpu", 1, "sgd", {"find_unused": True}),
    "mgpu_bf16_wire": ("mlp", "mgpu", 1, "sgd", {"reduce_dtype": ReduceDtype.bf16}),
    # buckets of one parameter, reduced in the parameter's own .grad (Bucket.own)
    "mgpu_accum4_per_param": ("mlp", "mgpu", 4, "adamw", {"bucket_cap_mb": 1e-6}),
    "mgpu_frozen_unused_per_param": (
        "branchy_unused",
        "mgpu",
        1,
        "sgd",
        {"find_unused": True, "bucket_cap_mb": 1e-6},
    ),
    "mgpu_bf16_wire_per_param": (
        "mlp",
        "mgpu",
        1,
        "sgd",
        {"reduce_dtype": ReduceDtype.bf16, "bucket_cap_mb": 1e-6},
    ),
    # clipped every step (CLIPS): the norm over the reducer's flat buckets, the reference's
    # over each parameter's gradient
    "mgpu_clipped_adamw": ("mlp", "mgpu", 1, "adamw", {}),
    "mgpu_clipped_per_param": ("mlp", "mgpu", 4, "adamw", {"bucket_cap_mb": 1e-6}),
    # BatchNorm: statistics differ per rank (per-rank batches), so no single-process reference
    "mgpu_bn": ("bn", "mgpu", 1, "sgd", {}),
    "ddp_bn": ("bn", "torch_ddp", 1, "sgd", {}),
    "mgpu_bn_own_buffers": ("bn", "mgpu", 1, "sgd", {"broadcast_buffers": False}),
    "ddp_bn_own_buffers": ("bn", "torch_ddp", 1, "sgd", {"broadcast_buffers": False}),
}
PER_RANK_STATS = [c for c in CASES if CASES[c][0] == "bn"]
CLIPS = {"mgpu_clipped_adamw": 0.05, "mgpu_clipped_per_param": 0.05}  # trainer.grad_clip


def batch(model: str, step: int, n: int):
    g = torch.Generator().manual_seed(1000 + step)
    if model == "gpt":
        tokens = torch.randint(0, 32, (n, 9), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def build(rt, case: str, reference: bool):
    model_name, engine, accum, optim, overrides = CASES[case]
    torch.manual_seed(0)
    model = MODELS[model_name]()
    ocfg = OptimConfig(name=OptimizerName(optim), lr=0.05, warmup_steps=0, weight_decay=0.0)
    optimizer = build_optimizer(ocfg, model, rt.device)
    schedule = build_schedule(ocfg, optimizer, max_steps=STEPS)
    engine = "none" if reference else engine
    model = wrap_model(model, DistConfig(engine=Engine(engine), **overrides), rt)
    tcfg = TrainerConfig(
        grad_accum_steps=1 if reference else accum,
        grad_clip=CLIPS.get(case, 0.0),
        precision=Precision.fp32,
    )
    return model, Trainer(tcfg, model, optimizer, schedule, rt)


def train_cases(rt, out_dir: str, cases: list[str]) -> None:
    rank, world = rt.rank, rt.world_size
    for case in cases:
        model_name, _, accum, _, _ = CASES[case]
        model, trainer = build(rt, case, reference=False)
        ready_at_launch = []
        if isinstance(model, MgpuDataParallel):
            reducer, launch = model.reducer, model.reducer._launch

            def record(bucket, reducer=reducer, launch=launch, seen=ready_at_launch):
                seen.append(len(reducer.ready))
                launch(bucket)

            reducer._launch = record
        for step in range(STEPS):
            x, y = batch(model_name, step, world * accum * MICRO)
            starts = [(m * world + rank) * MICRO for m in range(accum)]
            trainer.train_step(iter([(x[s : s + MICRO], y[s : s + MICRO]) for s in starts]))
        syncs = len(model.reducer.exposed) if isinstance(model, MgpuDataParallel) else -1
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save(
            {"params": state, "syncs": syncs, "ready_at_launch": ready_at_launch},
            f"{out_dir}/{case}.{rank}.pt",
        )


def worker(rank: int, port: int, out_dir: str, cases: list[str], world: int = WORLD):
    with gloo_runtime(rank, port, world) as rt:
        train_cases(rt, out_dir, cases)


# Every two-rank run of this module, in one pair of processes (each costs seconds to start):
# one subdirectory of results each.
PARTS = ("cases", "edge", "copies", "rewrap", "norms", "trainable", "unused")


def two_rank_worker(rank: int, port: int, out_dir: str):
    with gloo_runtime(rank, port, WORLD) as rt:
        train_cases(rt, f"{out_dir}/cases", list(CASES))
        edge_work(rt, f"{out_dir}/edge")
        copy_count_work(rt, f"{out_dir}/copies")
        rewrap_work(rt, f"{out_dir}/rewrap")
        norms_work(rt, f"{out_dir}/norms")
        trainable_work(rt, f"{out_dir}/trainable")
        unused_work(rt, f"{out_dir}/unused")  # last: its backward fails by design


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("reducer")
    for part in PARTS:
        (out / part).mkdir()
    spawn(two_rank_worker, free_port(), str(out), nprocs=WORLD)
    return out


@pytest.fixture
def results(two_ranks):
    return two_ranks / "cases"


def reference_state(case: str, world: int = WORLD):
    model_name, _, accum, _, _ = CASES[case]
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    model, trainer = build(rt, case, reference=True)
    for step in range(STEPS):
        trainer.train_step(iter([batch(model_name, step, world * accum * MICRO)]))
    return model.state_dict()


def assert_matches_reference(out_dir, case: str, world: int = WORLD) -> None:
    """Every rank's parameters after the run equal one process's on the concatenated batch."""
    expected = reference_state(case, world)
    for rank in range(world):
        got = torch.load(out_dir / f"{case}.{rank}.pt", weights_only=True)
        for key, value in expected.items():
            torch.testing.assert_close(
                got["params"][key], value, rtol=1e-6, atol=1e-6, msg=f"{case} rank {rank} {key}"
            )
        if CASES[case][1] == "mgpu":
            assert got["syncs"] == STEPS  # one reduction per optimizer step, none per micro-step


@pytest.mark.parametrize("case", [c for c in CASES if "bf16" not in c and c not in PER_RANK_STATS])
def test_matches_one_process_on_the_concatenated_batch(results, case):
    assert_matches_reference(results, case)


def test_a_larger_ring_matches_one_process_on_the_concatenated_batch(tmp_path):
    """Four ranks (gloo processes on the CPU, standing in for a larger ring): the averages,
    the order rank 0 broadcasts, buckets of one parameter, tied and unused parameters."""
    world = 4
    cases = [
        "mgpu_default",
        "mgpu_accum4_per_param",
        "mgpu_gpt_tied",
        "mgpu_frozen_unused_per_param",
    ]
    spawn(worker, free_port(), str(tmp_path), cases, world, nprocs=world)
    for case in cases:
        assert_matches_reference(tmp_path, case, world)


@pytest.mark.parametrize(
    "mgpu_case, ddp_case",
    [
        ("mgpu_accum4_adamw", "ddp_accum4_adamw"),
        ("mgpu_gpt_tied", "ddp_gpt_tied"),
        ("mgpu_bn_own_buffers", "ddp_bn_own_buffers"),  # each rank's own statistics
    ],
)
def test_matches_torch_ddp(results, mgpu_case, ddp_case):
    for rank in range(WORLD):
        mine = torch.load(results / f"{mgpu_case}.{rank}.pt", weights_only=True)["params"]
        ddp = torch.load(results / f"{ddp_case}.{rank}.pt", weights_only=True)["params"]
        for key, value in ddp.items():
            torch.testing.assert_close(mine[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_batchnorm_statistics_follow_rank_0_as_with_torch_ddp(results):
    """Every step starts from rank 0's running statistics, as with torch DDP's
    broadcast_buffers, so parameters and rank 0's statistics match DDP's. mgpu broadcasts
    after the step's reduction rather than at the next forward: after the last step rank 1 also
    holds rank 0's statistics (DDP's rank 1 keeps its own from its last forward)."""
    mine = [torch.load(results / f"mgpu_bn.{r}.pt", weights_only=True)["params"] for r in (0, 1)]
    ddp = [torch.load(results / f"ddp_bn.{r}.pt", weights_only=True)["params"] for r in (0, 1)]
    stats = ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    for key, value in ddp[0].items():
        torch.testing.assert_close(mine[0][key], value, rtol=1e-6, atol=1e-7, msg=key)
        expected = mine[0][key] if key in stats else ddp[1][key]
        torch.testing.assert_close(mine[1][key], expected, rtol=1e-6, atol=1e-7, msg=key)
    assert not torch.equal(ddp[1]["1.running_mean"], ddp[0]["1.running_mean"])


def test_buckets_launch_while_backward_is_still_running(results):
    got = torch.load(results / "mgpu_bucket_per_param.0.pt", weights_only=True)
    per_step = got["ready_at_launch"][-6:]  # MLP 8-16-16-5: 6 parameters, 6 buckets
    # the last layer's bucket goes out when only its own gradients are ready
    assert per_step == [1, 2, 3, 4, 5, 6], got["ready_at_launch"][:12]


@pytest.mark.parametrize("case", ["mgpu_bf16_wire", "mgpu_bf16_wire_per_param"])
def test_bf16_wire_is_close_but_not_identical(results, case):
    expected = reference_state("mgpu_default")
    got = torch.load(results / f"{case}.0.pt", weights_only=True)["params"]
    diffs = [(got[k] - v).abs().max().item() for k, v in expected.items()]
    assert max(diffs) < 2e-2 and max(diffs) > 0  # bf16 rounding shows, but training agrees


def test_frozen_and_unused_parameters_are_left_alone(results):
    got = torch.load(results / "mgpu_frozen_unused.0.pt", weights_only=True)["params"]
    torch.manual_seed(0)
    initial = Branchy(use_branch=False).state_dict()
    torch.testing.assert_close(got["frozen.weight"], initial["frozen.weight"], rtol=0, atol=0)
    torch.testing.assert_close(got["branch.weight"], initial["branch.weight"], rtol=0, atol=0)


def unused_work(rt, out_dir: str):
    model = wrap_model(Branchy(use_branch=False), DistConfig(engine=Engine.mgpu), rt)
    x, y = batch("mlp", 0, MICRO)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    with open(f"{out_dir}/{rt.rank}.txt", "w") as f:
        f.write(message)


def test_unused_parameters_are_named_unless_find_unused(two_ranks):
    for rank in range(WORLD):
        message = (two_ranks / "unused" / f"{rank}.txt").read_text()
        assert "branch.weight" in message and "branch.bias" in message, message
        assert "dist.find_unused=true" in message
        assert "body" not in message  # used parameters are not named


def trainable_work(rt, out_dir: str):
    """A step, then a parameter unfrozen (or one frozen) after wrapping: the next forward's
    error, or "no error"."""
    said = {}
    for change in ("unfreeze", "freeze"):
        torch.manual_seed(0)
        module = MLP(in_features=8, num_classes=5, hidden=[16])
        name, first = next(iter(module.named_parameters()))
        first.requires_grad_(change == "freeze")  # frozen when wrapped, to be unfrozen
        model = wrap_model(module, DistConfig(engine=Engine.mgpu), rt)
        x, y = batch("mlp", 0, MICRO)
        nn.functional.cross_entropy(model(x), y).backward()
        first.requires_grad_(change == "unfreeze")
        try:
            model(x)
            said[change] = [name, "no error"]
        except RuntimeError as err:
            said[change] = [name, str(err)]
        model.reducer.remove()
    with open(f"{out_dir}/{rt.rank}.json", "w") as f:
        json.dump(said, f)


def test_a_parameter_frozen_or_unfrozen_after_wrapping_stops_the_next_forward(two_ranks):
    """Its gradient would not be averaged (unfrozen: each rank trains it apart) or it would be
    taken for an unused parameter (frozen): the next forward names it instead."""
    for rank in range(WORLD):
        said = json.loads((two_ranks / "trainable" / f"{rank}.json").read_text())
        for change, now in (("unfreeze", "now trainable"), ("freeze", "now frozen")):
            name, message = said[change]
            assert f"{now}: {name}" in message, message
            assert "requires_grad" in message and "before training starts" in message, message


def rewrap_work(rt, out_dir: str):
    torch.manual_seed(0)
    module = MLP(in_features=8, num_classes=3, hidden=[16])
    reference = copy.deepcopy(module)
    first = wrap_model(module, DistConfig(engine=Engine.mgpu), rt)
    first.reducer.remove()
    second = wrap_model(module, DistConfig(engine=Engine.mgpu, bucket_cap_mb=0.0001), rt)
    torch.manual_seed(1 + rt.rank)  # each rank its own batch
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    nn.functional.cross_entropy(second(x), y).backward()
    nn.functional.cross_entropy(reference(x), y).backward()
    worst = 0.0
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        tdist.all_reduce(q.grad)
        worst = max(worst, (p.grad - q.grad / WORLD).abs().max().item())
    with open(f"{out_dir}/{rt.rank}.txt", "w") as f:
        f.write(f"{worst} {len(first.reducer.exposed)} {len(second.reducer.exposed)}")


def test_a_removed_reducer_leaves_a_rewrapped_module_to_the_new_one(two_ranks):
    for rank in range(WORLD):
        text = (two_ranks / "rewrap" / f"{rank}.txt").read_text()
        worst, first_steps, second_steps = text.split()
        assert float(worst) < 1e-6
        # Only the second reducer communicated: the first, removed, took no part in backward.
        assert (first_steps, second_steps) == ("0", "1")


def test_buckets_respect_caps_order_and_dtype():
    params = [
        nn.Parameter(torch.zeros(n, dtype=d))
        for n, d in [
            (10, torch.float32),
            (300, torch.float32),
            (5, torch.float32),
            (5, torch.bfloat16),
            (1000, torch.float32),
            (2, torch.float32),
        ]
    ]
    groups = assign_buckets(params, cap_bytes=1024, first_cap_bytes=64)
    sizes = [[p.numel() for p in g] for g in groups]
    # 10 fills the small first bucket; 300 alone exceeds the cap; bf16 starts a new bucket
    assert sizes == [[10], [300], [5], [5], [1000], [2]]
    small = [nn.Parameter(torch.zeros(8)) for _ in range(10)]  # 32 bytes each
    assert [len(g) for g in assign_buckets(small, cap_bytes=128, first_cap_bytes=64)] == [2, 4, 4]
    assert [p for g in groups for p in g] == params  # order kept, every parameter once
    assert all(len({p.dtype for p in g}) == 1 for g in groups)
    assert all(sum(p.numel() * p.element_size() for p in g) <= 1024 or len(g) == 1 for g in groups)


# ---- edge cases: each ran into a real reducer bug once ----


class Boom(torch.autograd.Function):
    """Identity whose backward raises while `armed`: an error in the middle of backward."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if Boom.armed:
            raise RuntimeError("boom")
        return grad


class Reordered(nn.Module):
    """Registers its layers in the opposite order of use: the learned bucket order differs."""

    def __init__(self):
        super().__init__()
        self.second = nn.Linear(16, 5)
        self.first = nn.Linear(8, 16)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class Strided(nn.Module):
    """A weight that is a strided view of a bigger tensor, next to a dense one in the bucket."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 10)[:, :5])
        self.b = nn.Parameter(torch.zeros(5))

    def forward(self, x):
        return x @ self.w + self.b


class Branch(nn.Module):
    """A branch used only where `use` says so: data-dependent unused parameters."""

    def __init__(self):
        super().__init__()
        self.body, self.branch, self.use = nn.Linear(8, 5), nn.Linear(8, 5), True

    def forward(self, x):
        return self.body(x) + self.branch(x) if self.use else self.body(x)


EDGE = {  # name: (model factory, dist overrides, steps)
    "boom": (lambda: MLP(in_features=8, num_classes=5, hidden=[16]), {"bucket_cap_mb": 1e-6}, 5),
    "zero_in_place": (lambda: MLP(in_features=8, num_classes=5, hidden=[16]), {}, 5),
    "reordered": (Reordered, {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}, 5),
    "strided": (Strided, {"bucket_cap_mb": 1e3, "first_bucket_mb": 1e3}, 5),
    "branch_rank0_only": (Branch, {"find_unused": True}, 4),
}


def edge_step(model, opt, x, y, *, boom=False, set_to_none=True):
    Boom.armed = boom
    try:
        nn.functional.cross_entropy(model(Boom.apply(x.requires_grad_(True))), y).backward()
        opt.step()
    except RuntimeError as err:
        assert boom and "boom" in str(err), err
    finally:
        Boom.armed = False
    opt.zero_grad(set_to_none=set_to_none)


def edge_run(case: str, rt, engine: Engine, rank: int, world: int):
    factory, overrides, steps = EDGE[case]
    torch.manual_seed(0)
    module = factory()
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    cfg = DistConfig(engine=engine, **overrides) if engine is not Engine.none else None
    model = wrap_model(module, cfg, rt) if cfg else module
    for step in range(steps):
        x, y = batch("mlp", step, WORLD * MICRO)
        if world > 1:
            x, y = x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]
        if case == "branch_rank0_only":
            module.use = step > 0 or rank == 0
        if case == "boom" and step == 2 and world == 1:
            continue  # the reference skips the batch whose backward failed
        edge_step(
            model, opt, x, y, boom=case == "boom" and step == 2, set_to_none=case != "zero_in_place"
        )
    return model


def edge_work(rt, out_dir: str):
    for case in EDGE:
        # torch DDP is the reference only where one process is not (and it cannot survive
        # the boom case: an internal assert on the next step)
        engines = [Engine.mgpu, Engine.torch_ddp] if case == "branch_rank0_only" else [Engine.mgpu]
        for engine in engines:
            model = edge_run(case, rt, engine, rt.rank, WORLD)
            info = {"params": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}
            if engine is Engine.mgpu:
                reducer = model.reducer
                info["learned"] = reducer.observed is None
                info["first_bucket"] = [reducer.names[id(p)] for p in reducer.buckets[0].params]
            torch.save(info, f"{out_dir}/{case}.{engine.value}.{rt.rank}.pt")


# Bucket layouts the flat norm must cover: several parameters a bucket, one each, one for all,
# the bf16 wire's, a tied weight, and frozen and unused parameters.
NORM_CASES = [
    "mgpu_default",
    "mgpu_bucket_per_param",
    "mgpu_one_bucket",
    "mgpu_bf16_wire",
    "mgpu_gpt_tied",
    "mgpu_frozen_unused",
]


def norms_work(rt, out_dir: str):
    """After one backward, and after a second step of two micro-batches: the global norm of the
    gradients over MgpuDataParallel.grad_tensors (what Update clips with) and over each
    parameter's .grad (the reference), and what the former returned before any backward."""
    out = {}
    for case in NORM_CASES:
        model_name = CASES[case][0]
        model, _ = build(rt, case, reference=False)
        before = model.grad_tensors()
        x, y = batch(model_name, 0, WORLD * MICRO)
        mine = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
        x, y = x[mine], y[mine]
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten()).backward()
        flat = model.grad_tensors()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out[case] = {
            "before": before,
            "flat": torch.nn.utils.get_total_norm(flat),
            "each": torch.nn.utils.get_total_norm(grads),
            "numel": sum(t.numel() for t in flat),
            "grad_numel": sum(g.numel() for g in grads),
        }
        # A second step after zero_grad(set_to_none=True), of two micro-batches (the first
        # accumulated without communicating): no region of a bucket may keep step 0's values.
        model.zero_grad(set_to_none=True)
        for micro in range(2):
            x, y = batch(model_name, 1 + micro, WORLD * MICRO)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                logits = model(x[mine])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), y[mine].flatten())
                loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out[case]["flat_2"] = torch.nn.utils.get_total_norm(model.grad_tensors())
        out[case]["each_2"] = torch.nn.utils.get_total_norm(grads)
    torch.save(out, f"{out_dir}/norms.{rt.rank}.pt")


def test_the_flat_norm_is_the_norm_of_every_gradient(two_ranks):
    """The clipping norm over the reducer's buckets equals the norm over each parameter's
    gradient on every bucket layout, covering each gradient element once; before a backward
    there are no buckets' gradients to give."""
    for rank in range(WORLD):
        got = torch.load(two_ranks / "norms" / f"norms.{rank}.pt", weights_only=True)
        assert set(got) == set(NORM_CASES)
        for case, row in got.items():
            assert row["before"] is None, case
            assert row["numel"] == row["grad_numel"], case
            torch.testing.assert_close(row["flat"], row["each"], rtol=1e-6, atol=0, msg=case)
            torch.testing.assert_close(row["flat_2"], row["each_2"], rtol=1e-6, atol=0, msg=case)


@pytest.fixture
def edge_results(two_ranks):
    return two_ranks / "edge"


@pytest.mark.parametrize("case", [c for c in EDGE if c != "branch_rank0_only"])
def test_edge_cases_match_one_process_on_the_concatenated_batch(edge_results, case):
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    expected = edge_run(case, rt, Engine.none, 0, 1).state_dict()
    for rank in range(WORLD):
        got = torch.load(edge_results / f"{case}.mgpu.{rank}.pt", weights_only=True)
        for key, value in expected.items():
            torch.testing.assert_close(
                got["params"][key], value, rtol=1e-6, atol=1e-6, msg=f"{case} rank {rank} {key}"
            )
        assert got["learned"]  # the order was learned on step 2 and not grown since


def test_rank_dependent_unused_branch_matches_torch_ddp(edge_results):
    for rank in range(WORLD):
        mine = torch.load(edge_results / f"branch_rank0_only.mgpu.{rank}.pt", weights_only=True)
        ddp = torch.load(edge_results / f"branch_rank0_only.torch_ddp.{rank}.pt", weights_only=True)
        for key, value in ddp["params"].items():
            torch.testing.assert_close(mine["params"][key], value, rtol=1e-6, atol=1e-6)


def test_buckets_are_rebuilt_in_the_order_backward_produced_gradients(edge_results):
    got = torch.load(edge_results / "reordered.mgpu.0.pt", weights_only=True)
    assert got["first_bucket"][0].startswith("second."), got["first_bucket"]


class CountOps(TorchDispatchMode):
    """Counts the operators dispatched on this thread (CPU backward runs on the caller's)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def copy_count_work(rt, out_dir: str):
    counts = {}
    for cap in (1e-6, 1e3):  # a bucket per parameter; one bucket for everything
        torch.manual_seed(0)
        cfg = DistConfig(engine=Engine.mgpu, bucket_cap_mb=cap, first_bucket_mb=cap)
        model = wrap_model(MLP(in_features=8, num_classes=5, hidden=[16, 16]), cfg, rt)
        x, y = batch("mlp", 0, MICRO)
        for step in range(3):
            model.zero_grad(set_to_none=True)  # as the optimizer does each step
            loss = nn.functional.cross_entropy(model(x), y)
            with CountOps() as ops:
                loss.backward()
            buckets = model.reducer.buckets
            counts[cap, step] = dict(ops.counts), len(buckets), sum(b.own for b in buckets)
        model.reducer.remove()
    torch.save(counts, f"{out_dir}/{rt.rank}.pt")


def test_gradients_go_into_the_buckets_with_one_copy_per_bucket_and_none_for_one_parameter(
    two_ranks,
):
    """Host work per step scales with buckets, not parameters: each bucket's fresh gradients are
    copied in by one multi-tensor copy, with no copy launched per parameter. A bucket of one
    parameter is reduced in that parameter's own gradient: no copy at all."""
    for rank in range(WORLD):
        counted = torch.load(two_ranks / "copies" / f"{rank}.pt")
        for (cap, step), (ops, buckets, own) in counted.items():
            assert (buckets, own) == ((6, 6) if cap < 1 else (1, 0)), (cap, buckets, own)
            assert ops.get("_foreach_copy_", 0) == buckets - own, (cap, step, ops)
            assert ops.get("copy_", 0) == 0, (cap, step, ops)
