"""trainer.compile keeps the overlap: compile_model compiles each repeated block (the elements of a
ModuleList, as GPT's transformer blocks) and the Trainer compiles the loss as a region of its own,
so that gradients still come out block by block and buckets still launch while backward runs, and
training matches the eager model over 10 steps (clipped, so clipping inside the fused update is
covered too); GPT's blocks under model.activation_checkpointing too, each compiled checkpointed
block one region. Two gloo processes;
the `aot_eager` backend compiles through the same graph capture as inductor without a C++
toolchain, so CI can run it."""

import pytest
import torch
from conftest import free_port, gloo_runtime, spawn
from torch import nn

from mgpu.comm.engine import wrap_model
from mgpu.comm.sharded_optim import ShardedOptimizer
from mgpu.config.schema import (
    DistConfig,
    Engine,
    OptimConfig,
    OptimizerName,
    Precision,
    TrainerConfig,
)
from mgpu.models import GPT, MLP, ResNet, compile_mode, compile_model, repeated_blocks
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.train.trainer import Trainer

# 10 steps: several past step 2, where the reducer learns its bucket order, so the launch counts
# (asserted on every step) cover steps before and after it; the schedule runs its whole course.
WORLD, STEPS, N_BLOCKS = 2, 10, 3


def watch_compiled_backward(module, reducer, seen: list):
    """After each forward, note at the start of every compiled backward node (one per compiled
    graph) how many buckets the reducer had launched. Hooks sit on the autograd graph from
    outside the compiled code, so they change nothing that is compiled."""

    def hook(_module, _inputs, output):
        step: list[int] = []
        seen.append(step)
        for node in compiled_backward_nodes(output):
            node.register_prehook(lambda _grads: step.append(reducer.next_launch))

    return module.register_forward_hook(hook)


