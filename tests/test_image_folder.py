"""data=image_folder: a tiny class-per-folder tree of PNGs and JPEGs written here; batches checked
against a decode and crop computed here with Pillow and numpy from the documented rule; two
gloo ranks; bad files and bad trees; a training run that records its classes and replaced
files. GPU (skipped without CUDA): decode=gpu against decode=cpu on the same crops."""

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import (
    ROOT,
    gloo_runtime,
    one_line_under_torchrun,
    read_scalars,
    run_train,
    said_by_train_py,
    said_lines,
    spawn,
)
from PIL import Image

from mgpu.config.checks import ConfigError
from mgpu.data.check_images import main as check_images
from mgpu.data.config import ImageFolderDataConfig, ImageShardsDataConfig
from mgpu.data.folder_files import auto_eval_samples, count_images
from mgpu.data.image_folder import BadImageFile, ImageFolder
from mgpu.data.loader import build_dataloader, build_loader
from mgpu.data.sampler import SampleKey
from mgpu.evaluate import main as evaluate_main
from mgpu.export import main as export_main
from mgpu.runtime.dist import Runtime
from mgpu.runtime.stops import PEER_GONE

CLASSES = ["ant", "bee", "cow"]
SIZE = 12  # the crops' side


def smooth_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Gradients plus a little noise: JPEG keeps such images close, as it does photographs."""
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, 3) + rng.uniform(-3, 3, 3) * (x[..., None] + y[..., None])
    return np.clip(base + rng.normal(0, 4, (height, width, 3)), 0, 255).astype(np.uint8)


def write_tree(root: Path, per_class: int = 4, seed: int = 0, sizes=((18, 24), (40, 26))):
    """CLASSES folders of images (even files JPEG, odd PNG) of a few sizes; their paths in the
    dataset's documented order (class, then file name)."""
    rng = np.random.default_rng(seed)
    files = []
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for k in range(per_class):
            h, w = sizes[k % len(sizes)]
            path = root / name / f"img{k:02d}.{'jpg' if k % 2 == 0 else 'png'}"
            Image.fromarray(smooth_image(rng, h, w)).save(path, quality=90)
            files.append((str(path), CLASSES.index(name)))
    return files


# ---- the reference: the crop rule as documented, computed without mgpu ----


def reference_crop(width, height, seed, epoch, index, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """(left, top, w, h, flip) for a training sample: numpy's generator seeded [seed, epoch,
    index]; up to 10 draws of (area fraction, log aspect), then a top and a left; then the
    flip; if no draw fits, the centered box of the clamped aspect ratio (and still the flip)."""
    gen = np.random.default_rng([seed, epoch, index])
    tries = 0
    box = None
    while tries < 10 and box is None:
        tries += 1
        fraction = gen.uniform(*scale)
        aspect = math.exp(gen.uniform(math.log(ratio[0]), math.log(ratio[1])))
        bw = round(math.sqrt(width * height * fraction * aspect))
        bh = round(math.sqrt(width * height * fraction / aspect))
        if 1 <= bw <= width and 1 <= bh <= height:
            top = int(gen.integers(0, height - bh + 1))
            box = (int(gen.integers(0, width - bw + 1)), top, bw, bh)
    if box is None:  # the whole image, trimmed to the nearest allowed aspect ratio
        bw = min(width, round(height * ratio[1]))
        bh = min(height, round(width / ratio[0]))
        box = ((width - bw) // 2, (height - bh) // 2, bw, bh)
    return (*box, bool(gen.random() < 0.5))


def reference_pixels(path, box, flip, size=SIZE, resize="torch") -> torch.Tensor:
    """Decode with Pillow, cut the box with numpy, resize with torch's antialiased bilinear on
    uint8 (or Pillow's, resize="pillow"), mirror with numpy."""
    pixels = np.asarray(Image.open(path).convert("RGB"))
    left, top, w, h = box
    cut = np.array(pixels[top : top + h, left : left + w])  # writable, contiguous
    if resize == "pillow":
        out = np.asarray(Image.fromarray(cut).resize((size, size), Image.Resampling.BILINEAR))
    else:
        chw = torch.from_numpy(cut).permute(2, 0, 1)[None]
        scaled = torch.nn.functional.interpolate(
            chw, size=(size, size), mode="bilinear", antialias=True
        )
        out = scaled[0].permute(1, 2, 0).numpy()
    if flip:
        out = out[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1)))


def test_torch_resize_stays_within_two_levels_of_pillows(tmp_path):
    """The workers resize with torch (2.4x Pillow's speed on a core); the filter is Pillow's,
    rounding aside: every crop of the tree within 2 levels, 0.1 on average."""
    files = write_tree(tmp_path / "train", per_class=4, sizes=((375, 500), (90, 60), (40, 64)))
    rng = np.random.default_rng(0)
    for path, _ in files:
        width, height = Image.open(path).size
        for size in (SIZE, 224):
            *box, flip = reference_crop(width, height, 0, int(rng.integers(9)), 0)
            ours, pillows = (
                reference_pixels(path, box, flip, size, how) for how in ("torch", "pillow")
            )
            diff = (ours.int() - pillows.int()).abs()
            assert diff.max() <= 2 and diff.float().mean() < 0.1, (path, box, diff.max())


def reference_train(files, key: SampleKey) -> tuple[torch.Tensor, int]:
    path, label = files[key.index]
    width, height = Image.open(path).size
    *box, flip = reference_crop(width, height, key.seed, key.epoch, key.index)
    return reference_pixels(path, box, flip), label


