"""trainer.precision=fp8: refused in one line, before the run starts, where it cannot run (here:
the CPU); where torchao is installed, its float8 conversion of a GPT (mgpu.train.fp8.convert) trains
forward and backward on the CPU near the unconverted model, with the same checkpoint keys."""

import pytest
import torch
from conftest import FAST, read_scalars, run_train

from mgpu.config.checks import ConfigError
from mgpu.config.schema import FP8_RECIPES, OptimConfig, Precision, TrainerConfig
from mgpu.models import GPT
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.runtime.dist import Runtime
from mgpu.train.fp8 import check_fp8, check_skip, convert
from mgpu.train.trainer import Trainer

SHAPE = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def _trains_near_bf16(model, reference, idx, fp8_moved: float) -> None:
    """One forward and backward of the converted `model` and its bf16 `reference` (same weights)
    under bf16 autocast on idx's device: the losses within 0.05, every gradient finite and
    within 25 % of bf16's, and the first fp8 layer's gradient off bf16's by more than
    `fp8_moved` of its norm (fp8 did run)."""
    losses = {}
    for name, net in (("fp8", model), ("bf16", reference)):
        with torch.autocast(idx.device.type, dtype=torch.bfloat16):
            losses[name] = net(idx, idx)
        losses[name].backward()
    assert abs(losses["fp8"].item() - losses["bf16"].item()) < 0.05, losses
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        # fp8's rounding shows in the gradients (1-7 % of their norm on the CPU shape), within
        # 25 % of bf16's
        assert (p.grad - q.grad).norm() <= 0.25 * q.grad.norm(), name
    c_attn = model.blocks[0].attn.c_attn.weight.grad, reference.blocks[0].attn.c_attn.weight.grad
    assert (c_attn[0] - c_attn[1]).norm() > fp8_moved * c_attn[1].norm()


def test_fp8_on_a_cpu_stops_before_the_run_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        ["trainer.precision=fp8", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        nproc=None,
        env={"CUDA_VISIBLE_DEVICES": ""},  # the CPU, on a GPU machine too
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("mgpu: config error")]
    assert "trainer.precision='fp8'" in line and "device is cpu" in line
    assert "trainer.precision=bf16" in line  # the fix
    assert not run_dir.exists()  # before Hydra made the run directory


def test_a_trainer_built_in_python_refuses_fp8_on_a_cpu():
    with pytest.raises(ConfigError, match=r"trainer\.precision='fp8'.*cpu"):
        check_fp8(torch.device("cpu"))
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    model = GPT(**SHAPE)
    optimizer = build_optimizer(OptimConfig(), model, rt.device)
    schedule = build_schedule(OptimConfig(), optimizer, max_steps=1)
    with pytest.raises(ConfigError, match=r"trainer\.precision='fp8'"):
        Trainer(TrainerConfig(precision=Precision.fp8), model, optimizer, schedule, rt)


def test_torchaos_float8_gpt_trains_on_the_cpu_with_the_same_checkpoint_keys():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    reference = GPT(**SHAPE)
    model = GPT(**SHAPE)
    model.load_state_dict(reference.state_dict())
    convert(model)
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    # every linear layer of every block (attention in and out, MLP in and out), not the tied head
    assert len(converted) == 4 * SHAPE["n_layer"] and "lm_head" not in converted
    assert model.lm_head.weight is model.wte.weight
    assert model.state_dict().keys() == reference.state_dict().keys()
    idx = torch.randint(0, SHAPE["vocab_size"], (4, SHAPE["block_size"]))
    _trains_near_bf16(model, reference, idx, fp8_moved=1e-3)
    # a checkpoint saved under fp8 loads into the model trained under bf16, and back
    reference.load_state_dict(model.state_dict())
    model.load_state_dict(reference.state_dict())


def test_fp8_recipe_and_skip_are_checked_when_the_config_is_built():
    with pytest.raises(ConfigError, match=r"trainer\.fp8_recipe='delayed'.*tensorwise, tens"):
        TrainerConfig(fp8_recipe="delayed")
    with pytest.raises(ConfigError, match=r"trainer\.fp8_skip='\.c_proj'.*attn\.c_proj"):
        TrainerConfig(fp8_skip=[".c_proj"])
    with pytest.raises(ConfigError, match=r"trainer\.fp8_skip='c_proj'.*a list of names"):
        TrainerConfig(precision=Precision.fp8, fp8_skip="c_proj")  # not one name per letter


