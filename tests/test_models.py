"""Tests for mgpu.models: shapes, GPT causality and tying, FLOP counts, ResNet-50 size, training."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mgpu.models import GPT, MLP, ResNet, count_training_flops

TINY_GPT = {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}
TINY_RESNET = {
    "num_classes": 10,
    "block": "basic",
    "layers": [1, 1, 1, 1],
    "width": 16,
    "stem": "cifar",
}


@pytest.fixture(autouse=True)
def one_thread():
    # these models are tiny: with 2 OpenMP threads on a busy 2-core box, spin-waiting made
    # the ResNet training test 10-60x slower; one thread keeps the file fast and steady
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_gpt_shape_and_tied_weights():
    torch.manual_seed(0)
    model = GPT(**TINY_GPT)
    logits = model(torch.randint(0, 64, (3, 20)))
    assert logits.shape == (3, 20, 64)
    assert model.lm_head.weight is model.wte.weight
    # the tied matrix must count once
    n_unique = len({id(p) for p in model.parameters()})
    assert n_unique == len(list(model.parameters()))
    assert model.num_params() == sum(p.numel() for p in model.state_dict().values()) - 64 * 32


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(**TINY_GPT).eval()
    idx = torch.randint(0, 64, (2, 16))
    t = 9
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 64
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_gpt_rejects_bad_args():
    with pytest.raises(ValueError, match=r"33.*4"):
        GPT(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_embd=33)
    model = GPT(**TINY_GPT)
    with pytest.raises(ValueError, match=r"40.*32"):
        model(torch.zeros(1, 40, dtype=torch.long))


def test_a_head_count_that_does_not_divide_the_width_names_one_that_does():
    from mgpu.config.checks import ConfigError
    from mgpu.models.config import GPTModelConfig

    for n_embd, n_head, fix in [(128, 3, 4), (768, 7, 8), (96, 5, 6), (33, 4, 3)]:
        with pytest.raises(ConfigError) as err:
            GPTModelConfig(n_embd=n_embd, n_head=n_head)
        said = str(err.value)
        assert said.startswith(f"model.n_embd={n_embd}: must be divisible by model.n_head"), said
        assert said.endswith(f"e.g. model.n_head={fix}") and n_embd % fix == 0, said


def test_gpt_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(vocab_size=512, block_size=64, n_layer=8, n_head=4, n_embd=128)
    expected = 0.02 / (2 * 8) ** 0.5
    assert abs(model.blocks[0].mlp.c_proj.weight.std().item() - expected) < 0.2 * expected
    assert abs(model.blocks[0].mlp.c_fc.weight.std().item() - 0.02) < 0.1 * 0.02


def test_gpt_flops_match_counter():
    model = GPT(**TINY_GPT)
    T = 32
    counted = count_training_flops(lambda: GPT(**TINY_GPT), (T,), dtype=torch.long)
    analytic = model.flops_per_sample((T,))
    assert counted > 0
    assert abs(analytic - counted) / counted < 0.15


def test_resnet50_param_count():
    model = ResNet(num_classes=1000)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    assert ResNet.channels_last is True


def test_resnet_zero_inits_last_bn_of_each_block():
    model = ResNet(**TINY_RESNET)
    for block in model.stages:
        assert torch.all(block.body.last_bn.weight == 0)


def test_resnet_tiny_trains():
    torch.manual_seed(0)
    model = ResNet(**TINY_RESNET)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    assert model(x).shape == (8, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_resnet_imagenet_stem_shape_and_flops():
    kwargs = {"num_classes": 7, "block": "bottleneck", "layers": [1, 1], "width": 8}
    model = ResNet(**kwargs)
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 7)
    flops = model.flops_per_sample((3, 64, 64))
    assert flops == count_training_flops(lambda: ResNet(**kwargs), (3, 64, 64))
    assert flops > 0


def test_resnet_flops_of_an_image_whose_last_map_is_one_pixel():
    """ResNet-50 on CIFAR's 32 x 32 images ends in a 1 x 1 map, where batch norm in train mode
    cannot take a batch of one. The count equals the same model's in eval mode on one sample,
    whose batch norm (no matrix multiply either way) accepts it."""
    kwargs = {"num_classes": 10, "block": "bottleneck", "layers": [3, 4, 6, 3], "width": 64}
    counted = ResNet(**kwargs).flops_per_sample((3, 32, 32))
    with torch.device("meta"):
        model, x = ResNet(**kwargs).eval(), torch.randn(1, 3, 32, 32)
    with FlopCounterMode(display=False) as reference:
        model(x).sum().backward()
    assert counted == reference.get_total_flops() > 0


@pytest.mark.parametrize(
    "kwargs, bad",
    [({"block": "wide"}, "wide"), ({"stem": "tiny"}, "tiny"), ({"layers": []}, r"\[\]")],
)
def test_resnet_rejects_bad_args(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        ResNet(num_classes=10, **kwargs)


def test_mlp_shape_and_flops():
    model = MLP(in_features=3 * 8 * 8, num_classes=5, hidden=[32, 16])
    assert model(torch.randn(4, 3, 8, 8)).shape == (4, 5)
    counted = count_training_flops(lambda: MLP(3 * 8 * 8, 5, hidden=[32, 16]), (3, 8, 8))
    assert model.flops_per_sample((3, 8, 8)) == counted


def test_mlp_rejects_wrong_feature_count():
    model = MLP(in_features=100, num_classes=5)
    with pytest.raises(ValueError, match=r"100.*99"):
        model(torch.randn(2, 99))
    with pytest.raises(ValueError, match=r"100.*12"):
        model.flops_per_sample((3, 4))
    with pytest.raises(ValueError, match="-3"):
        MLP(in_features=-3, num_classes=5)


def test_gpt_attention_choices_agree_on_the_cpu_and_bad_ones_are_refused():
    x = torch.randint(0, 64, (2, 20))
    outs = {}
    for attention in ("auto", "torch", "math"):  # cuDNN and flash are GPU kernels (test_fast_path)
        torch.manual_seed(0)
        outs[attention] = GPT(**TINY_GPT, attention=attention)(x)
    torch.testing.assert_close(outs["auto"], outs["math"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["torch"], outs["math"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention='fast': must be one of auto, torch, cudnn"):
        GPT(**TINY_GPT, attention="fast")


@pytest.mark.parametrize(
    "name, n_layer, n_embd, n_head",
    [
        ("gpt2_small", 12, 768, 12),
        ("gpt2_medium", 24, 1024, 16),
        ("gpt2_large", 36, 1280, 20),
        ("gpt2_xl", 48, 1600, 25),
    ],
)
def test_gpt2_configs_have_the_papers_shapes_and_parameter_counts(name, n_layer, n_embd, n_head):
    """model=gpt2_*: GPT-2's shapes, 50257 tokens padded to 50304 rows, built on the meta device
    (no memory) and counted against the count from the shapes: tied embedding, positions, and
    per block two LayerNorm scales and 12 d^2 of attention and MLP weights (no biases)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from mgpu.models import build_model
    from mgpu.run.config import to_config

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = to_config(compose("config", [f"model={name}", "data.vocab_size=50257"])).model
    shape = (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size)
    assert shape == (n_layer, n_embd, n_head, 1024, 50304)
    with torch.device("meta"):
        model = build_model(cfg)
    d, vocab = n_embd, 50304
    expected = vocab * d + 1024 * d + n_layer * (12 * d * d + 2 * d) + d
    assert model.num_params() == expected


