"""trainer.cuda_graphs on a GPU: the Trainer replaying an uncompiled model's forward, loss and
backward as CUDA graphs trains exactly as the same Trainer launching them eagerly, step for step:
the losses, the parameters, BatchNorm's running statistics (which the capture's warm-up must not
move) and dropout's masks, with one and with several micro-batches a step (whose gradients a
replay must not overwrite before they are summed), with a batch of another shape among them, and
while another thread copies on a stream of its own, as the loader's copy thread does."""

import threading

import pytest
import torch
from torch import nn

from mgpu.config.schema import OptimConfig, OptimizerName, Precision, TrainerConfig
from mgpu.models import GPT, ResNet
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.runtime.dist import Runtime
from mgpu.train.graphs import CaptureError, GraphedLoss
from mgpu.train.model_loss import ModelLoss
from mgpu.train.numerics import set_math_modes
from mgpu.train.trainer import Trainer

pytestmark = pytest.mark.gpu
STEPS = 6


def runtime() -> Runtime:
    return Runtime(0, 0, 1, "gloo", torch.device("cuda"), has_process_group=False)


def resnet() -> nn.Module:
    model = ResNet(num_classes=10, block="basic", layers=[1, 1])
    return model.to(memory_format=torch.channels_last)


def gpt(dropout: float = 0.0) -> nn.Module:
    return GPT(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=dropout)


def gpt_dropout() -> nn.Module:
    return gpt(dropout=0.2)


def image_batches(n: int, size: int = 32):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(8, 3, size, size, generator=g).cuda()
        y = torch.randint(0, 10, (8,), generator=g).cuda()
        out.append((x.contiguous(memory_format=torch.channels_last), y))
    return out


def token_batches(n: int, length: int = 32):
    g = torch.Generator().manual_seed(1)
    return [
        tuple(torch.randint(0, 64, (4, length), generator=g).cuda() for _ in range(2))
        for _ in range(n)
    ]


def train(make_model, batches, graphs, precision: Precision, accum: int = 1, before_step=None):
    """STEPS steps of the Trainer from the same initial weights; the losses, parameters and
    buffers after, and which forward it used. before_step(model, step) runs before each step."""
    rt = runtime()
    set_math_modes(TrainerConfig(tf32=False, cudnn_benchmark=False), rt.device)
    torch.manual_seed(0)
    model = make_model().cuda()
    # SGD: an update proportional to the gradient, so that the last bits in which two runs of
    # the same kernels may differ (atomic sums in BatchNorm's backward) stay in the last bits.
    # AdamW scales a gradient near zero up to a full step of the learning rate, either way.
    ocfg = OptimConfig(name=OptimizerName.sgd, lr=0.05, warmup_steps=0, min_lr_ratio=1.0)
    optimizer = build_optimizer(ocfg, model, rt.device)
    cfg = TrainerConfig(
        compile=False,
        cuda_graphs=graphs,
        precision=precision,
        grad_accum_steps=accum,
        grad_clip=1.0,
        max_steps=STEPS,
    )
    trainer = Trainer(cfg, model, optimizer, build_schedule(ocfg, optimizer, STEPS), rt)
    model.train()
    feed = iter(batches)
    losses = []
    for step in range(1, STEPS + 1):
        if before_step is not None:
            before_step(model, step)
        losses.append(trainer.train_step(feed, step)[0])
    torch.cuda.synchronize()
    kind = type(trainer.forward_loss)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return torch.stack(losses), state, kind


CASES = {
    "resnet_fp32": (resnet, image_batches, Precision.fp32, 1),
    "resnet_bf16_accum2": (resnet, image_batches, Precision.bf16, 2),
    "resnet_fp16": (resnet, image_batches, Precision.fp16, 1),  # GradScaler on replayed grads
    "gpt_bf16": (gpt, token_batches, Precision.bf16, 1),
    "gpt_fp32_accum3": (gpt, token_batches, Precision.fp32, 3),
    # The replays draw the masks eager steps draw: the capture's warm-up leaves the RNG as it was.
    "gpt_dropout_fp32": (gpt_dropout, token_batches, Precision.fp32, 1),
}


