"""The fast-path settings: clipping inside the fused update matches torch's clip_grad_norm_ and a
separate optimizer step; trainer.compile / compile_mode / tf32 / cudnn_benchmark and
data.num_workers=auto compose, validate with one clear line, and resolve as documented."""

import os

import pytest
import torch
from test_config import compose_config
from torch import nn

from mgpu.config.checks import ConfigError
from mgpu.config.schema import OptimConfig, OptimizerName, Precision, TrainerConfig
from mgpu.data.loader import TRAINER_CORES, worker_count
from mgpu.models import GPT, ResNet, compile_mode, compile_model
from mgpu.optim.optimizer import build_optimizer, build_schedule, param_groups
from mgpu.run.config import to_config
from mgpu.runtime.dist import Runtime
from mgpu.train.graphs import reduction_in_graphs, unreplayed_hooks, use_graphs
from mgpu.train.model_loss import ModelLoss
from mgpu.train.numerics import set_math_modes
from mgpu.train.replay_checks import Signature, difference
from mgpu.train.trainer import Trainer

CPU = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
STEPS, CLIP = 6, 0.05


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 5))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g))] * STEPS


@pytest.mark.parametrize("name", [OptimizerName.adamw, OptimizerName.sgd])
def test_clipping_in_the_fused_update_matches_clip_grad_norm(name):
    ocfg = OptimConfig(name=name, lr=0.1, warmup_steps=0, min_lr_ratio=1.0)
    model = net()
    optimizer = build_optimizer(ocfg, model, CPU.device)
    schedule = build_schedule(ocfg, optimizer, STEPS)
    tcfg = TrainerConfig(grad_clip=CLIP, precision=Precision.fp32)
    trainer = Trainer(tcfg, model, optimizer, schedule, CPU)
    data = batches()
    trainer.train_step(iter(data))

    # The reference: torch's clip_grad_norm_, then the same optimizer's own step.
    reference = net()
    kwargs = dict(lr=0.1, weight_decay=ocfg.weight_decay)
    groups = param_groups(reference, ocfg.weight_decay)
    if name is OptimizerName.adamw:
        ref_opt = torch.optim.AdamW(
            groups, betas=tuple(ocfg.betas), eps=ocfg.eps, fused=True, **kwargs
        )
    else:
        ref_opt = torch.optim.SGD(groups, momentum=ocfg.momentum, fused=True, lr=0.1)
    x, y = data[0]
    norms = []
    for step in range(STEPS):
        if step:
            trainer.train_step(iter(data))
        loss = nn.functional.cross_entropy(reference(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert min(norms) > CLIP  # clipping was active at every step: the case under test
    for (key, ours), theirs in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=key)


def test_compile_and_math_keys_compose_with_their_defaults():
    cfg = to_config(compose_config()).trainer
    assert cfg.compile == "auto" and cfg.compile_mode == "auto"
    assert cfg.compile_backend == "inductor" and cfg.tf32 and cfg.cudnn_benchmark
    assert not cfg.compiles("cpu") and cfg.compiles("cuda")
    on = to_config(compose_config("trainer.compile=true")).trainer
    assert on.compile is True and on.compiles("cpu")
    off = to_config(compose_config("trainer.compile=false")).trainer
    assert off.compile is False and not off.compiles("cuda")
    assert to_config(compose_config()).data.num_workers == "auto"
    assert to_config(compose_config("data.num_workers=3")).data.num_workers == 3


@pytest.mark.parametrize(
    "override, needle",
    [
        ("trainer.compile=sometimes", "trainer.compile='sometimes': must be auto, true or false"),
        ("trainer.compile_mode=fast", "trainer.compile_mode='fast': must be one of auto"),
        ("data.num_workers=many", "data.num_workers='many': must be auto or a number"),
        ("data.num_workers=-2", "data.num_workers=-2: must be auto or a number"),
        ("trainer.cuda_graphs=always", "trainer.cuda_graphs='always': must be auto, true or"),
        (
            "trainer.deterministic=true",
            "trainer.cudnn_benchmark=True: picks cuDNN's convolution algorithms by their speed",
        ),
    ],
)
def test_bad_fast_path_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        to_config(compose_config(override))
    assert needle in str(err.value)


def test_an_unknown_compile_backend_names_the_key():
    with pytest.raises(ConfigError, match="trainer.compile_backend='inductr': is not a torch"):
        compile_model(nn.Linear(2, 2), "inductr")


def test_cuda_graphs_of_a_block_by_block_compile_are_refused():
    gpt = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    with pytest.raises(ConfigError, match="trainer.compile_mode='reduce-overhead': replays"):
        compile_mode("reduce-overhead", "inductor", gpt, torch.device("cuda"))


def test_cuda_graphs_need_inductor():
    with pytest.raises(ConfigError, match="needs trainer.compile_backend=inductor"):
        TrainerConfig(compile_mode="reduce-overhead", compile_backend="aot_eager")


def test_a_bad_math_key_stops_at_composition():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="trainer.tf32=maybe"):
        compose_config("trainer.tf32=maybe")