def reference_eval(path) -> torch.Tensor:
    width, height = Image.open(path).size
    side = round(min(width, height) * 0.875)
    return reference_pixels(path, ((width - side) // 2, (height - side) // 2, side, side), False)


def folder(root: Path, eval_root: Path | None = None, **kwargs) -> dict:
    args = dict(path=str(root), image_size=SIZE, decode="cpu", eval_samples=2)
    if eval_root is not None:
        args["eval_path"] = str(eval_root)
    return {**args, **kwargs}


def train_on_cpu(args: list[str], cwd: Path, timeout: float = 240):
    """`python train.py args` with no GPU visible, also on a GPU machine: these runs check
    the CPU path (bitwise on the CPU; a GPU's convolutions need not be)."""
    return run_train(args, cwd=cwd, nproc=None, timeout=timeout, env={"CUDA_VISIBLE_DEVICES": ""})


def cpu_runtime(rank: int = 0, world: int = 1) -> Runtime:
    return Runtime(rank, rank, world, "gloo", torch.device("cpu"), has_process_group=False)


# ---- tests ----


def test_batches_match_reference_decode_and_crop(tmp_path):
    files = write_tree(tmp_path / "train")
    evals = write_tree(tmp_path / "val", per_class=1, seed=1)
    cfg = ImageFolderDataConfig(**folder(tmp_path / "train", tmp_path / "val", batch_size=4))
    cfg.num_workers = 2  # the samples are made in worker processes
    train = ImageFolder("train", **cfg.dataset_kwargs())
    assert train.classes == CLASSES and len(train) == len(files)
    loader = build_dataloader(cfg, train, cpu_runtime(), seed=7, train=True, stream=False)
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        keys = list(loader.sampler)
        assert all(k.epoch == epoch and k.seed == 7 for k in keys)
        images, labels = (torch.cat(t) for t in zip(*loader, strict=True))
        for k, key in enumerate(keys):
            pixels, label = reference_train(files, key)
            assert torch.equal(images[k], pixels), (epoch, key, files[key.index][0])
            assert labels[k] == label
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, SIZE, SIZE)
    flips = [reference_crop(24, 18, 7, 0, i)[-1] for i in range(40)]
    assert 10 < sum(flips) < 30  # the reference does draw both ways
    held = ImageFolder("eval", **cfg.dataset_kwargs())
    assert len(held) == len(evals)
    for i, (path, label) in enumerate(evals):
        pixels, got = held[i]
        assert torch.equal(pixels, reference_eval(path)) and int(got) == label


def test_holdout_without_eval_path_is_disjoint_and_spread(tmp_path):
    files = write_tree(tmp_path / "train")
    kwargs = ImageFolderDataConfig(**folder(tmp_path / "train", eval_samples=3)).dataset_kwargs()
    train, held = ImageFolder("train", **kwargs), ImageFolder("eval", **kwargs)
    assert len(train) + len(held) == len(files) and len(held) == 3
    assert set(train.files) | set(held.files) == {p for p, _ in files}
    assert not set(train.files) & set(held.files)
    assert sorted(held.labels) == [0, 1, 2]  # one of each class
    with pytest.raises(ValueError, match="data.eval_samples=12"):
        ImageFolder("train", **{**kwargs, "eval_samples": 12})


def _rank_samples(rank: int, port: int, root: str, out: str) -> None:
    # No worker process (each would start its rank's fork server): what is checked is each
    # rank's share, which the sampler draws; samples made by workers are the test above's.
    cfg = ImageFolderDataConfig(**folder(Path(root), batch_size=2, num_workers=0))
    with gloo_runtime(rank, port) as rt:
        dataset = ImageFolder("train", **cfg.dataset_kwargs())
        loader = build_loader(cfg, dataset, rt, seed=3, train=True)
        loader.set_epoch(1)
        keys = list(loader.sampler.epoch_keys())
        images = torch.cat([x for x, _ in islice(loader, len(loader))])  # epoch 1 of the stream
        loader.close()
    torch.save({"keys": [tuple(k) for k in keys], "images": images}, f"{out}/rank{rank}.pt")


def test_two_gloo_ranks_see_disjoint_samples(tmp_path):
    from conftest import free_port

    files = write_tree(tmp_path / "train", per_class=6)
    spawn(_rank_samples, free_port(), str(tmp_path / "train"), str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    indices = [[k[0] for k in g["keys"]] for g in got]
    assert len(indices[0]) == len(indices[1]) == (len(files) - 2) // 2
    assert not set(indices[0]) & set(indices[1])
    train = ImageFolder(
        "train", **ImageFolderDataConfig(**folder(tmp_path / "train")).dataset_kwargs()
    )
    for g in got:
        # the normalised device batch: compare it as uint8 again
        for k, key in enumerate(g["keys"]):
            pixels, _ = reference_train(
                list(zip(train.files, train.labels, strict=True)), SampleKey(*key)
            )
            levels = ((g["images"][k] + 2.0) * 63.75).round().to(torch.uint8)
            assert torch.equal(levels, pixels)


def test_corrupt_file_fails_naming_it(tmp_path):
    write_tree(tmp_path / "train")
    bad = tmp_path / "train" / "bee" / "img01.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 20)
    cfg = ImageFolderDataConfig(**folder(tmp_path / "train", batch_size=3, num_workers=1))
    dataset = ImageFolder("train", **cfg.dataset_kwargs())
    loader = build_loader(cfg, dataset, cpu_runtime(), seed=0, train=True)
    try:
        with pytest.raises(BadImageFile, match=r"bee/img01\.png: not a readable image.*skip"):
            list(loader)
    finally:
        loader.close()  # its persistent worker


def test_every_unreadable_file_of_a_batch_is_named(tmp_path):
    files = write_tree(tmp_path / "train")
    for path in (files[1][0], files[6][0]):
        Path(path).write_bytes(b"garbage")
    cfg = ImageFolderDataConfig(**folder(tmp_path / "train", eval_root=tmp_path / "train"))
    dataset = ImageFolder("eval", **cfg.dataset_kwargs())  # every file, in write_tree's order
    assert dataset.files == [f for f, _ in files]
    assert len(dataset.__getitems__([0, 2])) == 2
    with pytest.raises(BadImageFile, match=r"2 unreadable images in one batch") as info:
        dataset.__getitems__([0, 1, 2, 6])
    text = str(info.value)
    assert files[1][0] in text and files[6][0] in text and "data.bad_files=skip" in text


def test_corrupt_file_before_the_first_step_is_one_line_exit_2_from_every_rank(tmp_path):
    write_tree(tmp_path / "train", per_class=6)  # 18 images, 2 held out
    (tmp_path / "train" / "ant" / "img00.jpg").write_bytes(b"garbage")
    args = ["data=image_folder", f"data.path={tmp_path / 'train'}", "data.eval_samples=2"]
    # a rank's first batch is all of its 8 images: one rank reads the bad file before step 1
    args += ["data.batch_size=8", "data.num_workers=1", "data.decode=cpu", "model=resnet_tiny"]
    args += ["data.image_size=16"]  # the other rank's first step: small crops, a quick one
    env = {"CUDA_VISIBLE_DEVICES": ""}
    proc = run_train(args, cwd=tmp_path, nproc=2, env=env, timeout=120)  # and no hang
    line = one_line_under_torchrun(proc, None, prefix="not a readable image")
    assert "ant/img00.jpg: not a readable image" in line, line
    assert "Caught BadImageFile" not in proc.stderr  # the DataLoader worker's traceback
    # nor, after the line, a warning of the semaphores of a loader the error left behind
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]


def test_corrupt_file_after_the_first_step_is_one_line_from_each_rank(tmp_path):
    """The rank that reads the bad file mid-run stops with its one line (exit 2); the other,
    whose gradient all-reduce then loses its peer, says in one line that it stopped with it
    (exit 1) instead of gloo's traceback."""
    write_tree(tmp_path / "train", per_class=20)  # 58 training images: 14 steps an epoch
    (tmp_path / "train" / "cow" / "img18.jpg").write_bytes(b"garbage")
    args = ["data=image_folder", f"data.path={tmp_path / 'train'}", "data.eval_samples=2"]
    # No worker process: the file is read when its step asks for it (well after step 2), and a
    # worker's error is the launch's above; small crops keep the steps before it quick.
    args += ["data.batch_size=2", "data.num_workers=0", "data.image_size=16"]
    args += ["data.decode=cpu", "model=resnet_tiny", "trainer.max_steps=40"]
    args += ["trainer.log_every=1", "trainer.eval_every=0", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_train(args, cwd=tmp_path, nproc=2, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=240)
    output = proc.stdout + proc.stderr
    said = said_lines(proc)  # the ranks' own lines; torchrun's table repeats the root cause's
    bad = [line for line in said if "not a readable image" in line]
    gone = [line for line in said if "another rank's process ended" in line]
    assert len(bad) == 1 and "cow/img18.jpg" in bad[0], output
    assert re.search(r"traceback : .*not a readable image", proc.stderr), output  # the table
    assert len(gone) == 1 and any(words in gone[0] for words in PEER_GONE), output
    assert "step 2/40" in output.split(bad[0])[0], output  # read after training had begun
    assert output.count("Traceback") == 1, output  # torchrun's own summary only
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr, output
    # the reader's 2 (torchrun's root cause) and the other rank's 1; neither killed by SIGTERM
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)) == {"1", "2"}, output