def test_the_gpt2_xl_experiment_composes(tmp_path):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from mgpu.config.schema import Precision
    from mgpu.data.prepare import main as prepare_main
    from mgpu.run.config import to_config

    # enough tokens for the experiment's 256 held-out windows of 1024 (the config check's rule)
    (tmp_path / "in.txt").write_text("some text\n" * 27000)
    prepare_main([str(tmp_path / "in.txt"), str(tmp_path / "train.bin")])
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        overrides = ["experiment=gpt2_xl", f"data.path={tmp_path / 'train.bin'}"]
        cfg = to_config(compose("config", overrides))
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.data.seq_len) == (48, 1600, 1024)
    assert cfg.trainer.precision is Precision.bf16
    assert (cfg.data.batch_size, cfg.trainer.grad_accum_steps) == (16, 8)  # 131k tokens a step
    assert cfg.model.residual == "autocast"  # the bf16 stream: 1.039x on one H200


def _bf16_step(residual: str | None, idx: torch.Tensor):
    """One forward and backward of a tiny GPT from seed 0: under bf16 autocast with model.residual
    = `residual`, or in plain fp32 (None). The loss, the gradients, the dtype of what each block
    took in, and the bytes the forward kept for backward."""
    torch.manual_seed(0)
    model = GPT(**TINY_GPT, residual=residual or "fp32")
    seen, kept = [], 0
    for block in model.blocks:
        block.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))

    def pack(tensor):
        nonlocal kept
        kept += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=residual is not None):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, idx)
    loss.backward()
    return loss.item(), [p.grad.float() for p in model.parameters()], set(seen), kept


