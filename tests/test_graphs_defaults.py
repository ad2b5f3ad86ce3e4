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
from mgpu.models import GPT, whole_for_mgpu
from mgpu.run.build import compiled_for
from mgpu.runtime.dist import Runtime

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