def compiled_backward_nodes(output: torch.Tensor) -> list:
    """The backward nodes of compiled graphs (one per graph) in the autograd graph of `output`."""
    found, stack, visited = [], [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        if "CompiledFunctionBackward" in node.name():
            found.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.relu(self.norm(self.fc(x)))


class Stack(nn.Module):
    """stem -> repeated blocks -> head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(N_BLOCKS))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack_as_sequential() -> nn.Sequential:
    """Stack's layers in an nn.Sequential, made in the same order (so with the same initial
    parameters under one seed): compile_model compiles it whole on any number of processes, as
    it does ResNet."""
    return nn.Sequential(nn.Linear(8, 16), *(Block(16) for _ in range(N_BLOCKS)), nn.Linear(16, 5))


def checkpointed_gpt() -> GPT:
    """A GPT of N_BLOCKS blocks, every one checkpointed (model.activation_checkpointing=blocks)."""
    return GPT(**GPT_SHAPE, activation_checkpointing="blocks")


GPT_SHAPE = {"vocab_size": 32, "block_size": 8, "n_layer": N_BLOCKS, "n_head": 2, "n_embd": 16}


def batch(step: int, tokens: bool = False):
    g = torch.Generator().manual_seed(step)
    if tokens:  # GPT's: inputs and the next tokens
        seq = torch.randint(0, 32, (WORLD * 4, 9), generator=g)
        return seq[:, :-1], seq[:, 1:]
    return torch.randn(WORLD * 4, 8, generator=g), torch.randint(0, 5, (WORLD * 4,), generator=g)


def train(rt, compiled: bool, overrides: dict, make=Stack, backend: str = "aot_eager"):
    torch.manual_seed(0)
    model = make().to(rt.device)
    # What train.py builds for trainer.compile=true (compile_mode auto), by default on a backend
    # CI can run.
    tcfg = TrainerConfig(
        grad_clip=0.5, precision=Precision.fp32, compile=compiled, compile_backend=backend
    )
    if compiled:
        mode = compile_mode(tcfg.compile_mode, tcfg.compile_backend, model, rt.device)
        compile_model(model, tcfg.compile_backend, mode)
    ocfg = OptimConfig(name=OptimizerName.sgd, lr=0.05, warmup_steps=0, weight_decay=0.0)
    optimizer = build_optimizer(ocfg, model, rt.device)
    model = wrap_model(model, DistConfig(engine=Engine.mgpu, **overrides), rt)
    if model.reducer.shards is not None:  # dist.shard_optimizer
        optimizer = ShardedOptimizer(optimizer, model.reducer.shards)
    schedule = build_schedule(ocfg, optimizer, max_steps=STEPS)
    seen: list[list[int]] = []
    watch_compiled_backward(model, model.reducer, seen)
    trainer = Trainer(tcfg, model, optimizer, schedule, rt)
    for step in range(STEPS):
        x, y = batch(step, tokens=isinstance(model.module, GPT))
        trainer.train_step(iter([(x[rt.rank :: WORLD], y[rt.rank :: WORLD])]))
    params = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    return {"params": params, "launched_at_compiled_backward": seen}


CASES = {  # name: (compiled, dist overrides[, model])
    "eager": (False, {"bucket_cap_mb": 1e-6}),
    "compiled": (True, {"bucket_cap_mb": 1e-6}),  # a bucket per parameter
    "compiled_sharded": (True, {"bucket_cap_mb": 1e-6, "shard_optimizer": True}),
    "compiled_one_bucket": (True, {"bucket_cap_mb": 1e3, "first_bucket_mb": 1e3}),
    # one graph for the whole model: the sharding's forward pre-hook, which waits for the
    # all-gathers of the updated parameters, runs where the compiled forward starts
    "whole_sharded": (True, {"bucket_cap_mb": 1e-6, "shard_optimizer": True}, stack_as_sequential),
    # GPT's blocks, each checkpointed and compiled, against the eager model without checkpoints
    "gpt_eager": (False, {"bucket_cap_mb": 1e-6}, lambda: GPT(**GPT_SHAPE)),
    "gpt_checkpointed": (True, {"bucket_cap_mb": 1e-6}, checkpointed_gpt),
}


def worker(rank: int, port: int, out_dir: str):
    with gloo_runtime(rank, port, WORLD) as rt:
        for name, case in CASES.items():
            torch.save(train(rt, *case), f"{out_dir}/{name}.{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    spawn(worker, free_port(), str(out), nprocs=WORLD)
    return {
        (name, rank): torch.load(out / f"{name}.{rank}.pt", weights_only=True)
        for name in CASES
        for rank in range(WORLD)
    }


def test_compiled_blocks_train_like_the_eager_model(results):
    for rank in range(WORLD):
        eager, compiled = results["eager", rank]["params"], results["compiled", rank]["params"]
        for key, value in eager.items():
            torch.testing.assert_close(
                compiled[key], value, rtol=1e-6, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
            )


def test_compiled_blocks_train_sharded_like_the_eager_model(results):
    # fp32 tolerance: with dist.shard_optimizer the clipping norm is summed shard by shard
    for rank in range(WORLD):
        eager, sharded = results["eager", rank]["params"], results["compiled_sharded", rank]
        for key, value in eager.items():
            torch.testing.assert_close(sharded["params"][key], value, rtol=1e-5, atol=1e-5)
        per_step = [2 + 4 * k for k in range(N_BLOCKS)]  # reduce-scatters launch as all-reduces
        assert sharded["launched_at_compiled_backward"] == [per_step] * STEPS


def test_a_model_compiled_whole_trains_sharded_like_the_eager_model(results):
    for rank in range(WORLD):
        eager, whole = results["eager", rank], results["whole_sharded", rank]
        # the same parameters in the same order, under Sequential's names
        pairs = zip(eager["params"].items(), whole["params"].values(), strict=True)
        for (key, value), ours in pairs:
            torch.testing.assert_close(
                ours, value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
            )
        # one compiled graph, whose backward starts before any bucket is complete
        assert whole["launched_at_compiled_backward"] == [[0]] * STEPS


def test_buckets_of_compiled_blocks_launch_while_backward_runs(results):
    # One compiled backward per block, last block first (the compiled loss runs before them but
    # lies past the model's output, where this watch does not look). Each starts once the
    # buckets of all that follows it (the eager head: 2 parameters; each later block: 4) have
    # been launched. A whole-model compile would show one compiled backward seeing no bucket
    # launched.
    per_step = [2 + 4 * k for k in range(N_BLOCKS)]
    for rank in range(WORLD):
        seen = results["compiled", rank]["launched_at_compiled_backward"]
        assert seen == [per_step] * STEPS, seen
        # the control: one bucket for everything cannot launch before backward has ended
        control = results["compiled_one_bucket", rank]["launched_at_compiled_backward"]
        assert control == [[0] * N_BLOCKS] * STEPS, control
        assert results["eager", rank]["launched_at_compiled_backward"] == [[]] * STEPS


def test_checkpointed_compiled_blocks_stay_one_region_and_buckets_launch_between_them(results):
    # GPT: its ln_f (1 parameter) follows the blocks, 6 parameters each; the tied wte/lm_head
    # and wpe wait for the embeddings. Each checkpointed block is still one compiled backward
    # (its recompute inside it): a graph break would show more nodes and other counts.
    per_step = [1 + 6 * k for k in range(N_BLOCKS)]
    for rank in range(WORLD):
        checkpointed = results["gpt_checkpointed", rank]
        assert checkpointed["launched_at_compiled_backward"] == [per_step] * STEPS
        eager = results["gpt_eager", rank]["params"]
        for key, value in eager.items():
            torch.testing.assert_close(
                checkpointed["params"][key], value, rtol=1e-6, atol=1e-6, msg=key
            )


def test_repeated_blocks_are_the_elements_of_module_lists():
    gpt = GPT(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16)
    assert repeated_blocks(gpt) == list(gpt.blocks)
    assert repeated_blocks(nn.ModuleList([gpt])) == [gpt]  # outermost only
    # nn.Sequential stacks are compiled whole (see compile_model)
    assert repeated_blocks(ResNet(num_classes=10, block="basic", layers=[2, 1])) == []
    assert repeated_blocks(MLP(in_features=8, num_classes=5, hidden=[16, 16])) == []


@pytest.mark.parametrize("overlap, graphs", [(True, N_BLOCKS), (False, 1)])
def test_one_process_compiles_the_whole_model_as_one_graph(overlap, graphs):
    # With nothing to reduce while backward runs, nothing is gained by handing gradients over
    # block by block, and one graph lets the compiler fuse across the blocks (and the eager
    # stem and head join it).
    torch.manual_seed(0)
    model = compile_model(Stack(), "aot_eager", None, overlap=overlap)
    assert len(compiled_backward_nodes(model(torch.randn(4, 8)))) == graphs
