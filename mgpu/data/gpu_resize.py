"""data.decode=gpu's crop, resize and flip of a whole batch of decoded images in a few GPU
kernel launches, whatever the images' sizes: the step that turns nvJPEG's [3, H, W] outputs into
one uint8 [B, 3, S, S] batch.

Done image by image from Python, the same work took ~4 launches and ~100 us of the copy
thread's time (holding the GIL the training loop also needs) per image, 500+ small kernels a
batch competing with the training step for the GPU. Here the kernels read every image through a
table of pointers (no copy of the decoded images into one buffer), one pass of rows then one of
columns.

Each pass is launched once per group of images with similar tap counts (at most 3 groups): a
launch's row grid spans its tallest box and its tap loop runs to its largest shrink, so one
launch for the whole batch made every ordinary photo pay for the rare 2400 x 1800 one (most row
programs exiting at once, 23 taps where 3-6 do). The groups come from sorting the table on the
host; every entry carries its own offsets, so the order changes no output.

The filter is the one Pillow and torch's antialiased bilinear resize use (image_folder.crop_resize
on the CPU): a triangle whose support widens with the shrink factor, weights normalised per
output pixel, applied rows first then columns, only to pixels inside the crop box. Between the
passes values stay float32 (Pillow rounds to uint8 there), so the two paths differ by at most a
level or two on a pixel. Taps past an output pixel's window weigh exactly 0, so a group's tap
count changes no value, only the work.

Triton is imported here only: this module is loaded by gpu_decode.gpu_decoder, on CUDA hosts
(and by tests, which run the kernels in Triton's CPU interpreter).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

# Columns of the per-image table the kernels read (int64): where the decoded image lives and
# its size, the crop box, where its rows start in the intermediate buffer, flip, batch slot.
PTR, HEIGHT, WIDTH, LEFT, TOP, BOX_W, BOX_H, ROW0, FLIP, SLOT = range(10)
FIELDS = 10
ROWS = 4  # rows of a crop box one program of the row pass resizes


@triton.jit
def _resize_rows(
    table, inter, size, taps, FIELDS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    """Pass 1, one program per (image, channel, ROWS rows of its crop box): the rows resized to
    `size` columns, float32, into the image's block of `inter`. A tile of rows, not one, since
    every row of a box takes the same column weights: worked out once, used ROWS times."""
    b, c, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    entry = table + b * FIELDS
    box_h = tl.load(entry + 6)
    if tile * ROWS < box_h:
        image = tl.load(entry + 0).to(tl.pointer_type(tl.uint8))
        height, width = tl.load(entry + 1), tl.load(entry + 2)
        left, top, box_w = tl.load(entry + 3), tl.load(entry + 4), tl.load(entry + 5)
        row0 = tl.load(entry + 7)
        y = tile * ROWS + tl.arange(0, ROWS)[:, None]
        src = image + c * height * width + (top + y) * width + left
        j = tl.arange(0, BLOCK)
        scale = box_w.to(tl.float32) / size
        support = tl.maximum(scale, 1.0)  # the triangle widens when shrinking (antialias)
        center = (j.to(tl.float32) + 0.5) * scale
        lo = tl.maximum((center - support + 0.5).to(tl.int32), 0)
        hi = tl.minimum((center + support + 0.5).to(tl.int32), box_w.to(tl.int32))
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(taps):
            x = lo + k
            valid = (x < hi) & (j < size)
            weight = tl.maximum(1.0 - tl.abs((x.to(tl.float32) - center + 0.5) / support), 0.0)
            weight = tl.where(valid, weight, 0.0)
            pixels = tl.load(src + x[None, :], mask=(y < box_h) & valid[None, :], other=0)
            acc += weight[None, :] * pixels.to(tl.float32)
            total += weight
        rows = acc / tl.where(total > 0, total, 1.0)[None, :]
        mask = (y < box_h) & (j < size)[None, :]
        tl.store(inter + (row0 + c * box_h + y) * size + j[None, :], rows, mask=mask)


@triton.jit
def _resize_columns(table, inter, out, size, taps, FIELDS: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2, one program per (image, channel, output row): `taps` rows of pass 1's result
    weighted into one, rounded to uint8 and written (mirrored if the sample flips) to the
    image's slot of `out`."""
    b, c, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    entry = table + b * FIELDS
    box_h, row0 = tl.load(entry + 6), tl.load(entry + 7)
    flip, slot = tl.load(entry + 8), tl.load(entry + 9)
    scale = box_h.to(tl.float32) / size
    support = tl.maximum(scale, 1.0)
    center = (i + 0.5) * scale
    lo = tl.maximum((center - support + 0.5).to(tl.int32), 0)
    hi = tl.minimum((center + support + 0.5).to(tl.int32), box_h.to(tl.int32))
    j = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    total = 0.0
    for k in range(taps):
        y = lo + k
        weight = tl.maximum(1.0 - tl.abs((y.to(tl.float32) - center + 0.5) / support), 0.0)
        weight = tl.where(y < hi, weight, 0.0)
        # one block-shaped mask: `block & scalar` came out int32 in Triton's CPU interpreter
        in_window = j < tl.where(y < hi, size, 0)
        row = tl.load(inter + (row0 + c * box_h + y) * size + j, mask=in_window, other=0.0)
        acc += weight * row
        total += weight
    value = tl.minimum(tl.maximum(tl.floor(acc / total + 0.5), 0.0), 255.0)
    column = tl.where(flip != 0, size - 1 - j, j)
    tl.store(out + ((slot * 3 + c) * size + i) * size + column, value.to(tl.uint8), mask=j < size)