def test_fp8_settings_under_another_precision_say_they_do_nothing(caplog):
    with caplog.at_level("WARNING", logger="mgpu.config.schema"):
        TrainerConfig(precision=Precision.bf16, fp8_skip=["attn.c_proj"])
    assert "do nothing" in caplog.text and "precision is bf16" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mgpu.config.schema"):
        TrainerConfig(precision=Precision.fp8, fp8_skip=["attn.c_proj"])
        TrainerConfig(precision=Precision.bf16)
    assert "do nothing" not in caplog.text


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_skip_keeps_the_named_layers_in_bf16_under_each_recipe(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = convert(GPT(**SHAPE), recipe, ["attn.c_proj", "c_fc"])
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, kind in kinds.items():
        # a whole-part match only: "c_fc" names mlp.c_fc, and c_proj's in the MLP stay fp8
        kept = name.endswith(("attn.c_proj", "mlp.c_fc")) or name == "lm_head"
        assert (kind is torch.nn.Linear) == kept, (name, kind)
    assert sum(kind is Float8Linear for kind in kinds.values()) == 2 * SHAPE["n_layer"]
    configs = [m.config for m in model.modules() if isinstance(m, Float8Linear)]
    granularity = "tensorwise" if recipe.startswith("tensorwise") else "axiswise"
    assert all(c.cast_config_input.scaling_granularity.value == granularity for c in configs)
    # _with_gw_hp: the weight gradient's operands stay bf16 (their casts are off)
    gw_fp8 = {c.cast_config_input_for_grad_weight.scaling_type.value != "disabled" for c in configs}
    assert gw_fp8 == {not recipe.endswith("_with_gw_hp")}, (recipe, gw_fp8)
    if recipe != "tensorwise":
        # On the CPU only tensorwise runs on every torch: torch 2.11's CPU _scaled_mm takes one
        # scale per tensor only, and rowwise_with_gw_hp's weight gradient multiplies the saved
        # input in CUDA's autocast dtype (fp32 on the CPU) with a bf16 output gradient, which
        # torch.mm refuses there. The GPU test below trains each recipe.
        return
    idx = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["block_size"]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].mlp.c_proj.weight.grad is not None


def test_an_fp8_skip_name_that_matches_no_layer_stops_naming_the_layers():
    # train.py checks the names on a model built on the meta device, before the run starts
    with torch.device("meta"):
        model = GPT(**SHAPE)
    with pytest.raises(ConfigError, match=r"trainer\.fp8_skip='proj'.*attn\.c_proj.*mlp\.c_fc"):
        check_skip(model, ["c_fc", "proj"])
    check_skip(model, ["c_fc", "c_proj", "blocks.1.attn.c_attn"])  # whole parts: no error


def _fp8_gpu():
    """Skips unless this machine has a GPU that runs fp8 matrix multiplies and torchao."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability 8.9 or later")
    pytest.importorskip("torchao.float8")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_each_fp8_recipe_trains_a_gpt_on_the_gpu_near_bf16(recipe):
    _fp8_gpu()
    shape = {**SHAPE, "vocab_size": 256, "block_size": 64, "n_head": 4, "n_embd": 128}
    torch.manual_seed(0)
    reference = GPT(**shape, head_loss="logits").cuda()
    model = GPT(**shape, head_loss="logits").cuda()
    model.load_state_dict(reference.state_dict())
    convert(model, recipe, ["attn.c_proj"])
    idx = torch.randint(0, shape["vocab_size"], (8, shape["block_size"]), device="cuda")
    _trains_near_bf16(model, reference, idx, fp8_moved=1e-4)


@pytest.mark.gpu
def test_train_py_runs_fp8_with_a_recipe_and_skipped_layers_and_stops_on_an_unknown_one(tmp_path):
    _fp8_gpu()
    fp8 = ["model=gpt_tiny", "trainer.precision=fp8", "trainer.fp8_recipe=rowwise", *FAST]
    run_dir = tmp_path / "run"
    proc = run_train(
        [*fp8, "trainer.fp8_skip=[attn.c_proj]", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        nproc=None,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [v for _, v in read_scalars(run_dir)["train/loss"]]
    assert losses[-1] < losses[0], losses
    bad = tmp_path / "bad"
    proc = run_train(
        [*fp8, "trainer.fp8_skip=[attn.c_prj]", f"hydra.run.dir={bad}"], cwd=tmp_path, nproc=None
    )
    assert proc.returncode != 0 and not bad.exists()  # stopped before the run directory
    assert "trainer.fp8_skip='attn.c_prj'" in proc.stdout + proc.stderr
