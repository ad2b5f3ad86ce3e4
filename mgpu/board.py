"""What rank 0 writes to TensorBoard: event files in the run directory, the Custom Scalars
layout of the charts that answer "how fast, and where did the time go", and the run's config in
the HParams tab. The values themselves come from mgpu.metrics.Recorder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from mgpu.config import Config
from mgpu.dist import Runtime
from mgpu.goodput import CATEGORIES
from mgpu.timing import PARTS


def _lines(*tags: str) -> list:
    return ["Multiline", list(tags)]


# TensorBoard's Custom Scalars tab: the few charts that answer "how fast, and where did the
# time go", each a group of the tags metrics.Recorder.publish writes.
LAYOUT = {
    "mgpu": {
        "throughput": _lines("throughput/tokens_per_sec", "throughput/samples_per_sec"),
        "MFU %": _lines("throughput/mfu_pct"),
        "step breakdown, ms": _lines("time/step_ms", *(f"time/{p}_ms" for p in PARTS)),
        "step breakdown, %": _lines(*(f"time/{p}_pct" for p in PARTS)),
        "memory, GiB": _lines("memory/max_allocated_gib", "memory/max_reserved_gib"),
        "ranks: step ms": _lines(*(f"ranks/step_ms_{s}" for s in ("min", "median", "max"))),
        "ranks: data wait ms": _lines(
            *(f"ranks/data_wait_ms_{s}" for s in ("min", "median", "max"))
        ),
        "ranks: compute ms": _lines(*(f"ranks/compute_ms_{s}" for s in ("min", "median", "max"))),
        "ranks: slowest": _lines(
            *(f"ranks/{f}_slowest_rank" for f in ("step_ms", "data_wait_ms", "compute_ms"))
        ),
        "goodput": _lines("goodput/pct"),
        "goodput, s": _lines(*(f"goodput/{c}_s" for c in CATEGORIES), "goodput/wall_s"),
    }
}


def set_aside_events(run_dir: Path) -> Path | None:
    """Before a run that does not continue this directory's own checkpoints writes a point: the
    TensorBoard event files an earlier run left in `run_dir` move into `earlier-<UTC time>/`
    inside it, which TensorBoard shows as a run of its own, so that no step shows the values of
    two runs in one series. Returns that folder, or None where there was nothing to move."""
    run_dir = Path(run_dir)
    old = sorted(run_dir.glob("events.out.tfevents.*"))
    if not old:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside, n = run_dir / f"earlier-{stamp}", 1
    while aside.exists():
        aside, n = run_dir / f"earlier-{stamp}-{n}", n + 1
    aside.mkdir()
    for path in old:
        path.rename(aside / path.name)
    return aside


def flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """[("optim.lr", 0.001), ...] for a nested dict."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


class TensorBoard:
    """Rank 0 writes event files into the run directory; every other rank writes nothing.

    `purge_step`: a resumed run's first step. TensorBoard then drops what earlier event files in
    the directory hold from that step on (steps an interrupted attempt logged after its last
    checkpoint), so each step shows once, with the value of the run that continued.
    """

    def __init__(self, run_dir: Path, enabled: bool, purge_step: int | None = None):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """All of a step's values in one event (one record per value would cost tens of
        microseconds each, on the host thread that feeds the GPU)."""
        if self.writer is not None and values:
            from tensorboard.compat.proto.summary_pb2 import Summary

            record = Summary(
                value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()]
            )
            self.writer.file_writer.add_summary(record, step)

    def describe_run(self, config: dict[str, Any], summary: str) -> None:
        """Once per launch: the charts' layout, the run's config in the HParams tab (next to
        the metrics it is compared by) and a text summary."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        self.writer.add_custom_scalars(LAYOUT)
        flat = {k: v if isinstance(v, int | float | bool) else str(v) for k, v in flatten(config)}
        metrics = dict.fromkeys(("train/loss", "eval/loss", "throughput/mfu_pct", "goodput/pct"), 0)
        for record in hparams(flat, metrics):  # experiment, session start, session end
            self.writer.file_writer.add_summary(record)
        self.writer.add_text("run/summary", summary)

    def text(self, tag: str, body: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, body)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def describe(cfg: Config, rt: Runtime, params: int, config_text: str) -> str:
    """The run in a few lines of Markdown, for TensorBoard's text tab."""
    device = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "CPU"
    return "\n".join(
        [
            f"- model: `{cfg.model._target_}`, {params / 1e6:.2f}M parameters",
            f"- {rt.world_size} process(es) on {device}, backend {rt.backend}, "
            f"engine {cfg.dist.engine.value}, precision {cfg.trainer.precision.value}, "
            f"compiled {cfg.trainer.compiles(rt.device.type)}",
            f"- batch {cfg.data.batch_size} per device x {cfg.trainer.grad_accum_steps} "
            f"accumulation x {rt.world_size} processes per optimizer step",
            f"- torch {torch.__version__}",
            "",
            "```yaml",
            config_text,
            "```",
        ]
    )
