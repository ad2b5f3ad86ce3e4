"""What a several-GPU run picks when its step is replayed as CUDA graphs with mgpu's reductions
inside: buckets of dist.bucket_cap_mb=auto's captured size, and a compiled model compiled whole
(in torch's default mode) rather than block by block. CPU only: the choices, not the speed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mgpu.comm.engine import MgpuDataParallel
from mgpu.config.checks import ConfigError
from mgpu.config.schema import DistConfig, Engine, TrainerConfig
from mgpu.models import GPT, CompilePlan, ResNet, compile_plan, whole_for_mgpu
from mgpu.run.build import compiled_for
from mgpu.runtime.dist import Runtime
from mgpu.train.trainer import Trainer
from mgpu.train.update_replay import replays_update

ONE = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
CUDA = torch.device("cuda")


def test_bucket_cap_auto_is_larger_only_where_asked_on_one_node_and_a_number_is_kept():
    auto = DistConfig()
    assert auto.bucket_cap(large=False) == 25.0
    assert auto.bucket_cap(large=True) == 100.0
    assert auto.bucket_cap(large=True, one_node=False) == 25.0  # a replay across nodes
    assert auto.bucket_cap(large=True, one_node=False, whole=True) == 256.0
    assert auto.bucket_cap(large=True, whole=True) == 100.0
    assert DistConfig(bucket_cap_mb=50).bucket_cap(True, one_node=False, whole=True) == 50.0
    assert DistConfig(bucket_cap_mb=50).bucket_cap(large=True) == 50.0
    assert DistConfig(bucket_cap_mb=0.5).bucket_cap(large=False) == 0.5


@pytest.mark.parametrize("bad", ["big", 0, -3, True])
def test_a_bad_bucket_cap_names_the_key_and_the_values_it_takes(bad):
    with pytest.raises(ConfigError) as err:
        DistConfig(bucket_cap_mb=bad)
    said = str(err.value)
    assert "dist.bucket_cap_mb" in said and "auto" in said and "25" in said


def wide_mlp() -> nn.Module:
    """Six 12 MiB layers (72 MiB of fp32 gradients): several 25 MiB buckets, few 100 MiB ones."""
    torch.manual_seed(0)
    shapes = [(1024, 3072), (3072, 1024)] * 3
    return nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in shapes))


def bucket_sizes(model: MgpuDataParallel) -> list[int]:
    return [sum(p.numel() for p in b.params) for b in model.reducer.buckets]


def test_use_large_buckets_lays_out_larger_buckets_under_auto_and_keeps_a_given_size():
    auto = MgpuDataParallel(wide_mlp(), ONE, DistConfig(engine=Engine.mgpu))
    uncaptured = bucket_sizes(auto)
    auto.use_large_buckets()
    captured = bucket_sizes(auto)
    layer = 1024 * 3072
    # Each layer is 12 MiB: 25 MiB holds two, 100 MiB holds all but the first 1 MiB bucket's.
    assert max(uncaptured) == 2 * layer and len(uncaptured) > len(captured)
    assert captured == [layer, 5 * layer]
    assert sum(captured) == sum(uncaptured)  # every parameter still in exactly one bucket

    # ranks on several nodes (2 of 4 here): auto keeps 25 MB for the captured step
    two_nodes = Runtime(0, 0, 4, "gloo", torch.device("cpu"), False, local_world_size=2)
    across = MgpuDataParallel(wide_mlp(), two_nodes, DistConfig(engine=Engine.mgpu))
    across.use_large_buckets()
    assert bucket_sizes(across) == uncaptured
    # ... and lays out large ones for a model compiled whole, which a replay's call keeps
    across.use_large_buckets(whole=True)
    assert bucket_sizes(across) == captured
    across.use_large_buckets()
    assert bucket_sizes(across) == captured

    given = MgpuDataParallel(wide_mlp(), ONE, DistConfig(engine=Engine.mgpu, bucket_cap_mb=25))
    before = bucket_sizes(given)
    given.use_large_buckets()
    assert bucket_sizes(given) == before == uncaptured


def test_use_large_buckets_after_a_step_is_refused():
    model = MgpuDataParallel(wide_mlp(), ONE, DistConfig(engine=Engine.mgpu))
    model(torch.randn(2, 1024))  # a step starts at its first forward (GradReducer.prepare)
    with pytest.raises(RuntimeError, match="before the first step"):
        model.use_large_buckets()


def trainer(**kw) -> TrainerConfig:
    return TrainerConfig(compile=True, **kw)


def test_a_compiled_model_is_whole_for_mgpu_where_replayed_or_accumulating():
    assert whole_for_mgpu(trainer(), CUDA, True, True, 0)
    assert whole_for_mgpu(trainer(compile_mode="default", cuda_graphs=True), CUDA, True, True, 0)
    # several micro-batches a step: reduced once after the last backward, captured or not
    assert whole_for_mgpu(trainer(grad_accum_steps=2), CUDA, True, True, 0)
    assert whole_for_mgpu(trainer(grad_accum_steps=4, cuda_graphs=False), CUDA, True, True, 0)
    # each way out: one process, reductions a graph cannot record (dist.shard_optimizer,
    # find_unused, another engine), a CPU, no compile, one micro-batch uncaptured,
    # torch.compile's own CUDA graphs, recomputed blocks
    assert not whole_for_mgpu(trainer(), CUDA, False, True, 0)
    assert not whole_for_mgpu(trainer(), CUDA, True, False, 0)
    assert not whole_for_mgpu(trainer(), torch.device("cpu"), True, True, 0)
    assert not whole_for_mgpu(TrainerConfig(compile=False), CUDA, True, True, 0)
    assert not whole_for_mgpu(trainer(cuda_graphs=False), CUDA, True, True, 0)
    assert not whole_for_mgpu(trainer(compile_mode="reduce-overhead"), CUDA, True, True, 0)
    assert not whole_for_mgpu(trainer(), CUDA, True, True, 2)
    assert not whole_for_mgpu(trainer(grad_accum_steps=2), CUDA, True, True, 2)
    for cfg in (
        DistConfig(engine=Engine.mgpu, shard_optimizer=True),
        DistConfig(engine=Engine.mgpu, find_unused=True),
        DistConfig(engine=Engine.torch_ddp),
        DistConfig(engine=Engine.none),
    ):
        assert not cfg.recordable()
    assert DistConfig(engine=Engine.mgpu).recordable()


def compiled_parts(model: nn.Module) -> list[str]:
    """Which modules torch.compile wrapped in place (Module.compile sets _compiled_call_impl)."""
    return [n or "<model>" for n, m in model.named_modules() if m._compiled_call_impl is not None]


def test_compiled_for_compiles_a_gpt_whole_for_the_replay_or_accumulation_else_by_block():
    def gpt() -> GPT:
        return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)

    mgpu = DistConfig(engine=Engine.mgpu)
    whole = compiled_for(trainer(), mgpu, gpt(), CUDA, True)
    assert compiled_parts(whole) == ["<model>"]
    blocks = compiled_for(trainer(cuda_graphs=False), mgpu, gpt(), CUDA, True)
    assert compiled_parts(blocks) == ["blocks.0", "blocks.1"]
    accumulating = compiled_for(
        trainer(cuda_graphs=False, grad_accum_steps=4), mgpu, gpt(), CUDA, True
    )
    assert compiled_parts(accumulating) == ["<model>"]
    sharded = DistConfig(engine=Engine.mgpu, shard_optimizer=True)
    assert compiled_parts(compiled_for(trainer(), sharded, gpt(), CUDA, True)) == [
        "blocks.0",
        "blocks.1",
    ]
    assert compiled_parts(compiled_for(trainer(), mgpu, gpt(), CUDA, False)) == ["<model>"]


def test_compile_plan_answers_whole_overlap_and_mode_together():
    """The one decision build and the Trainer share: whole and replayed by mgpu (torch's default
    mode), block by block while buckets are reduced, or whole under torch's own CUDA graphs."""
    gpt = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    several = dict(distributed=True, reduces=True, ddp=False, recordable=True)
    assert compile_plan(trainer(), gpt, CUDA, **several) == CompilePlan(True, False, None)
    by_block = CompilePlan(False, True, None)
    assert compile_plan(trainer(), gpt, CUDA, **{**several, "recordable": False}) == by_block
    one = dict(distributed=False, reduces=True, ddp=False, recordable=True)
    assert compile_plan(trainer(), gpt, CUDA, **one) == CompilePlan(False, False, "reduce-overhead")
    # torch DDP: never torch's CUDA graphs unasked (its graph is split at DDP's buckets)
    resnet = ResNet(num_classes=10)  # no repeated blocks: one graph either way
    ddp = dict(distributed=True, reduces=True, ddp=True, recordable=False)
    assert compile_plan(trainer(), resnet, CUDA, **ddp) == CompilePlan(False, True, None)
    ddp_one = {**ddp, "distributed": False}  # a world of one is not wrapped for DDP
    plan = compile_plan(trainer(), resnet, CUDA, **ddp_one)
    assert plan == CompilePlan(False, False, "reduce-overhead")


