"""model.activation_checkpointing: GPT's checkpointed blocks train as the uncheckpointed model
does, bit for bit on CPU (two gloo processes under mgpu's reducer: gradient accumulation,
dist.shard_optimizer, the first N blocks), buckets still launch between the blocks while they
recompute, a run resumes across checkpointing on and off bit for bit, the whole model compiled
as one graph keeps the same gradients, and the combinations that cannot work stop naming the
keys."""

import logging
from pathlib import Path

import pytest
import torch
from conftest import free_port, gloo_runtime, spawn
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader, TensorDataset

from mgpu.comm.engine import MgpuDataParallel, wrap_model
from mgpu.comm.sharded_optim import ShardedOptimizer
from mgpu.config.checks import ConfigError
from mgpu.config.schema import DistConfig, OptimConfig, Precision, TrainerConfig
from mgpu.data.sampler import ShardedSampler
from mgpu.models import GPT, compile_model
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.run.config import to_config
from mgpu.telemetry.board import TensorBoard
from mgpu.telemetry.metrics import Recorder
from mgpu.train.graphs import use_graphs
from mgpu.train.trainer import Trainer

# 4 steps: past the warmup (2), resumed half-way with AdamW's moments in the state; every step
# costs the ranks a collective per parameter (a bucket each), and bit-for-bit needs no more.
WORLD, STEPS, MICRO = 2, 4, 4
SHAPE = {"vocab_size": 64, "block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 32}
ROOT = Path(__file__).resolve().parents[1]

# name: (model.activation_checkpointing, grad_accum_steps, dist.shard_optimizer)
CASES = {
    "none": ("none", 2, False),
    "blocks": ("blocks", 2, False),
    "first_one": (1, 2, False),
    "none_sharded": ("none", 2, True),
    "blocks_sharded": ("blocks", 2, True),
    "none_one_micro": ("none", 1, False),
    "blocks_one_micro": ("blocks", 1, False),
}


def tokens(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, SHAPE["vocab_size"], (n, SHAPE["block_size"] + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def build(rt, checkpointing, accum: int, shard: bool):
    """A GPT trained as train.py trains it (fp32, AdamW, clipping), and its loader."""
    torch.manual_seed(0)
    model = GPT(**SHAPE, activation_checkpointing=checkpointing)
    ocfg = OptimConfig(lr=1e-2, warmup_steps=2)
    optimizer = build_optimizer(ocfg, model, rt.device)
    # a bucket per parameter: as many launches during backward as there can be
    model = wrap_model(model, DistConfig(bucket_cap_mb=1e-6, shard_optimizer=shard), rt)
    if shard:
        optimizer = ShardedOptimizer(optimizer, model.reducer.shards)
    schedule = build_schedule(ocfg, optimizer, max_steps=STEPS)
    tcfg = TrainerConfig(
        precision=Precision.fp32, grad_accum_steps=accum, max_steps=STEPS, log_every=3,
        eval_every=0, grad_clip=0.5,
    )  # fmt: skip
    recorder = Recorder(rt, TensorBoard(Path("."), enabled=False), samples_per_step=MICRO,
                        tokens_per_sample=None, max_steps=STEPS)  # fmt: skip
    trainer = Trainer(tcfg, model, optimizer, schedule, rt, recorder=recorder)
    data = tokens()
    sampler = ShardedSampler(len(data), rt.rank, rt.world_size, shuffle=True, seed=0, even=True)
    return trainer, DataLoader(data, batch_size=MICRO, sampler=sampler)


def watch_blocks(model: MgpuDataParallel, seen: list) -> None:
    """At the start of each block's backward (its output's gradient node, which runs before the
    block recomputes), note how many buckets the reducer has launched, in backward's order."""
    reducer = model.reducer

    def hook(_block, _inputs, output):
        output.grad_fn.register_prehook(lambda _grads: seen.append(reducer.next_launch))

    for block in model.module.blocks:
        block.register_forward_hook(hook)


def params(trainer: Trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.module.state_dict().items()}


def worker(rank: int, port: int, out_dir: str):
    with gloo_runtime(rank, port, WORLD) as rt:
        results = {}
        for name, case in CASES.items():
            trainer, loader = build(rt, *case)
            seen: list[int] = []
            watch_blocks(trainer.model, seen)
            trainer.fit(loader, None)
            results[name] = {"params": params(trainer), "launched": seen}
        # Resume across checkpointing on and off: half the steps one way, the state_dict into a
        # trainer the other way, the rest; sharded, so the state is gathered and resharded.
        for first, then in (("blocks", "none"), ("none", "blocks")):
            trainer, loader = build(rt, first, 2, True)
            trainer.cfg.max_steps = STEPS // 2
            trainer.fit(loader, None)
            state = trainer.state_dict()
            trainer, loader = build(rt, then, 2, True)
            trainer.load_state_dict(state)
            trainer.fit(loader, None)
            results[f"{first}_then_{then}"] = {"params": params(trainer)}
        torch.save(results, f"{out_dir}/{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("activation_checkpointing")
    spawn(worker, free_port(), str(out), nprocs=WORLD)
    return [torch.load(out / f"{rank}.pt", weights_only=True) for rank in range(WORLD)]


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key}"


@pytest.mark.parametrize(
    "checkpointed, reference",
    [
        ("blocks", "none"),  # accumulation over 2 micro-batches
        ("first_one", "none"),
        ("blocks_sharded", "none_sharded"),
        ("blocks_one_micro", "none_one_micro"),
    ],
)
def test_checkpointed_blocks_train_bit_for_bit_as_uncheckpointed_ones(
    results, checkpointed, reference
):
    for rank in range(WORLD):
        got, want = results[rank][checkpointed]["params"], results[rank][reference]["params"]
        assert_same(got, want, f"rank {rank}, {checkpointed} against {reference}")
    # not a vacuous comparison: training moved the parameters away from where they started
    torch.manual_seed(0)
    start = GPT(**SHAPE).state_dict()
    moved = results[0][reference]["params"]
    assert all(not torch.equal(moved[k], v) for k, v in start.items())


def test_buckets_launch_between_checkpointed_blocks_as_they_recompute(results):
    # ln_f's bucket launches before the last block's backward starts, then each block's 6
    # parameters' buckets before the block in front of it starts: per step, blocks 2, 1, 0.
    per_step = [1 + 6 * k for k in range(SHAPE["n_layer"])]
    for rank in range(WORLD):
        for name in ("blocks_one_micro", "none_one_micro"):
            assert results[rank][name]["launched"] == per_step * STEPS, name
        # With accumulation the first micro-batch of a step launches nothing (no_sync).
        accumulated = results[rank]["blocks"]["launched"]
        assert accumulated == ([0] * SHAPE["n_layer"] + per_step) * STEPS


@pytest.mark.parametrize("order", ["blocks_then_none", "none_then_blocks"])
def test_a_run_resumes_across_checkpointing_on_and_off_bit_for_bit(results, order):
    for rank in range(WORLD):
        got = results[rank][order]["params"]
        assert_same(got, results[rank]["none_sharded"]["params"], f"rank {rank}, {order}")


def saved_tensors(model: GPT) -> int:
    """How many tensors one training forward keeps for backward."""
    count = 0

    def pack(tensor):
        nonlocal count
        count += 1
        return tensor

    idx = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["block_size"]))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return count


def test_checkpointed_blocks_keep_less_for_backward():
    settings = ("none", 1, "blocks")
    counts = [saved_tensors(GPT(**SHAPE, activation_checkpointing=c)) for c in settings]
    assert counts[0] > counts[1] > counts[2], counts


def test_a_checkpointed_model_compiled_whole_has_the_same_gradients():
    """One process compiles the whole model as one graph (mgpu.models.compile_model): the
    checkpointed blocks inside it, one compiled backward, the gradients of the eager model."""
    from test_compile import compiled_backward_nodes

    idx = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["block_size"]))
    grads = {}
    for checkpointing, compiled in (("none", False), ("blocks", True)):
        torch.manual_seed(0)
        # two blocks are already several checkpointed regions in one graph; compile time grows
        # with every block
        model = GPT(**{**SHAPE, "n_layer": 2}, activation_checkpointing=checkpointing)
        if compiled:
            compile_model(model, "aot_eager", None, overlap=False)
        loss = model(idx, idx)
        assert len(compiled_backward_nodes(loss)) == (1 if compiled else 0)
        loss.backward()
        grads[compiled] = [p.grad for p in model.parameters()]
    for eager, compiled in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


