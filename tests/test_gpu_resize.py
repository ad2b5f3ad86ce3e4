"""gpu_resize's batched crops without a GPU: the grouping of a batch by tap count, and the
kernels themselves in Triton's CPU interpreter against torch's per-image resize (the GPU test,
test_image_folder.py::test_batched_gpu_crops_match_the_per_image_reference, runs them
compiled). Both need Triton installed, which CUDA builds of torch bring."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_grouping_puts_every_image_in_one_group_whose_taps_cover_it():
    pytest.importorskip("triton")
    from mgpu.data.gpu_resize import TAP_CLASSES, group_by_taps, taps_for

    size = 224
    # ordinary photos, a few large ones, thin and tiny boxes that grow, in no order
    extents = [500, 2400, 375, 5, 1500, 224, 900, 30, 2000, 333, 1, 672, 673, 1344, 1345]
    order, groups = group_by_taps(extents, size)
    assert sorted(order) == list(range(len(extents)))
    assert groups[0][0] == 0 and groups[-1][1] == len(order)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))  # no gaps
    assert len(groups) == len(TAP_CLASSES) + 1
    for start, stop, taps in groups:
        assert start < stop
        members = [taps_for(extents[k], size) for k in order[start:stop]]
        assert taps == max(members)
    # the classes' bounds: 672 px (3x) still 7 taps, 1344 (6x) still 13
    assert [g[2] for g in groups] == [7, 13, taps_for(2400, size)]
    assert group_by_taps([], size) == ([], [])
    assert group_by_taps([400, 300], size) == ([0, 1], [(0, 2, 5)])


# Run in a child process: TRITON_INTERPRET is read when Triton compiles a kernel, and the
# setting must not reach other tests (a compiled kernel elsewhere would then be interpreted).
CHECK = """
import torch
from mgpu.data.gpu_decode import resize_each
from mgpu.data import gpu_resize
from mgpu.data.gpu_resize import resize_into

g = torch.Generator().manual_seed(0)
# a photo-shaped batch at ~1/20 scale (a 120 x 90 box for the 2400 x 1800 photos), into 12 px
# so that the tap classes of 224 px reappear: 3 groups in each pass
sizes = [(37, 50), (50, 37), (100, 130), (20, 30), (33, 25), (40, 40)]
images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in sizes]
boxes = [(0, 0, 50, 37), (1, 3, 30, 9), (5, 5, 120, 90), (0, 0, 30, 20), (17, 1, 5, 31)]
boxes += [(2, 4, 36, 8)]
flips = [False, True, True, False, True, False]
slots = [3, 0, 5, 1, 2, 4]
for side in (2, 3):  # both passes launch all three groups
    assert len(gpu_resize.group_by_taps([box[side] for box in boxes], 12)[1]) == 3
fast = torch.zeros(len(images), 3, 12, 12, dtype=torch.uint8)  # 12: BLOCK 16 masks 4 columns
slow = torch.zeros_like(fast)
resize_into(fast, images, boxes, flips, slots)
resize_each(slow, images, boxes, flips, slots)
diff = (fast.int() - slow.int()).abs()
assert diff.max() <= 1 and diff.float().mean() < 0.01, (diff.max(), diff.float().mean())
# one launch a pass for the whole batch: the grouping changes no pixel
gpu_resize.TAP_CLASSES = ()
whole = torch.zeros_like(fast)
resize_into(whole, images, boxes, flips, slots)
assert torch.equal(whole, fast)
print("ok")
"""


def test_batched_crops_match_the_per_image_reference_in_the_interpreter():
    """The GPU test's check on CPU tensors, Triton's interpreter running the kernels: a mixed
    batch whose passes launch per group, flips, slots out of order, boxes that shrink and grow,
    an output side that is not a power of two. And the same batch in one launch a pass: the
    same pixels, bit for bit."""
    triton = pytest.importorskip("triton")
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 9):  # 3.6's interpreter wraps kernel arguments: range(taps) fails
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over a kernel argument")
    pytest.importorskip("numpy")  # the interpreter's
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHECK)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