def test_replay_update_auto_replays_only_where_every_condition_holds():
    """trainer.replay_update=auto: on where the step's backward replays its reductions, with a
    fused optimizer, unsharded and without fp16's scaler; off as soon as one fails."""
    every = dict(backward_replayed=True, fused_optimizer=True, sharded=False, loss_scaled=False)
    assert replays_update("auto", CUDA, **every)
    assert not replays_update(False, CUDA, **every)
    assert not replays_update("auto", torch.device("cpu"), **every)
    for key, failing in [
        ("backward_replayed", False),
        ("fused_optimizer", False),
        ("sharded", True),
        ("loss_scaled", True),
    ]:
        assert not replays_update("auto", CUDA, **{**every, key: failing}), key


@pytest.mark.parametrize(
    ("device", "failing", "said"),
    [
        ("cpu", {}, "needs a CUDA device"),
        ("cuda", {"backward_replayed": False}, "trainer.cuda_graphs"),
        ("cuda", {"fused_optimizer": False}, "fused optimizer"),
        ("cuda", {"sharded": True}, "dist.shard_optimizer"),
        ("cuda", {"loss_scaled": True}, "bf16"),
    ],
)
def test_replay_update_true_where_it_cannot_replay_says_why_and_how_to_go_on(device, failing, said):
    every = dict(backward_replayed=True, fused_optimizer=True, sharded=False, loss_scaled=False)
    with pytest.raises(ConfigError) as err:
        replays_update(True, torch.device(device), **{**every, **failing})
    text = str(err.value)
    assert "trainer.replay_update" in text and said in text and "auto or false" in text


@pytest.mark.parametrize("bad", ["sometimes", 2])
def test_a_bad_replay_update_setting_names_the_key(bad):
    with pytest.raises(ConfigError) as err:
        TrainerConfig(replay_update=bad)
    assert "trainer.replay_update" in str(err.value)


def test_an_update_on_the_cpu_runs_uncaptured_and_true_there_stops():
    """The Trainer on a CPU (the suite's runs): under auto (the default) and false the update
    runs uncaptured; true is an error naming the key and why."""
    model = GPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    assert TrainerConfig().replay_update == "auto"
    for setting in (False, "auto"):
        cfg = TrainerConfig(compile=False, replay_update=setting)
        assert not Trainer(cfg, model, optimizer, schedule, ONE).update.replayed()
    with pytest.raises(ConfigError) as err:
        Trainer(TrainerConfig(compile=False, replay_update=True), model, optimizer, schedule, ONE)
    assert "trainer.replay_update" in str(err.value) and "CUDA" in str(err.value)