def test_compile_mode_auto_graphs_whole_models_on_gpus_only():
    gpt = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    resnet = ResNet(num_classes=10, block="basic", layers=[1, 1])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_mode("auto", "inductor", resnet, cuda) == "reduce-overhead"
    assert compile_mode("auto", "inductor", resnet, cpu) is None
    assert compile_mode("auto", "inductor", resnet, cuda, ddp=True) is None
    assert compile_mode("auto", "aot_eager", resnet, cuda) is None
    assert compile_mode("auto", "inductor", gpt, cuda) is None  # compiled block by block
    # One process (nothing reduced while backward runs): GPT is compiled whole, as graphs too.
    assert compile_mode("auto", "inductor", gpt, cuda, overlap=False) == "reduce-overhead"
    assert compile_mode("auto", "inductor", gpt, cpu, overlap=False) is None
    assert compile_mode("default", "inductor", resnet, cuda) is None
    assert compile_mode("max-autotune-no-cudagraphs", "inductor", gpt, cuda) == (
        "max-autotune-no-cudagraphs"
    )
    assert compile_mode("reduce-overhead", "inductor", resnet, cuda) == "reduce-overhead"
    # Several micro-batches a step: a replay would overwrite the last one's gradients.
    assert compile_mode("auto", "inductor", resnet, cuda, accum=2) is None
    assert compile_mode("auto", "inductor", gpt, cuda, overlap=False, accum=16) is None


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_with_accumulation_are_refused(mode):
    with pytest.raises(ConfigError) as err:
        to_config(compose_config(f"trainer.compile_mode={mode}", "trainer.grad_accum_steps=4"))
    why = str(err.value)
    assert f"trainer.compile_mode='{mode}'" in why and "trainer.grad_accum_steps=4" in why
    assert "max-autotune-no-cudagraphs" in why  # says what to set instead
    cfg = to_config(compose_config(f"trainer.compile_mode={mode}", "trainer.grad_accum_steps=1"))
    assert cfg.trainer.compile_mode == mode


def test_cuda_graphs_auto_replays_uncompiled_unwrapped_models_on_gpus_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_graphs("auto", cuda, compiled=False, wrapped=False)
    assert not use_graphs("auto", cpu, compiled=False, wrapped=False)
    assert not use_graphs("auto", cuda, compiled=True, wrapped=False)
    assert not use_graphs("auto", cuda, compiled=False, wrapped=True)
    assert not use_graphs(False, cuda, compiled=False, wrapped=False)
    assert use_graphs(True, cuda, compiled=False, wrapped=False)
    assert to_config(compose_config()).trainer.cuda_graphs == "auto"
    assert to_config(compose_config("trainer.cuda_graphs=false")).trainer.cuda_graphs is False