def assert_same_training(ours, theirs) -> None:
    """Losses, parameters and buffers (BatchNorm's running statistics among them) alike."""
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    assert ours[1].keys() == theirs[1].keys()
    for key, value in ours[1].items():
        torch.testing.assert_close(value, theirs[1][key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("case", list(CASES))
def test_a_replayed_step_trains_as_the_eager_step(case):
    make_model, make_batches, precision, accum = CASES[case]
    batches = make_batches(STEPS * accum)
    eager = train(make_model, batches, False, precision, accum)
    graphed = train(make_model, batches, True, precision, accum)
    assert eager[2] is ModelLoss and graphed[2] is GraphedLoss  # the two paths under test
    assert_same_training(graphed, eager)


def test_a_batch_of_another_shape_runs_uncaptured_and_trains_as_eager():
    batches = image_batches(STEPS)
    batches[3] = image_batches(1, size=40)[0]  # one batch the graphs were not captured for
    eager = train(resnet, batches, False, Precision.fp32)
    assert_same_training(train(resnet, batches, True, Precision.fp32), eager)


def freeze_batchnorm_from_step_4(model: nn.Module, step: int) -> None:
    if step == 4:  # after the capture: BatchNorm in eval mode, its statistics frozen
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()


def test_a_module_put_in_eval_mode_after_the_capture_runs_uncaptured():
    batches = image_batches(STEPS)
    eager = train(resnet, batches, False, Precision.fp32, before_step=freeze_batchnorm_from_step_4)
    graphed = train(resnet, batches, True, Precision.fp32, before_step=freeze_batchnorm_from_step_4)
    assert graphed[2] is GraphedLoss
    assert_same_training(graphed, eager)  # a replay would have moved the frozen statistics


def swap_in_new_storage_at_step_4(model: nn.Module, step: int) -> None:
    if step == 4:  # as an EMA swap or load_state_dict(assign=True) does: the graphs' addresses go
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()


def test_parameters_given_new_storage_after_the_capture_train_uncaptured():
    batches = image_batches(STEPS)
    swap = swap_in_new_storage_at_step_4
    eager = train(resnet, batches, False, Precision.fp32, before_step=swap)
    graphed = train(resnet, batches, True, Precision.fp32, before_step=swap)
    assert_same_training(graphed, eager)  # replays would have updated the old storage


class CountCalls:
    def __init__(self):
        self.calls = 0

    def __call__(self, *_):
        self.calls += 1


def test_a_model_with_hooks_trains_uncaptured_under_auto_and_stops_under_true():
    batches = image_batches(STEPS)
    counts = {}

    def hooked(key):
        def make():
            model = resnet()
            counts[key] = CountCalls()
            model.fc.register_forward_hook(counts[key])
            return model

        return make

    eager = train(hooked("eager"), batches, False, Precision.fp32)
    auto = train(hooked("auto"), batches, "auto", Precision.fp32)
    assert counts["auto"].calls == counts["eager"].calls == STEPS  # the hook ran every step
    assert_same_training(auto, eager)
    with pytest.raises(CaptureError, match="has module hooks on fc"):
        train(hooked("true"), batches, True, Precision.fp32)


def copy_thread(stop: threading.Event) -> None:
    """What the loader's copy thread does while the Trainer captures: allocations, copies and
    synchronisation on a stream of its own (calls a process-wide capture forbids)."""
    host = torch.randn(1 << 20).pin_memory()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            torch.empty(1 << 20, device="cuda").copy_(host, non_blocking=True)
            stream.synchronize()


def test_capturing_while_another_thread_copies_on_its_own_stream():
    batches = image_batches(STEPS)
    eager = train(resnet, batches, False, Precision.fp32)
    stop = threading.Event()
    thread = threading.Thread(target=copy_thread, args=(stop,), daemon=True)
    thread.start()
    try:
        graphed = train(resnet, batches, True, Precision.fp32)
    finally:
        stop.set()
        thread.join()
    assert graphed[2] is GraphedLoss
    assert_same_training(graphed, eager)


def test_auto_replays_an_uncompiled_model_on_one_gpu():
    rt = runtime()
    model = gpt().cuda()
    ocfg = OptimConfig()
    optimizer = build_optimizer(ocfg, model, rt.device)
    schedule = build_schedule(ocfg, optimizer, STEPS)
    auto = Trainer(TrainerConfig(compile=False), model, optimizer, schedule, rt)
    assert isinstance(auto.forward_loss, GraphedLoss)
    off = Trainer(TrainerConfig(compile=False, cuda_graphs=False), model, optimizer, schedule, rt)
    assert isinstance(off.forward_loss, ModelLoss)


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        return {"logits": self.linear(x)}


def test_a_model_that_breaks_the_forward_contract_is_said_as_such_not_as_a_capture():
    """The capture's warm-up runs the eager step, which finds the model's dict output: the
    config error naming the model goes out as it is (exit 2), not as a failed capture that
    advises trainer.cuda_graphs=false."""
    from mgpu.config.checks import ConfigError
    from mgpu.models.loss import cross_entropy

    graphed = GraphedLoss(DictOut().cuda(), cross_entropy, None, required=True)
    x, y = torch.randn(4, 8, device="cuda"), torch.randint(0, 4, (4,), device="cuda")
    with pytest.raises(ConfigError, match="model='DictOut': its forward returned a dict"):
        graphed(x, y)