def test_skip_replaces_and_counts(tmp_path):
    write_tree(tmp_path / "train")
    (tmp_path / "train" / "cow" / "img00.jpg").write_bytes(b"\xff\xd8\xff" + b"\0" * 50)
    cfg = ImageFolderDataConfig(**folder(tmp_path / "train", batch_size=2, bad_files="skip"))
    cfg.num_workers = 2
    dataset = ImageFolder("train", **cfg.dataset_kwargs())
    bad = dataset.files.index(str(tmp_path / "train" / "cow" / "img00.jpg"))
    # epoch by epoch: a stream's workers would read into a 4th epoch before the count
    loader = build_dataloader(cfg, dataset, cpu_runtime(), seed=0, train=True, stream=False)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for _ in loader:
            pass
    assert dataset.replaced() == 3  # once an epoch, counted in the workers
    assert dataset.counters() == {"data/bad_files_replaced": 3.0}
    key = SampleKey(bad, 2, 5)
    replaced, after = dataset[key], dataset[SampleKey(bad + 1, 2, 5)]
    assert torch.equal(replaced[0], after[0]) and replaced[1] == after[1]
    assert dataset.replaced() == 4  # counted in this process too


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda root: None, "does not exist"),
        (lambda root: root.mkdir(), "has no class subfolders"),
        (lambda root: (root / "ant").mkdir(parents=True), r"class folder .*ant holds no images"),
        # a class folder linked from a share that is not mounted: said, not left out unsaid
        (
            lambda root: write_tree(root) and (root / "gnu").symlink_to(root.parent / "gone"),
            r"gnu is a link to .*gone, which does not exist \(a share not mounted\?\)",
        ),
        # a set that prepare_images wrote, given to data=image_folder
        (
            lambda root: root.mkdir() or (root / "index.json").write_text("{}"),
            "holds a set prepared by mgpu.data.prepare_images, not class subfolders: train on "
            "it with data=image_shards",
        ),
    ],
)
def test_bad_trees_are_config_errors(tmp_path, make, needle):
    root = tmp_path / "tree"
    make(root)
    with pytest.raises(ConfigError, match=needle):
        ImageFolderDataConfig(path=str(root))


def test_an_image_folder_where_a_prepared_set_or_another_folder_belongs_is_said(tmp_path, caplog):
    """data=image_shards on an image folder says to train on it with data=image_folder or
    prepare it into a new folder (not into itself); data.eval_path naming data.path itself
    evaluates on the training images: a warning says so (a deliberate check of a model's fit
    on its own images stays possible)."""
    write_tree(tmp_path / "train")
    with pytest.raises(ConfigError) as refused:
        ImageShardsDataConfig(path=str(tmp_path / "train"))
    said = str(refused.value)
    assert "an image folder (class subfolders), not a prepared set" in said, said
    assert f"prepare_images {tmp_path / 'train'} {tmp_path / 'train-shards'} " in said, said
    with caplog.at_level("WARNING", logger="mgpu.data.config"):
        ImageFolderDataConfig(path=str(tmp_path / "train"), eval_path=f"{tmp_path}/./train/")
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "is data.path itself: evaluations are of images the run trains on" in said, said


def test_an_eval_folder_of_some_classes_evaluates_those_with_the_training_labels(tmp_path, caplog):
    """data.eval_path with folders for 2 of the 3 classes: a warning names the one left out,
    and the eval split holds the others' images labelled as training labels them; one with
    none of the classes' folders is refused."""
    write_tree(tmp_path / "train")
    write_tree(tmp_path / "val", per_class=2)
    shutil.rmtree(tmp_path / "val" / "bee")
    with caplog.at_level("WARNING", logger="mgpu.data.config"):
        cfg = ImageFolderDataConfig(**folder(tmp_path / "train", tmp_path / "val"))
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "has no images of 1 of the 3 classes (bee): evaluations are of the others'" in said
    evals = ImageFolder("eval", **cfg.dataset_kwargs())
    assert evals.labels == [0, 0, 2, 2] and all("/bee/" not in f for f in evals.files)
    (tmp_path / "none" / "gnu").mkdir(parents=True)
    with pytest.raises(ConfigError, match="has a folder for none of data.path's 3 classes"):
        ImageFolderDataConfig(**folder(tmp_path / "train", tmp_path / "none"))


def test_one_class_is_a_config_error_naming_how_to_give_more(tmp_path):
    """A classifier of one class learns nothing (its loss is 0 from the first step)."""
    write_tree(tmp_path / "train", per_class=1)
    for name in CLASSES[1:]:  # one class folder left
        shutil.rmtree(tmp_path / "train" / name)
    with pytest.raises(ConfigError) as err:
        ImageFolderDataConfig(path=str(tmp_path / "train"))
    said = str(err.value)
    assert said.startswith(f"data.path='{tmp_path / 'train'}': gives one class ('{CLASSES[0]}')")
    assert said.endswith("put each class's images in a subfolder of its own"), said
    write_tree(tmp_path / "both", per_class=1)  # every class: fine, but not one asked alone
    assert ImageFolderDataConfig(path=str(tmp_path / "both")).classes == CLASSES
    with pytest.raises(ConfigError, match=r"^data.classes=\['.+'\]: .*name two or more$"):
        ImageFolderDataConfig(path=str(tmp_path / "both"), classes=CLASSES[:1])


