"""model.head_loss: GPT's head and cross-entropy as one step (mgpu.models.fused_loss) against the
reference, F.cross_entropy over F.linear's logits, in loss and gradients: the op's torch path on
the CPU, its Triton kernel on a GPU; eager and compiled; and through the Trainer."""

import pytest
import torch
import torch.nn.functional as F

from mgpu.config.checks import ConfigError
from mgpu.models import GPT
from mgpu.models.config import GPTModelConfig
from mgpu.models.fused_loss import (
    IGNORE_INDEX,
    LAUNCH_SHAPES,
    cross_entropy_loss_grad,
    linear_cross_entropy,
    loss_grad_cuda,
)


def head_inputs(device, rows=48, width=32, vocab=300, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, width, generator=g).to(device, dtype)
    w = (torch.randn(vocab, width, generator=g) * 0.3).to(device)
    y = torch.randint(0, vocab, (rows,), generator=g)
    y[3] = IGNORE_INDEX  # a masked position: no loss, no gradient
    y[5] = vocab - 1  # the last column, where a block of the kernel ends
    return h.requires_grad_(), w.requires_grad_(), y.to(device)


def loss_and_grads(fn, h, w, y):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, y)
    (loss * 3.0).backward()  # an incoming gradient other than 1 scales both products
    return loss.detach(), h.grad, w.grad


def reference(h, w, y):
    return F.cross_entropy(F.linear(h, w.to(h.dtype)).float(), y)


def test_fused_head_loss_matches_cross_entropy_of_the_logits():
    h, w, y = head_inputs("cpu")
    for ours, theirs in zip(
        loss_and_grads(linear_cross_entropy, h, w, y),
        loss_and_grads(reference, h, w, y),
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_op_gives_each_rows_loss_and_the_gradient_of_their_sum():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 50, generator=g) * 4
    y = torch.randint(0, 50, (7,), generator=g)
    y[0] = IGNORE_INDEX
    loss, grad = cross_entropy_loss_grad(logits, y)
    leaf = logits.clone().requires_grad_()
    ref = F.cross_entropy(leaf, y, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, leaf.grad)
    assert loss[0] == 0 and not grad[0].any()


@pytest.mark.parametrize("head_loss", ["fused", "logits"])
def test_gpt_with_targets_returns_the_loss_of_its_logits_compiled_or_not(head_loss):
    """forward(idx, targets) is the cross-entropy of forward(idx), in value and in gradients,
    also under torch.compile (aot_eager: the graph capture inductor uses, no C++ toolchain)."""
    x = torch.randint(0, 64, (3, 16))
    y = torch.randint(0, 64, (3, 16))
    runs = {}
    for name in ("reference", "eager", "compiled"):
        torch.manual_seed(0)
        model = GPT(64, 16, n_layer=2, n_head=2, n_embd=32, head_loss=head_loss)
        if name == "reference":
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        else:
            step = torch.compile(model, backend="aot_eager") if name == "compiled" else model
            loss = step(x, y)
        loss.backward()
        runs[name] = [loss.detach(), *(p.grad for p in model.parameters())]
    for name in ("eager", "compiled"):
        for ours, theirs in zip(runs[name], runs["reference"], strict=True):
            torch.testing.assert_close(
                ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, k=name: f"{k}: {m}"
            )


def test_a_bad_head_loss_names_the_key():
    with pytest.raises(ConfigError, match="model.head_loss='fast': must be one of auto, fused"):
        GPTModelConfig(head_loss="fast")


