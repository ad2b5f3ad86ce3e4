"""MFU's two inputs: the model's training FLOPs per sample (its flops_per_sample, counted by
mgpu.models.flops) and the device's peak TFLOP/s, from trainer.peak_tflops or a table of common
GPUs. The Recorder (mgpu.telemetry.metrics) divides the one by the other."""

from __future__ import annotations

import logging

import torch

from mgpu.config.schema import TrainerConfig
from mgpu.runtime.dist import Runtime

log = logging.getLogger(__name__)


# Peak dense (no sparsity) TFLOP/s per GPU, looked up by a word of the name CUDA reports:
# (bf16/fp16 tensor cores, fp32 without TF32). Vendor data sheets; MFU divides by these.
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.5, 51.2),
    ("H100 80GB HBM3", 989.4, 66.9),  # H100 SXM
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L4", 121.0, 30.3),
    ("V100", 125.0, 15.7),  # fp16 only: no bf16 tensor cores
]


def peak_tflops(device_name: str, low_precision: bool) -> float | None:
    """The table's peak for this device at the training precision, or None if it lacks it."""
    words = f" {device_name} "
    for key, half, single in PEAK_TFLOPS:
        if f" {key} " in words:
            return half if low_precision else single
    return None


def mfu_inputs(
    cfg: TrainerConfig, model, train_set, rt: Runtime
) -> tuple[float | None, float | None]:
    """The model's training FLOPs per sample and the device's peak TFLOP/s, for MFU; None
    where either is unknown (said once in the log)."""
    flops = None
    count = getattr(model, "flops_per_sample", None)
    # The dataset's declared input shape: fetching a sample to look would be a side effect on
    # a user's dataset (and a read of their data) before training starts.
    shape = getattr(train_set, "sample_shape", None)
    if count is not None and shape is not None:
        flops = count(tuple(shape))
    peak = cfg.peak_tflops or None
    if peak is None and rt.device.type == "cuda":
        low = cfg.precision.value != "fp32"  # auto on CUDA: bf16 or fp16 autocast
        peak = peak_tflops(torch.cuda.get_device_name(rt.device), low)
    if rt.is_primary and (flops is None or peak is None):
        why = "the device's peak"
        if flops is None:
            why = "the model's flops_per_sample or the dataset's sample_shape"
        log.info("MFU not reported: %s is unknown (trainer.peak_tflops sets a peak)", why)
    return flops, peak