def test_cuda_graphs_record_mgpus_reductions_unless_off():
    """A model whose reducer the capture can record replays under auto and true (compiled block
    by block or not) and not under false; recompute of checkpointed blocks still refuses under
    true and stays uncaptured under auto; a wrapped model whose reduction cannot be recorded
    stays uncaptured under auto."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for compiled in (False, True):
        assert use_graphs(True, cuda, compiled, wrapped=True, captures_reduction=True)
        assert use_graphs("auto", cuda, compiled, wrapped=True, captures_reduction=True)
        assert not use_graphs("auto", cuda, compiled, wrapped=True, captures_reduction=False)
    assert not use_graphs("auto", cpu, False, wrapped=True, captures_reduction=True)
    assert not use_graphs(
        "auto", cuda, False, wrapped=True, checkpointed=2, captures_reduction=True
    )
    assert not use_graphs(False, cuda, False, wrapped=True, captures_reduction=True)
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        use_graphs(True, cuda, False, wrapped=True, checkpointed=2, captures_reduction=True)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        use_graphs(True, cpu, False, wrapped=True, captures_reduction=True)
    # what reduction_in_graphs refuses before asking the reducer: no mgpu wrapper, one process,
    # micro-batches, or CUDA graphs of torch.compile's own
    plain = torch.nn.Linear(2, 2)
    assert not reduction_in_graphs(plain, distributed=True, accum=1, own_graphs=False)


@pytest.mark.parametrize(
    "device, compiled, wrapped, needle",
    [
        ("cpu", False, False, "needs a CUDA device (this run is on cpu)"),
        ("cuda", True, False, "set trainer.compile=false or trainer.cuda_graphs=auto"),
        ("cuda", False, True, "only with dist.engine=mgpu on several processes"),
    ],
)
def test_cuda_graphs_true_where_they_cannot_run_says_why(device, compiled, wrapped, needle):
    with pytest.raises(ConfigError, match="trainer.cuda_graphs=True: ") as err:
        use_graphs(True, torch.device(device), compiled=compiled, wrapped=wrapped)
    assert needle in str(err.value)


def test_hooks_a_replay_would_not_run_are_named():
    model = net()
    assert unreplayed_hooks(model) == []
    handles = [
        model[0].register_forward_hook(lambda *_: None),
        model[2].weight.register_hook(lambda g: g * 2),  # recorded, then run again: 4x
    ]
    found = unreplayed_hooks(model)
    assert found == ["module hooks on 0", "a gradient hook on 2.weight"], found
    for handle in handles:
        handle.remove()
    # Run by autograd after it accumulates a gradient, which a replay leaves to it: fine.
    model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    assert unreplayed_hooks(model) == []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: None)
    try:
        assert unreplayed_hooks(model) == ["global module forward pre hooks"]
    finally:
        handle.remove()


def test_the_per_step_signature_sees_every_change_a_fresh_walk_sees():
    """A replay's per-step check lists the module tree once; after each change a replay must not
    miss, it equals the signature of a fresh walk of the tree (the reference) and differs from
    the captured one, naming what changed."""
    model = net()
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    cached = Signature(model)
    captured = cached(x, y)
    assert captured == Signature(model)(x, y)
    changes = {
        "a module's train/eval mode": lambda: model[1].eval(),
        "which parameters take gradients": lambda: model[0].bias.requires_grad_(False),
        "the storage of a parameter or buffer": lambda: setattr(
            model[2].weight, "data", model[2].weight.data.clone()
        ),
        "a submodule replaced": lambda: model.__setitem__(2, nn.Linear(32, 5)),
        "load_state_dict(assign=True)": lambda: model.load_state_dict(
            {k: v.clone() for k, v in model.state_dict().items()}, assign=True
        ),
        "a buffer registered": lambda: model[0].register_buffer("seen", torch.zeros(3)),
    }
    for what, change in changes.items():
        before = cached(x, y)
        change()
        now = cached(x, y)
        assert now == Signature(model)(x, y), what
        assert now != before, what
        assert difference(before, now), what
    batch = cached(torch.randn(5, 8), y)
    assert difference(now, batch).startswith("batch shapes"), difference(now, batch)


def test_a_trainer_on_the_cpu_refuses_cuda_graphs_and_runs_eager_under_auto():
    ocfg = OptimConfig()
    model = net()
    optimizer = build_optimizer(ocfg, model, CPU.device)
    schedule = build_schedule(ocfg, optimizer, STEPS)
    auto = Trainer(TrainerConfig(), model, optimizer, schedule, CPU)
    assert isinstance(auto.forward_loss, ModelLoss)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        Trainer(TrainerConfig(cuda_graphs=True), model, optimizer, schedule, CPU)


def test_auto_workers_share_the_cpus_out_and_leave_the_trainer_its_own():
    cpus = len(os.sched_getaffinity(0))
    assert worker_count(5, 16) == 5
    assert worker_count("auto", 16) == 16 - TRAINER_CORES
    assert worker_count("auto", 1) == 1  # never none: the loop would fetch its own data
    two = Runtime(0, 0, 2, "gloo", torch.device("cpu"), has_process_group=True, local_world_size=2)
    assert two.cpu_share == cpus // 2
    # Counted before dist.cpu_affinity pinned the process to its share: not divided again.
    pinned = Runtime(0, 0, 8, "nccl", torch.device("cpu"), True, local_world_size=8, cpus=16)
    assert worker_count("auto", pinned.cpu_share) == 14


def test_distributed_records_this_process_cpu_share():
    from mgpu.runtime.dist import distributed

    with distributed("gloo", timeout_s=60, cpu_affinity=True) as rt:  # a world of one
        assert rt.cpus == len(os.sched_getaffinity(0)) == rt.cpu_share


@pytest.mark.gpu
def test_default_compiled_run_on_a_gpu_trains_like_eager_and_resumes(tmp_path):
    """train.py's defaults on one GPU: compile on (the ResNet whole, replayed as CUDA graphs; the
    loss its own region), TF32 and cuDNN autotuning, auto workers. It trains as the eager run
    does, evaluates, checkpoints, and a second launch resumes from its checkpoint."""
    from conftest import read_scalars, run_train, together

    base = [
        "model=resnet_tiny",
        "data=images",
        "optim=sgd",
        "trainer.max_steps=40",
        "trainer.log_every=10",
        "trainer.eval_every=20",
        "ckpt.every=20",
        "data.eval_samples=256",
    ]
    runs = {"compiled": [], "eager": ["trainer.compile=false"]}

    def launch(name: str):
        args = [*base, *runs[name], f"hydra.run.dir={tmp_path / name}"]
        return lambda: run_train(args, cwd=tmp_path, nproc=None)

    losses = {}
    # the eager run trains while the other compiles, on the same GPU
    for name, proc in zip(runs, together(*map(launch, runs)), strict=True):
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[name] = [v for _, v in read_scalars(tmp_path / name)["eval/loss"]]
    assert losses["compiled"][-1] < losses["compiled"][0]  # it learns
    # bf16 kernels differ between the compiled and eager steps: close, not equal
    assert losses["compiled"][-1] == pytest.approx(losses["eager"][-1], rel=0.1), losses
    resumed = run_train(
        [*base, "trainer.max_steps=60", f"hydra.run.dir={tmp_path / 'compiled'}"],
        cwd=tmp_path,
        nproc=None,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [s for s, _ in read_scalars(tmp_path / "compiled")["eval/loss"]]
    assert steps[-1] == 60 and 40 in steps


@pytest.mark.gpu
def test_gpt_attention_kernels_match_the_math_reference_on_a_gpu():
    """model.attention picks the SDPA kernel; each (auto: cuDNN first) gives what the plain math
    kernel gives, forward and backward, in bf16 on GPT-2's head width (64)."""
    cuda = torch.device("cuda")
    x = torch.randint(0, 64, (4, 128), device=cuda)
    results = {}
    for attention in ("math", "auto", "cudnn", "flash", "torch"):
        torch.manual_seed(0)
        model = GPT(64, 128, n_layer=2, n_head=4, n_embd=256, attention=attention).to(cuda)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
        loss.backward()
        results[attention] = (loss.detach(), [p.grad.float() for p in model.parameters()])
    ref_loss, ref_grads = results.pop("math")
    for attention, (loss, grads) in results.items():
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2, msg=attention)
        for ours, theirs in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=5e-2, atol=2e-3, msg=attention)


def test_deterministic_turns_torchs_deterministic_kernels_on_and_off(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    on = to_config(compose_config("trainer.deterministic=true", "trainer.cudnn_benchmark=false"))
    try:
        set_math_modes(on.trainer, torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # before cuBLAS's workspace
    finally:
        set_math_modes(to_config(compose_config()).trainer, torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()