@pytest.mark.gpu
def test_fused_head_loss_kernel_matches_the_reference_on_a_gpu():
    """The Triton kernel against the torch path of the same op and against F.cross_entropy of
    bf16 logits under autocast, at GPT-2's vocabulary (a row of 50304 spans several blocks of
    every launch candidate) and under torch.compile with CUDA graphs, as mgpu compiles a GPT on
    one GPU."""
    cuda = torch.device("cuda")
    h, w, y = head_inputs(cuda, rows=512, width=256, vocab=50304)
    logits = (h.detach() @ w.detach().t()).bfloat16()
    loss, grad = cross_entropy_loss_grad(logits, y)
    ref_loss, ref_grad = cross_entropy_loss_grad(logits.cpu(), y.cpu())  # the torch path
    torch.testing.assert_close(loss.cpu(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float().cpu(), ref_grad.float(), rtol=1e-2, atol=1e-5)
    for shape in LAUNCH_SHAPES:  # any of them may become the default (bench/head_loss.py)
        shape_loss, shape_grad = loss_grad_cuda(logits, y, shape)
        torch.testing.assert_close(
            shape_loss, loss, rtol=1e-5, atol=1e-5, msg=lambda m, s=shape: f"{s}: {m}"
        )
        torch.testing.assert_close(
            shape_grad, grad, rtol=1e-2, atol=1e-5, msg=lambda m, s=shape: f"{s}: {m}"
        )

    def autocast(fn):
        def run(h, w, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(h, w, y)

        return run

    theirs = loss_and_grads(autocast(reference), h, w, y)
    compiled = torch.compile(linear_cross_entropy, mode="reduce-overhead")
    for fn in (linear_cross_entropy, compiled):
        for _ in range(3):  # CUDA graphs record on a later call than the first
            ours = loss_and_grads(autocast(fn), h, w, y)
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-3, atol=1e-3)
        for a, b in zip(ours[1:], theirs[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4)


def test_auto_head_loss_avoids_the_fused_head_where_a_whole_compile_miscompiles_it():
    """Which forward takes the fused head: `fused` always; `auto` on a GPU, but not while a
    whole-model compile traces a GPT wider than inductor's persistent reductions with the fp32
    stream under autocast (gpt.FUSED_HEAD_MAX_COMPILED_WIDTH: a racing kernel, measured)."""
    from mgpu.models.gpt import FUSED_HEAD_MAX_COMPILED_WIDTH, fused_head_miscompiles
    from mgpu.models.gpt import takes_fused_head as takes

    wide = FUSED_HEAD_MAX_COMPILED_WIDTH + 64
    assert fused_head_miscompiles(wide, "fp32", autocast=True)
    assert not fused_head_miscompiles(FUSED_HEAD_MAX_COMPILED_WIDTH, "fp32", autocast=True)
    assert not fused_head_miscompiles(wide, "autocast", autocast=True)
    assert not fused_head_miscompiles(wide, "fp32", autocast=False)
    assert takes("auto", on_gpu=True, compiling=False, miscompiles=True)  # eager: fused
    assert not takes("auto", on_gpu=True, compiling=True, miscompiles=True)
    assert takes("auto", on_gpu=True, compiling=True, miscompiles=False)
    assert not takes("auto", on_gpu=False, compiling=False, miscompiles=False)
    assert takes("fused", on_gpu=False, compiling=True, miscompiles=True)  # stopped by the run
    assert not takes("logits", on_gpu=True, compiling=False, miscompiles=False)


def test_the_fused_head_is_at_risk_where_inductor_compiles_a_wide_gpt_whole_for_a_gpu():
    """fused_head_risk: a reason for the wide fp32-stream GPT compiled whole by inductor for a
    GPU under autocast, and none for each way out, on a CPU (inductor writes C++ there), under
    another backend, or on several processes compiled block by block (the head is eager). On
    several processes whose step mgpu replays, or that accumulate micro-batches
    (models.whole_for_mgpu), the model is compiled whole again, and at risk."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from mgpu.run.build import fused_head_risk
    from mgpu.run.config import to_config

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):

        def risk(extra, device="cuda", distributed=False):
            cfg = to_config(compose("config", [*WIDE_FUSED, *extra]))
            return fused_head_risk(cfg, device, distributed)

        said = risk([])
        assert said and "model.n_embd=1088" in said and "trainer.precision=bf16" in said
        assert risk(["model.head_loss=auto"])  # the risk is the graph's; auto avoids it
        assert risk(["trainer.precision=fp8"]) and risk(["trainer.precision=fp16"])
        assert risk(["model.residual=autocast"]) is None
        assert risk(["trainer.compile=false"]) is None
        assert risk(["trainer.precision=fp32"]) is None
        assert risk(["model.n_embd=1024", "model.n_head=16"]) is None
        assert risk(["trainer.compile_backend=aot_eager"]) is None
        assert risk([], device="cpu") is None
        assert risk([], distributed=True)  # compiled whole for mgpu's replay
        assert risk(["trainer.cuda_graphs=false"], distributed=True) is None  # block by block
        # several micro-batches a step: compiled whole, reduced after the last one's backward
        assert risk(["trainer.grad_accum_steps=2"], distributed=True)
        assert risk(["dist.shard_optimizer=true"], distributed=True) is None
        assert risk(["model.activation_checkpointing=blocks"], distributed=True) is None
        assert risk(["dist.engine=none"], distributed=True)  # one graph again


WIDE_FUSED = [
    "model.n_embd=1088",
    "model.n_head=17",
    "model.n_layer=1",
    "trainer.precision=bf16",
    "model.head_loss=fused",
    "trainer.compile=true",
]


@pytest.mark.gpu
def test_a_fused_head_that_would_train_wrong_stops_before_the_run_on_a_gpu(tmp_path):
    """model.head_loss=fused where inductor would compile the racing kernel: one line naming
    the key and the ways out, exit 2, no run directory; `auto` there trains and says why it
    takes the logits."""
    from conftest import run_train

    run_dir = tmp_path / "run"
    proc = run_train([*WIDE_FUSED, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=None)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    (line,) = [x for x in output.splitlines() if "mgpu: config error: " in x]
    assert "model.head_loss='fused': " in line and "model.n_embd=1088" in line, line
    assert "set model.residual=autocast, model.head_loss=logits or trainer.compile=false" in line
    assert not run_dir.exists()
    # model.head_loss=auto there trains, through the logits, and says so
    auto = [*WIDE_FUSED, "model.head_loss=auto", "trainer.max_steps=2", "trainer.eval_every=0"]
    proc = run_train([*auto, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=None)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert output.count("model.head_loss=auto takes the loss through the logits: ") == 1, output


@pytest.mark.gpu
def test_a_wide_gpt_compiled_whole_computes_what_the_eager_one_does_on_a_gpu():
    """model.head_loss=auto where the compiled fused head races: two XL-wide blocks (1600
    channels), 8 x 1024 tokens, fp32 stream, bf16 autocast, compiled whole by inductor as one
    process compiles it. The compiled loss and gradients are the eager model's, run after run.
    With the fused head compiled, this shape gave 5.930-5.933 against eager's 5.955 in four runs
    on an H200 and the head's gradient 3.6-3.7 % off (bench/README.md, job 06:00); at 1 block
    of 1088 channels and 4 x 512 tokens the race did not show."""
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randint(0, 256, (8, 1024), device=cuda)
    y = torch.randint(0, 256, (8, 1024), device=cuda)
    model = GPT(256, 1024, n_layer=2, n_head=25, n_embd=1600, head_loss="auto").to(cuda)
    params = list(model.parameters())

    def loss_and_grads(fn):
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(x, y)
        loss.backward()
        # copies: a CUDA graph's next replay writes over its outputs
        return [loss.detach().clone(), *(p.grad.clone() for p in params)]

    eager = loss_and_grads(model.forward)
    # whole, by inductor, with CUDA graphs, as trainer.compile_mode=auto compiles it on one GPU
    # (Module.compile patches __call__; forward stays eager)
    model.compile(mode="reduce-overhead")
    for _ in range(3):  # the race gave other values on every run; graphs record on the second
        compiled = loss_and_grads(model)
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-4, atol=0)
        for (name, _), ours, theirs in zip(model.named_parameters(), compiled[1:], eager[1:],
                                           strict=True):  # fmt: skip
            err = ((ours - theirs).norm() / theirs.norm()).item()
            assert err < 1e-2, f"{name}: gradient relative error {err:.2e}"