def test_cuda_graphs_leave_checkpointed_blocks_uncaptured_or_refuse(caplog):
    cuda = torch.device("cuda")  # only a device object: use_graphs decides, nothing runs
    with caplog.at_level(logging.INFO, logger="mgpu.train.graphs"):
        assert not use_graphs("auto", cuda, compiled=False, wrapped=False, checkpointed=3)
    assert "model.activation_checkpointing" in caplog.text
    assert use_graphs("auto", cuda, compiled=False, wrapped=False, checkpointed=0)  # control
    with pytest.raises(ConfigError) as err:
        use_graphs(True, cuda, compiled=False, wrapped=False, checkpointed=3)
    message = str(err.value)
    assert "trainer.cuda_graphs" in message and "model.activation_checkpointing" in message
    assert "\n" not in message


def compose_config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def test_the_setting_composes_and_bad_values_name_the_keys():
    for value, blocks in (("none", 0), ("blocks", 2), ("1", 1)):
        model = compose_config(f"model.activation_checkpointing={value}").model
        assert GPT(**{**model.model_kwargs(), "vocab_size": 256}).checkpointed == blocks
    with pytest.raises(ConfigError, match=r"model\.activation_checkpointing=3: .*model\.n_layer"):
        compose_config("model.activation_checkpointing=3")  # gpt_tiny has 2 blocks
    with pytest.raises(ConfigError, match=r"model\.activation_checkpointing='some'"):
        compose_config("model.activation_checkpointing=some")
    resnet = ["model=resnet_tiny", "data=images", "model.activation_checkpointing=blocks"]
    with pytest.raises(ConfigError, match=r"model\.activation_checkpointing=.*GPT"):
        compose_config(*resnet)
    mlp = ["model=mlp", "data=images", "+model.activation_checkpointing=blocks"]
    with pytest.raises(ConfigError, match=r"model\.activation_checkpointing"):
        compose_config(*mlp)


def test_recomputed_blocks_draw_the_same_dropout_masks():
    """The recompute restores the RNG state the block's forward saw: with dropout on, a
    checkpointed model's gradients are the uncheckpointed model's, bit for bit."""
    idx = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["block_size"]))
    grads = {}
    for checkpointing in ("none", "blocks"):
        torch.manual_seed(0)
        model = GPT(**SHAPE, dropout=0.2, activation_checkpointing=checkpointing)
        torch.manual_seed(1)  # the same masks' draws for both
        model(idx, idx).backward()
        grads[checkpointing] = [p.grad for p in model.parameters()]
    for plain, checkpointed in zip(grads["none"], grads["blocks"], strict=True):
        assert torch.equal(plain, checkpointed)
    torch.manual_seed(0)  # the control: the same model, other masks, other gradients
    model = GPT(**SHAPE, dropout=0.2)
    torch.manual_seed(2)
    model(idx, idx).backward()
    assert not torch.equal(model.wte.weight.grad, grads["none"][0])
