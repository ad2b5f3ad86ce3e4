"""A module of vs_plain.py's and two_nodes.py's --loss-steps: real text to train on without a
download (Python's own sources) and a run's TensorBoard scalars read back. Imports neither torch
nor mgpu, so that two_nodes.py's launcher, which trains only in its torchrun workers, does not
pay for them."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # board.py writes here
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def python_text(dst: Path, limit: int | None = None) -> int:
    """Python's own standard library sources, one after another, into dst: real text (code and
    prose) on any machine with Python, no download; ~30 MB, or the files up to `limit` bytes.
    Returns the bytes written."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    written = 0
    with open(dst, "wb") as out:
        for path in sorted(stdlib.rglob("*.py")):
            if "site-packages" in path.parts:
                continue
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:  # a few test files are in other encodings on purpose
                continue
            written += out.write(data + b"\n")
            if limit and written >= limit:
                break
    return written