def taps_for(extent: int, size: int) -> int:
    """Input pixels one output pixel can weigh along a side of `extent` pixels shrunk or grown
    to `size`: the triangle's width (2 x support) plus one for the window's rounding."""
    return math.ceil(2 * max(extent / size, 1.0)) + 1


# Upper bounds of the tap classes one launch covers, the rest in a third: 7 taps hold a box up
# to 3x the output side (most photos into 224), 13 up to 6x.
TAP_CLASSES = (7, 13)


def group_by_taps(extents: list[int], size: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """An order of the images (indices into `extents`) that puts each tap class together, and
    each class's (start, stop, taps) in that order: its slice and the taps its largest needs."""
    taps = [taps_for(extent, size) for extent in extents]
    kind = [sum(t > bound for bound in TAP_CLASSES) for t in taps]
    order = sorted(range(len(extents)), key=kind.__getitem__)
    groups, start = [], 0
    for stop in range(1, len(order) + 1):
        if stop == len(order) or kind[order[stop]] != kind[order[start]]:
            groups.append((start, stop, max(taps[k] for k in order[start:stop])))
            start = stop
    return order, groups


def resize_into(
    out: Tensor,
    images: list[Tensor],
    boxes: list[tuple[int, int, int, int]],
    flips: list[bool],
    slots: list[int],
) -> None:
    """Write each image's crop box (left, top, w, h), resized to out's S x S and mirrored where
    `flips` says, into out[slots[k]]. `images`: uint8 [3, H, W] contiguous, on out's device.

    Stream rule: the kernels run on the current stream, which must be the one the images were
    written on (or wait for it); the images are read by address, so the caller keeps them
    alive until then, which holding the list through this call does (the allocator reuses
    their memory only in this stream's order). The table crosses from pinned memory without a
    host wait.
    """
    if not images:
        return
    size = out.shape[-1]
    rows, entries = 0, []
    for image, (left, top, w, h), flip, slot in zip(images, boxes, flips, slots, strict=True):
        _, height, width = image.shape
        entries.append((image.data_ptr(), height, width, left, top, w, h, rows, flip, slot))
        rows += 3 * h
    # The row pass works along the boxes' widths, the column pass along their heights: each
    # groups by its own side, so the table goes over twice, once in each pass's order.
    by_width, row_groups = group_by_taps([w for _, _, w, _ in boxes], size)
    by_height, column_groups = group_by_taps([h for _, _, _, h in boxes], size)
    table = torch.tensor([entries[k] for k in by_width + by_height], dtype=torch.int64)
    table = table.pin_memory() if out.is_cuda else table
    table = table.to(out.device, non_blocking=True)
    row_table, column_table = table[: len(images)], table[len(images) :]
    inter = torch.empty(rows, size, dtype=torch.float32, device=out.device)
    block = triton.next_power_of_2(size)
    for start, stop, taps in row_groups:
        tiles = triton.cdiv(max(boxes[k][3] for k in by_width[start:stop]), ROWS)
        _resize_rows[(stop - start, 3, tiles)](
            row_table[start:stop], inter, size, taps, FIELDS=FIELDS, BLOCK=block, ROWS=ROWS
        )
    for start, stop, taps in column_groups:
        _resize_columns[(stop - start, 3, size)](
            column_table[start:stop], inter, out, size, taps, FIELDS=FIELDS, BLOCK=block
        )