def test_residual_autocast_keeps_the_stream_in_bf16_and_trains_as_the_fp32_stream_does():
    """model.residual=autocast: under bf16 autocast every block takes in (and adds onto) a bf16
    stream, the forward keeps fewer bytes for backward, and the loss and gradients are as near
    fp32's as those of autocast's own fp32 stream (within a few bf16 roundings of them)."""
    idx = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads, ref_seen, _ = _bf16_step(None, idx)
    runs = {r: _bf16_step(r, idx) for r in ("fp32", "autocast")}
    assert ref_seen == {torch.float32}
    assert runs["fp32"][2] == {torch.float32} and runs["autocast"][2] == {torch.bfloat16}
    assert runs["autocast"][3] < runs["fp32"][3], (runs["autocast"][3], runs["fp32"][3])

    def rel_err(grads):  # over all gradients at once, against the fp32 model's
        num = sum((g - r).norm() ** 2 for g, r in zip(grads, ref_grads, strict=True)) ** 0.5
        return (num / sum(r.norm() ** 2 for r in ref_grads) ** 0.5).item()

    fp32_stream, bf16_stream = rel_err(runs["fp32"][1]), rel_err(runs["autocast"][1])
    assert bf16_stream < 0.05 and bf16_stream < 4 * fp32_stream, (bf16_stream, fp32_stream)
    assert abs(runs["autocast"][0] - ref_loss) < 0.02, (runs["autocast"][0], ref_loss)


def test_residual_setting_is_checked_and_says_when_it_does_nothing(tmp_path, caplog):
    import logging
    from pathlib import Path

    from conftest import run_train
    from hydra import compose, initialize_config_dir

    from mgpu.config.checks import ConfigError
    from mgpu.run.build import build_run
    from mgpu.run.config import resolved_yaml, to_config
    from mgpu.runtime.dist import Runtime

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = to_config(compose("config", ["model.residual=autocast", "trainer.precision=bf16"]))
        assert GPT(**{**cfg.model.model_kwargs(), "vocab_size": 64}).residual == "autocast"
        with pytest.raises(ConfigError, match=r"model\.residual='bf16': must be one of fp32, "):
            to_config(compose("config", ["model.residual=bf16"]))
    with pytest.raises(ValueError, match="residual='half'"):
        GPT(**TINY_GPT, residual="half")
    # trainer.precision=auto on a CPU runs without autocast: the run says the setting does
    # nothing (known once the device is); under bf16 autocast it has something to do
    said = "model.residual=autocast does nothing: trainer.precision=%s runs without autocast on cpu"
    # the loader and the final evaluation play no part: no worker processes, a short one
    run = ["model.residual=autocast", "trainer.max_steps=2", "trainer.eval_every=0"]
    run += ["data.num_workers=0", "data.eval_samples=64"]
    # Where the run decides it, building itself (build_run), in this process as a world of one
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    for precision, warns in (("auto", True), ("bf16", False)):
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            dcfg = compose("config", [*run, f"trainer.precision={precision}"])
        run_dir = tmp_path / precision
        run_dir.mkdir()  # as Hydra makes it
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mgpu"):
            built = build_run(to_config(dcfg), rt, run_dir, resolved_yaml(dcfg))
        built.board.close()
        built.train_loader.close()
        built.eval_loader.close()
        assert ((said % precision) in caplog.text) is warns, caplog.text
    # and a run of train.py says it where users read it, and trains on
    proc = run_train([*run, f"hydra.run.dir={tmp_path / 'launched'}"], cwd=tmp_path, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (said % "auto") in proc.stderr + proc.stdout, proc.stderr[-3000:]


def test_residual_autocast_takes_autocasts_dtype_and_leaves_fp32_runs_alone():
    """The stream takes whatever autocast computes in (fp16 under trainer.precision=fp16), and
    without autocast (fp32 training, sampling) stays fp32."""
    torch.manual_seed(0)
    model = GPT(**TINY_GPT, residual="autocast")
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    model(idx, idx)
    assert seen == [torch.float16, torch.float32]


@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_residual_autocast_compiled_and_checkpointed_has_the_eager_gradients(checkpointing):
    """The bf16 stream traced by torch.compile (one graph, as one process compiles it) and
    recomputed by checkpointed blocks: the gradients of the eager, uncheckpointed model."""
    from mgpu.models import compile_model

    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    grads = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        setting = checkpointing if compiled else "none"
        model = GPT(**TINY_GPT, residual="autocast", activation_checkpointing=setting)
        if compiled:
            compile_model(model, "aot_eager", None, overlap=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)
        loss.backward()
        grads[compiled] = [p.grad for p in model.parameters()]
    for eager, compiled in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