def test_empty_class_folder_is_one_line_before_training(tmp_path):
    """The line train.py's first step (check_command_line) says, in this process: the folder is
    checked with the config, before anything runs. That such a line is said alone, exit 2,
    before any run directory, is the launches' of tests/test_config.py and test_one_line.py."""
    write_tree(tmp_path / "train")
    (tmp_path / "train" / "dog").mkdir()
    args = ["data=image_folder", f"data.path={tmp_path / 'train'}", "model=resnet_tiny"]
    line = said_by_train_py(args, tmp_path)
    assert "\n" not in line and "dog holds no images" in line, line
    assert not (tmp_path / "outputs").exists()


def test_training_run_records_classes_and_replaced_files(tmp_path):
    write_tree(tmp_path / "train", per_class=6)  # 18 images, 2 held out: 2 steps an epoch
    (tmp_path / "train" / "ant" / "img02.jpg").write_bytes(b"garbage")
    args = [
        "data=image_folder",
        f"data.path={tmp_path / 'train'}",
        "data.image_size=16",
        "data.batch_size=4",
        "data.num_workers=1",
        "data.eval_samples=2",
        "data.bad_files=skip",
        "data.decode=cpu",
        "model=resnet_tiny",
        "trainer.max_steps=8",
        "trainer.log_every=4",
        "trainer.eval_every=0",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {"CUDA_VISIBLE_DEVICES": ""}
    proc = run_train(args, cwd=tmp_path, nproc=2, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "classes:\n  - ant\n  - bee\n  - cow\n" in (tmp_path / "run" / "config.yaml").read_text()
    scalars = read_scalars(tmp_path / "run")
    replaced = [v for _, v in scalars["data/bad_files_replaced"]]
    # Summed over ranks: the bad image is drawn once in each epoch (2 steps of 2 ranks x 4
    # images), by one rank or the other, and counted as the workers read it, which runs ahead of
    # training into the next epochs (the training stream): at least the epochs trained through.
    assert len(replaced) == 2 and replaced[0] >= 2.0 and replaced[1] >= 4.0, replaced
    assert replaced[0] <= replaced[1], replaced
    logs = [(tmp_path / "run" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    said = [log.count("ant/img02.jpg: not a readable image") for log in logs]
    # every count named in a log, and rank 0's count alone would be less
    assert sum(said) >= replaced[1] and min(said) > 0, (said, replaced)


@pytest.mark.gpu
def test_gpu_decode_matches_cpu_decode(tmp_path):
    pytest.importorskip("torchvision")
    files = write_tree(tmp_path / "train", per_class=6, sizes=((375, 500), (333, 250), (64, 96)))
    root = tmp_path / "train"
    device = torch.device("cuda", torch.cuda.current_device())
    rt = Runtime(0, 0, 1, "nccl", device, has_process_group=False)
    batches = {}
    for decode in ("cpu", "gpu"):
        cfg = ImageFolderDataConfig(**folder(root, batch_size=5, num_workers=2, decode=decode))
        cfg.image_size, cfg.reduced_decode = 64, False  # full-size decodes on both sides
        for split in ("train", "eval"):
            dataset = ImageFolder(split, **cfg.dataset_kwargs())
            loader = build_loader(cfg, dataset, rt, seed=11, train=split == "train")
            loader.set_epoch(2)
            epoch = islice(loader, len(loader))  # train loaders stream on past the epoch
            batches[decode, split] = [(x.cpu(), y.cpu()) for x, y in epoch]
            loader.close()
    assert len(files) == 18
    for split in ("train", "eval"):
        cpu, gpu = batches["cpu", split], batches["gpu", split]
        assert len(cpu) == len(gpu) > 0
        for (xc, yc), (xg, yg) in zip(cpu, gpu, strict=True):
            assert torch.equal(yc, yg)
            # back to uint8 levels: JPEG decoders differ by a level or two (IDCT, chroma
            # upsampling); the PNGs (odd files) take the same CPU path in both modes.
            diff = ((xc - xg) * 63.75).abs()
            assert diff.mean() < 1.5 and diff.max() <= 24, (split, diff.mean(), diff.max())


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a host without a GPU does")
def test_without_a_gpu_auto_decodes_on_the_cpu_and_gpu_is_refused(tmp_path):
    write_tree(tmp_path / "train")
    auto = ImageFolderDataConfig(path=str(tmp_path / "train"))
    assert auto.dataset_kwargs()["decode"] == "cpu"
    with pytest.raises(ConfigError, match="data.decode='gpu': no CUDA GPU is visible"):
        ImageFolderDataConfig(path=str(tmp_path / "train"), decode="gpu")
    built = ImageFolder("train", path=str(tmp_path / "train"), decode="gpu", eval_samples=2)
    with pytest.raises(ConfigError, match="data.decode='gpu': no CUDA GPU is visible"):
        built.device_decoder(torch.device("cpu"))


def test_decode_gpu_workers_hand_over_jpeg_bytes_and_png_pixels(tmp_path):
    """The worker half of decode=gpu, on any host: a JPEG's bytes and reference crop, a PNG's
    reference pixels, gathered into one batch in their places."""
    from mgpu.data.encoded import collate_encoded

    files = write_tree(tmp_path / "train")
    kwargs = folder(tmp_path / "train", tmp_path / "train", decode="gpu")
    dataset = ImageFolder("train", **{**kwargs, "classes": CLASSES})
    keys = [SampleKey(i, 4, 2) for i in (5, 0, 3, 6)]  # png, jpg, png, jpg
    batch = collate_encoded([dataset[k] for k in keys])
    assert batch.jpeg_at.tolist() == [1, 3] and batch.pixels_at.tolist() == [0, 2]
    assert batch.labels.tolist() == [files[k.index][1] for k in keys]
    for data, box, flip, key in zip(batch.jpegs, batch.boxes, batch.flips, keys[1::2], strict=True):
        path = files[key.index][0]
        assert data.numpy().tobytes() == Path(path).read_bytes()
        width, height = Image.open(path).size
        assert (*box, bool(flip)) == reference_crop(width, height, key.seed, key.epoch, key.index)
    for pixels, key in zip(batch.pixels, keys[0::2], strict=True):
        assert torch.equal(pixels, reference_train(files, key)[0])


@pytest.mark.gpu
def test_every_tensor_the_decode_step_moves_to_the_gpu_is_pinned(tmp_path):
    """DataLoader(pin_memory=True) pins a batch through EncodedBatch.pin_memory: each tensor the
    decode step copies to the GPU, so that no copy waits on the host (pageable memory would)."""
    from mgpu.data.encoded import collate_encoded

    write_tree(tmp_path / "train")
    kwargs = folder(tmp_path / "train", tmp_path / "train", decode="gpu")
    dataset = ImageFolder("train", **{**kwargs, "classes": CLASSES})
    keys = [SampleKey(i, 4, 2) for i in (5, 0, 3, 6)]  # png, jpg, png, jpg
    batch = collate_encoded([dataset[k] for k in keys]).pin_memory()
    for name in ("data", "pixels", "pixels_at", "flips", "labels"):
        assert getattr(batch, name).is_pinned(), name


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory) -> tuple[Path, list[str], subprocess.CompletedProcess]:
    """18 images of 3 classes and `python train.py` over them with neither the holdout nor the
    classes set, data.path relative to where it starts: one launch that
    test_a_small_folder_trains_with_the_default_holdout_and_classes reads and
    test_resumed_run_trains_on_the_same_crops_bitwise resumes from its step-4 checkpoint.
    Returns the folder it ran in, its arguments (without its run directory) and the run."""
    root = tmp_path_factory.mktemp("folder_run")
    write_tree(root / "train", per_class=6)
    args = ["data=image_folder", "data.path=train", "data.decode=cpu"]
    args += ["data.cpu_decode_share=auto"]
    args += ["data.image_size=16", "data.batch_size=4", "data.num_workers=1"]
    args += ["model=resnet_tiny", "trainer.max_steps=10"]
    args += ["trainer.log_every=2", "trainer.eval_every=0", "ckpt.every=4"]
    whole = train_on_cpu([*args, f"hydra.run.dir={root / 'a'}"], root)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return root, args, whole


def test_resumed_run_trains_on_the_same_crops_bitwise(folder_run):
    """decode=cpu: a run resumed from its step-4 checkpoint logs the losses of the run that went
    on, to the bit (the crops of the steps after 4 are drawn from the same keys). Its checkpoint
    keeps the data set's decode share and where it decoded (tests/test_decode_split.py: a GPU
    run's share is taken back on resume)."""
    from mgpu.ckpt.checkpoint import load

    root, args, whole = folder_run
    start = root / "a" / "checkpoints" / "step-00000004"
    resumed = train_on_cpu([*args, f"ckpt.resume={start}", f"hydra.run.dir={root / 'b'}"], root)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # decode=cpu's share, 0 and never measured: the resumed run does not take it as measured
    saved = {"cpu_decode_share": 0.0, "cpu_decode_share_scaled": 0.0, "decode": "cpu"}
    saved["workers_from"] = None  # nothing moved to the workers (mgpu.data.decode_switch)
    # and which images its evaluations held out: those the folder's eval split holds out now
    saved["held_out"] = ImageFolder("eval", **folder(root / "train", eval_samples=3)).held_out
    assert load(start, rank=0).shared["dataset"] == saved
    for run in (whole, resumed):
        assert "auto: 0 (nothing is decoded on the GPU)" in run.stdout + run.stderr
    losses = [dict(read_scalars(root / run)["train/loss"]) for run in ("a", "b")]
    # 15 training images (3 held out), 3 steps an epoch: steps 5-10 go from the middle of the
    # second epoch into a fourth
    assert [losses[1][s] for s in (6, 8, 10)] == [losses[0][s] for s in (6, 8, 10)], losses


def test_a_class_folder_added_since_the_checkpoint_is_said_with_the_way_out(folder_run, tmp_path):
    """The classes are found again at every start: a folder added since the checkpoint makes
    another head, refused in one line that names the folder added and how to keep the
    checkpoint's labels, exit 2, nothing written."""
    root, args, _ = folder_run
    shutil.copytree(root / "train", tmp_path / "train")
    shutil.copytree(tmp_path / "train" / "cow", tmp_path / "train" / "dog")
    shutil.copytree(root / "a", tmp_path / "a")
    again = train_on_cpu([*args, f"hydra.run.dir={tmp_path / 'a'}"], tmp_path)
    assert again.returncode == 2, again.stderr[-3000:]
    said = again.stdout + again.stderr
    (line,) = [x for x in said.splitlines() if "the model does not match" in x]
    assert "model.num_classes 3 -> 4" in line, line
    assert "the class folders changed (3 -> 4 classes; added: dog): move the added" in line, line
    assert "data.classes" in line and "config.yaml" in line, line


def test_a_folder_whose_images_changed_since_the_checkpoint_is_refused_with_the_way_out(
    folder_run, tmp_path
):
    """A resume over the folder's images as they were, or refused in one line, exit 2, with
    nothing written to the run directory: an image removed (as the unreadable-file stop tells
    a user to) changes the training set, and the line says what changed and that an unreadable
    one is kept and replaced with data.bad_files=skip; an image renamed keeps the count, but the
    holdout then takes an image the run trained on; a class folder renamed, or the classes
    given in another order, keeps the model's shapes, but not what its labels mean."""
    root, args, _ = folder_run
    for case in ("removed", "renamed", "class", "order"):
        shutil.copytree(root / "train", tmp_path / case / "train")
        shutil.copytree(root / "a", tmp_path / case / "a")
        ant = tmp_path / case / "train" / "ant"
        if case == "removed":
            (ant / "img05.png").unlink()
        elif case == "renamed":
            (ant / "img00.jpg").rename(ant / "zzz.jpg")
        elif case == "class":
            ant.rename(ant.parent / "gnu")
        written = sorted(p.name for p in (tmp_path / case / "a").rglob("*"))
        # a setting that does not change the samples, changed too: not named as the cause
        more = {"removed": ["data.num_workers=0"], "order": ["data.classes=[cow,bee,ant]"]}
        run = [*args, *more.get(case, []), f"hydra.run.dir={tmp_path / case / 'a'}"]
        again = train_on_cpu(run, tmp_path / case)
        assert again.returncode == 2, again.stderr[-3000:]
        said = again.stdout + again.stderr
        lines = [x for x in said.splitlines() if "hydra.run.dir=..." in x]
        assert len(lines) == 1 and "Traceback" not in said, said[-3000:]
        if case == "removed":
            assert "trained on 15 samples; this run has 14" in lines[0], lines[0]
            assert "images were added to or removed from data.path" in lines[0], lines[0]
            assert "data.bad_files=skip" in lines[0], lines[0]
        elif case == "renamed":
            assert "the images data.path holds out now are not those" in lines[0], lines[0]
        elif case == "order":
            assert "the same 3 classes in another order (data.classes)" in lines[0], lines[0]
        else:
            changed = "trained on other classes: the class folders changed (3 -> 3 classes; "
            changed += "added: gnu; gone: ant): put the missing folders back; and move the added"
            assert changed in lines[0], lines[0]
        assert sorted(p.name for p in (tmp_path / case / "a").rglob("*")) == written


def test_evaluate_refuses_a_holdout_that_holds_images_the_run_trained_on(
    folder_run, tmp_path, capsys
):
    """mgpu.evaluate of the run, in a copy of its folder: as it was, it evaluates (the held-out
    images are named relative to the folder, so a moved folder is the same); with images added
    (the sorted list shifts, and the holdout takes images the run trained on), or another
    data.eval_samples, it refuses in one line, exit 2."""
    root, _, _ = folder_run
    shutil.copytree(root / "train", tmp_path / "train")

    def evaluate(*overrides) -> tuple[int, str]:
        args = [str(root / "a"), f"data.path={tmp_path / 'train'}", "data.num_workers=0"]
        try:
            evaluate_main([*args, *overrides])
            code = 0
        except SystemExit as stop:
            code = stop.code
        out, err = capsys.readouterr()
        return code, out + err

    code, said = evaluate()
    assert code == 0 and "eval loss" in said, said
    code, said = evaluate("data.eval_samples=5")
    assert code == 2 and "data.eval_samples=5: the run held out 3 samples" in said, said
    for k in range(2):
        shutil.copy(
            tmp_path / "train" / "ant" / "img00.jpg", tmp_path / "train" / "ant" / f"a{k}.jpg"
        )
    code, said = evaluate()
    assert code == 2 and "images were added, removed or renamed since the run trained" in said


def test_export_names_the_classes_in_the_order_of_the_outputs(folder_run, tmp_path):
    """A classifier exported from an image folder run: its json holds the class list (the
    outputs' order) and the input scaling, which mgpu applies on the device, not the model."""
    root, _, _ = folder_run
    export_main([str(root / "a"), str(tmp_path / "m.safetensors")])
    config = json.loads((tmp_path / "m.json").read_text())
    assert config["data"]["classes"] == CLASSES and config["data"]["decode"] == "cpu"
    assert "(x / 255 - 0.5) / 0.25" in config["inputs"] and "[N, C, 16, 16]" in config["inputs"]


def pillow_jpegs(data: list[torch.Tensor]) -> list[torch.Tensor]:
    """A stand-in for nvJPEG on the CPU: Pillow's decode; an empty-looking 1x1 JPEG fails."""
    out = []
    for d in data:
        image = Image.open(io.BytesIO(d.numpy().tobytes()))
        if image.size == (1, 1):
            raise RuntimeError("Failed to decode batch")
        out.append(torch.from_numpy(np.asarray(image.convert("RGB")).transpose(2, 0, 1).copy()))
    return out


def test_a_cpu_share_of_the_jpegs_is_decoded_by_the_workers_as_decode_cpu_does(tmp_path):
    """data.cpu_decode_share under decode=gpu: the JPEGs it picks come as the workers' pixels,
    the very pixels decode=cpu makes for that sample; the rest as bytes and crops, as with no
    share; the pick depends on (seed, epoch, sample) alone, so a copy (another process, a
    resumed run) picks the same; PNGs stay on the CPU either way."""
    import pickle

    write_tree(tmp_path / "train", per_class=24, sizes=((40, 50), (30, 44)))
    kwargs = {**folder(tmp_path / "train", eval_samples=2), "classes": CLASSES}
    cpu = ImageFolder("train", **kwargs)
    gpu = ImageFolder("train", **{**kwargs, "decode": "gpu"})
    shared = ImageFolder("train", **{**kwargs, "decode": "gpu", "cpu_decode_share": 0.4})
    copy = pickle.loads(pickle.dumps(shared))
    jpegs = [i for i, f in enumerate(gpu.files) if f.endswith(".jpg")]
    picked = {}
    for epoch in (0, 1):
        keys = [SampleKey(i, epoch, 5) for i in jpegs]
        on_cpu = [k for k in keys if shared[k].data is None]
        picked[epoch] = {k.index for k in on_cpu}
        assert 0.25 * len(keys) < len(on_cpu) < 0.55 * len(keys), len(on_cpu)
        assert [k for k in keys if copy[k].data is None] == on_cpu
        for k in keys:
            item, plain = shared[k], gpu[k]
            assert plain.data is not None and item.label == plain.label
            if k in on_cpu:
                assert torch.equal(item.pixels, cpu[k][0])
            else:
                assert (item.data, item.box, item.flip) == (plain.data, plain.box, plain.flip)
    assert picked[0] != picked[1]  # drawn anew each epoch
    png = next(i for i, f in enumerate(gpu.files) if f.endswith(".png"))
    assert gpu[SampleKey(png, 0, 5)].data is None and shared[SampleKey(png, 0, 5)].data is None
    must = r"data.cpu_decode_share=1.0: must be auto or in \[0, 1\)"
    with pytest.raises(ConfigError, match=must):
        ImageFolderDataConfig(**folder(tmp_path / "train"), cpu_decode_share=1.0)


def test_decode_step_crops_like_the_workers_and_replaces_bad_jpegs(tmp_path):
    """decode=gpu's batch step on the CPU, with Pillow standing in for nvJPEG: the crops match
    decode=cpu's within a level (torch's antialiased resize against Pillow's), in their places,
    with their labels; a JPEG the decoder refuses is named (error) or replaced (skip)."""
    from mgpu.data.encoded import collate_encoded
    from mgpu.data.gpu_decode import BatchDecoder, resize_each

    write_tree(tmp_path / "train", per_class=6, sizes=((150, 200), (90, 60), (40, 64)))
    kwargs = {**folder(tmp_path / "train", eval_samples=2), "image_size": 32, "classes": CLASSES}
    # the same full-size decode on both sides: only the resize differs
    cpu = ImageFolder("train", **kwargs, reduced_decode=False)
    gpu = ImageFolder("train", **{**kwargs, "decode": "gpu"})
    step = BatchDecoder(gpu, torch.device("cpu"), pillow_jpegs, resize_each)
    keys = [SampleKey(i, 1, 4) for i in range(len(cpu))]
    images, labels = step(collate_encoded([gpu[k] for k in keys]))
    expected = torch.stack([cpu[k][0] for k in keys])
    assert torch.equal(labels, torch.tensor([cpu[k][1] for k in keys]))
    assert (images.int() - expected.int()).abs().max() <= 1
    # the third JPEG made undecodable, header and all intact
    items = [gpu[k] for k in keys]
    jpegs = [k for k, item in enumerate(items) if item.data is not None]
    tiny = io.BytesIO()
    Image.new("RGB", (1, 1)).save(tiny, format="JPEG")
    items[jpegs[2]].data, items[jpegs[2]].box = tiny.getvalue(), (0, 0, 1, 1)
    with pytest.raises(BadImageFile, match=rf"{gpu.files[jpegs[2]]}: cannot be decoded.*skip"):
        step(collate_encoded(items))
    gpu.bad_files = "skip"
    images, labels = step(collate_encoded(items))
    assert gpu.replaced() == 1
    # its place takes the batch's next JPEG, crop and label too
    assert torch.equal(images[jpegs[2]], images[jpegs[3]])
    assert labels[jpegs[2]] == labels[jpegs[3]]
    # two bad JPEGs in one batch: one error naming both
    items[jpegs[0]].data, items[jpegs[0]].box = tiny.getvalue(), (0, 0, 1, 1)
    gpu.bad_files = "error"
    with pytest.raises(BadImageFile, match=r"2 JPEGs of one batch cannot be decoded") as caught:
        step(collate_encoded(items))
    assert gpu.files[jpegs[0]] in str(caught.value) and gpu.files[jpegs[2]] in str(caught.value)
    # every JPEG decoded by the workers (data.cpu_decode_share=auto's move): the batch is their
    # pixels in the batch's order, labels alike
    gpu.workers_decode_from(0)
    items = [gpu[k] for k in reversed(keys)]
    images, labels = step(collate_encoded(items))
    assert all(item.data is None for item in items)
    assert torch.equal(images, torch.stack([item.pixels for item in items]))
    assert torch.equal(labels, torch.tensor([item.label for item in items]))


@pytest.mark.gpu
def test_batched_gpu_crops_match_the_per_image_reference():
    """decode=gpu's two batched kernels (gpu_resize.resize_into) against torch's antialiased
    resize image by image (gpu_decode.resize_each): images of different sizes, boxes that
    shrink (up to 8x) and grow, thin ones, flips, slots out of order, three output sizes.
    Noise is the hardest input for a filter: every weight shows."""
    pytest.importorskip("triton")
    from mgpu.data.gpu_decode import resize_each
    from mgpu.data.gpu_resize import resize_into

    g = torch.Generator().manual_seed(0)
    sizes = [(375, 500), (500, 375), (1800, 2400), (64, 96), (20, 30), (333, 250)]
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in sizes]
    images = [image.cuda() for image in images]
    boxes = [(0, 0, 500, 375), (10, 37, 300, 90), (100, 200, 2000, 1500), (3, 5, 40, 50)]
    boxes += [(0, 0, 30, 20), (17, 1, 5, 331)]
    flips = [False, True, True, False, True, False]
    slots = [3, 0, 5, 1, 2, 4]
    for size in (224, 64, 301):
        fast = torch.zeros(len(images), 3, size, size, dtype=torch.uint8, device="cuda")
        slow = torch.zeros_like(fast)
        resize_into(fast, images, boxes, flips, slots)
        resize_each(slow, images, boxes, flips, slots)
        diff = (fast.int() - slow.int()).abs()
        # float sums in another order: a value near .5 may round the other way
        assert diff.max() <= 1 and diff.float().mean() < 0.01, (
            size,
            diff.max(),
            diff.float().mean(),
        )


def test_reduced_decode_stays_close_to_a_full_decode(tmp_path):
    """DCT-scaled decoding (data.reduced_decode, the default) against a full decode then the
    same crop and resize: a photo-sized JPEG, train crops at 1/2, 1/4 and 1/8 and eval's
    center crop. The reduced decode low-passes with the IDCT instead of the resize's triangle,
    so pixels differ a little; a box mapped to the wrong place would differ by tens of levels."""
    from mgpu.data.crops import DCT_FACTORS, draft_for_crop

    write_tree(tmp_path / "train", per_class=3, sizes=((1200, 1600), (90, 70), (250, 330)))
    kwargs = {**folder(tmp_path / "train", eval_samples=2), "image_size": 64, "classes": CLASSES}
    reduced, full = (
        ImageFolder("train", **kwargs),
        ImageFolder("train", **kwargs, reduced_decode=False),
    )
    factors = set()
    for i in range(len(full)):
        if not full.files[i].endswith(".jpg"):
            continue
        for epoch in range(8):
            key = SampleKey(i, epoch, 3)
            image = Image.open(full.files[i])
            box, _ = full.crop(i, *image.size, epoch, 3)
            scaled = draft_for_crop(image, box, 64)
            factors.add(round(box[2] / scaled[2]) if scaled != box else 1)
            diff = (reduced[key][0].int() - full[key][0].int()).abs().float()
            # seen: mean <= 0.27, max 3 (on photo-like noise, bench/README: mean 1.4, max 20)
            assert diff.mean() < 1 and diff.max() <= 8, (key, box, diff.mean(), diff.max())
    assert factors >= set(DCT_FACTORS), factors  # every reduction ran
    evals = [ImageFolder("eval", **kwargs, reduced_decode=r) for r in (True, False)]
    for i in range(len(evals[0])):
        diff = (evals[0][i][0].int() - evals[1][i][0].int()).abs().float()
        assert diff.mean() < 1, (i, diff.mean())


def test_check_images_names_every_unreadable_file_as_training_would_meet_it(tmp_path, capsys):
    """python -m mgpu.data.check_images: the files it names are exactly those the training
    path's reading refuses (BadImageFile), every one of them; exit 1, then 0 once they are
    gone, and 2 for a folder that is not an image folder."""
    files = write_tree(tmp_path / "train", per_class=6)
    Path(files[1][0]).write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 20)  # a broken PNG
    whole = Path(files[8][0]).read_bytes()
    Path(files[8][0]).write_bytes(whole[: len(whole) // 2])  # a JPEG cut short
    Path(files[13][0]).write_bytes(b"garbage")
    cfg = ImageFolderDataConfig(**folder(tmp_path / "train", eval_root=tmp_path / "train"))
    dataset = ImageFolder("eval", **cfg.dataset_kwargs())  # every file, in write_tree's order
    refused = set()
    for i, path in enumerate(dataset.files):
        try:
            dataset.__getitems__([i])
        except BadImageFile:
            refused.add(path)
    assert refused == {files[1][0], files[8][0], files[13][0]}

    # One launch as users run it, with its default workers (a process per CPU); the checks
    # after it call the same main() in this process, one worker (no fork of pytest's process):
    # its exit code, and what it prints.
    command = [sys.executable, "-m", "mgpu.data.check_images", str(tmp_path / "train")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    named = {line.strip().split(": not a readable image")[0] for line in proc.stdout.splitlines()
             if "not a readable image" in line}  # fmt: skip
    assert proc.returncode == 1 and named == refused, proc.stdout + proc.stderr
    assert "3 of 18 images unreadable" in proc.stdout and "data.bad_files=skip" in proc.stderr

    def check(*args):
        with pytest.raises(SystemExit) as stop:
            check_images([*args, "--workers", "1"])
        return stop.value.code, *capsys.readouterr()

    for path in refused:
        Path(path).unlink()
    code, out, err = check(str(tmp_path / "train"))
    assert code == 0 and "all 15 images readable" in out, err
    # a folder that is not an image folder: 2, and the others are still checked
    Path(files[2][0]).write_bytes(b"garbage")
    code, out, err = check(str(tmp_path / "nowhere"), str(tmp_path / "train"))
    assert code == 2 and "does not exist" in err, err
    assert "1 of 15 images unreadable" in out and files[2][0] in out


def test_what_the_folder_holds_but_does_not_read_is_said_by_training_and_check_images(
    tmp_path, caplog, capsys, monkeypatch
):
    """A sub-folder of a class folder, a file of another format, an image beside the class
    folders: none is read, and both training (a warning) and check_images say each kind, with
    the files; hidden files are not mentioned; a sub-folder named like an image is a sub-folder.
    Each folder is listed once to learn all of it (a tree on network storage)."""
    write_tree(tmp_path / "train", per_class=2)
    (tmp_path / "train" / "ant" / "nested").mkdir()
    (tmp_path / "train" / "cow" / "odd.jpg").mkdir()
    (tmp_path / "train" / "notes.txt").symlink_to(tmp_path / "gone.txt")  # a file's dead link
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "ant" / "nested" / "n.jpg")
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "bee" / "b.webp")
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "stray.jpg")
    (tmp_path / "train" / "cow" / ".DS_Store").write_bytes(b"\0")
    cfg = ImageFolderDataConfig(**folder(tmp_path / "train", eval_samples=1))
    listed, scandir, listdir = [], os.scandir, os.listdir
    monkeypatch.setattr(os, "scandir", lambda path: listed.append(str(path)) or scandir(path))
    monkeypatch.setattr(os, "listdir", lambda path: listed.append(str(path)) or listdir(path))
    with caplog.at_level("WARNING", logger="mgpu.data.image_folder"):
        dataset = ImageFolder("train", **cfg.dataset_kwargs())
    monkeypatch.undo()
    assert sorted(listed) == sorted({*listed}), listed  # no folder listed twice
    assert len(dataset) == 5 and not any("nested" in f or "webp" in f for f in dataset.files)
    assert not any("odd" in f for f in dataset.files)
    assert count_images(str(tmp_path / "train"), CLASSES) == len(dataset.files) + 1  # 1 held
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for words in ("2 file(s) beside the class folders", "notes.txt", "stray.jpg", "2 sub-folder(s)",
                  "ant/nested/", "cow/odd.jpg/", "1 file(s) not .jpg, .jpeg or .png",
                  "bee/b.webp"):  # fmt: skip
        assert words in said, said
    assert ".DS_Store" not in said
    with pytest.raises(SystemExit) as stop:
        check_images([str(tmp_path / "train"), "--workers", "1"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "all 6 images readable" in out, out
    assert "ant/nested/" in out and "bee/b.webp" in out and "stray.jpg" in out, out


def test_a_16_bit_grayscale_png_is_scaled_to_8_bits_not_clipped(tmp_path):
    """A 16-bit PNG (Pillow's mode I;16) gives the pixels of its 8-bit version (the top byte
    of each value), where a plain conversion clipped every value above 255 to white."""
    deep = (np.linspace(0, 65535, 24 * 32).reshape(24, 32)).astype(np.uint16)
    for name, pixels in (("deep", deep), ("flat", (deep >> 8).astype(np.uint8))):
        for label in ("a", "b"):
            (tmp_path / name / label).mkdir(parents=True)
            Image.fromarray(pixels).save(tmp_path / name / label / "0.png")
    assert Image.open(tmp_path / "deep" / "a" / "0.png").mode.startswith("I")
    got, want = (
        ImageFolder("eval", **folder(tmp_path / name, eval_samples=1))[0][0]
        for name in ("deep", "flat")
    )
    assert torch.equal(got, want) and got.float().std() > 10


# ---- settings that follow the folder ----


def test_auto_holdout_is_a_share_with_a_floor_and_a_ceiling():
    assert [auto_eval_samples(n) for n in (10, 90, 800, 5_000, 1_281_167)] == [
        2,  # a fifth of a tiny folder: the rest trains
        16,  # the floor
        16,
        100,  # 2 %
        10_000,  # the ceiling
    ]


def test_a_small_folder_trains_with_the_default_holdout_and_classes(folder_run):
    """18 images of 3 classes, neither the holdout nor the classes set: data.eval_samples=auto
    holds 3 out (a fifth of a tiny folder; the old default of 1000 stopped the run once its
    directory existed), and model.num_classes=auto is the folder's 3; the run's config.yaml
    records both. (The auto holdout's floor and ceiling: the test above.)"""
    run_dir = folder_run[0] / "a"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["data"]["eval_samples"], saved["model"]["num_classes"]) == (3, 3)
    state = torch.load(next(run_dir.glob("checkpoints/*/state.pt")), weights_only=True)
    assert state["model"]["fc.weight"].shape[0] == 3  # the head has the folder's classes


def test_too_many_held_out_images_stop_in_the_config_check(tmp_path):
    write_tree(tmp_path / "train", per_class=3)  # 9 images
    with pytest.raises(ConfigError, match=r"data\.eval_samples=9: data\.path holds only 9 images"):
        ImageFolderDataConfig(**folder(tmp_path / "train", eval_samples=9))
    assert (
        ImageFolderDataConfig(**folder(tmp_path / "train", eval_samples="auto")).eval_samples == 1
    )


def test_a_folder_short_of_a_batch_per_process_stops_in_the_config_check(tmp_path):
    """12 images, 2 held out: a batch of 5 for each of 2 processes, not of 6; said by train.py's
    first step, before any run directory (the loader would say it once the run existed)."""
    write_tree(tmp_path / "train", per_class=4)
    cfg = ImageFolderDataConfig(**folder(tmp_path / "train", batch_size=5))
    cfg.check_train_batches(world_size=2)
    cfg.batch_size = 6
    with pytest.raises(ConfigError, match="each of the 2 processes gets only 5 training samples"):
        cfg.check_train_batches(world_size=2)
    args = ["model=resnet_tiny", "data=image_folder", "data.path=train", "data.batch_size=11"]
    line = said_by_train_py(args, tmp_path)
    assert "data.batch_size=11: each of the 1 processes gets only 10 training samples" in line
