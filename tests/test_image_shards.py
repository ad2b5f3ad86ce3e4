"""data=image_shards and python -m mgpu.data.prepare_images: a prepared set against the folder it
was made from (the same samples, bitwise when nothing is resized; the folder's crop of the same
box when it is), the tar layout read back with tarfile, every input mode stored as a baseline
JPEG, bad files, a run killed mid-write, and a run resumed mid-epoch."""

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tarfile
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, read_scalars, run_train, said_by_train_py
from PIL import Image
from test_image_folder import cpu_runtime, reference_pixels, smooth_image

from mgpu.config.checks import ConfigError
from mgpu.data import ImageFolder, ImageShards
from mgpu.data.config import ImageFolderDataConfig, ImageShardsDataConfig
from mgpu.data.encoded import Encoded
from mgpu.data.loader import build_loader
from mgpu.data.prepare_images import main as prepare
from mgpu.data.sampler import SampleKey

CLASSES = ["ant", "bee", "cow"]
SIZE = 12  # the crops' side
KINDS = ["rgb.jpg", "gray.jpg", "cmyk.jpg", "progressive.jpg"]
KINDS += ["rgb.png", "rgba.png", "palette.png", "gray.png"]


def save(image: Image.Image, path: Path, kind: str) -> None:
    """`image` (RGB) stored as one of the KINDS of file a folder may hold."""
    if kind.endswith(".jpg"):
        mode = {"gray.jpg": "L", "cmyk.jpg": "CMYK"}.get(kind, "RGB")
        image.convert(mode).save(path, quality=90, progressive=kind == "progressive.jpg")
    elif kind == "rgba.png":
        image.putalpha(Image.linear_gradient("L").resize(image.size))
        image.save(path)
    elif kind == "palette.png":
        image.convert("P", palette=Image.Palette.ADAPTIVE).save(path)
    else:
        image.convert("L" if kind == "gray.png" else "RGB").save(path)


def write_tree(root: Path, kinds, per_class=4, seed=0, sizes=((18, 24), (40, 26))) -> list:
    """CLASSES folders of smooth images, file k of kind kinds[k % len(kinds)] and (height,
    width) sizes[k % len(sizes)]; their (relative path, label) in the documented order."""
    rng = np.random.default_rng(seed)
    files = []
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for k in range(per_class):
            kind, (h, w) = kinds[k % len(kinds)], sizes[k % len(sizes)]
            rel = f"{name}/img{k:02d}_{kind}"
            save(Image.fromarray(smooth_image(rng, h, w)), root / rel, kind)
            files.append((rel, label))
    return files


def run_prepare(src: Path, dst: Path, *extra: str, max_side=1000, workers=1) -> None:
    """The command, in this process (pytest's capsys holds what it prints)."""
    prepare([str(src), str(dst), "--max-side", str(max_side), "--workers", str(workers), *extra])


def configs(src: Path, dst: Path, src_eval="", dst_eval="", **kwargs):
    """The folder's and the prepared set's configs, alike in every other key."""
    args = dict(image_size=SIZE, decode="cpu", eval_samples=2, num_workers=0, **kwargs)
    return (
        ImageFolderDataConfig(path=str(src), eval_path=str(src_eval), **args),
        ImageShardsDataConfig(path=str(dst), eval_path=str(dst_eval), **args),
    )


def stored(dst: Path) -> dict[str, bytes]:
    """Each sample's stored JPEG by original path, read with tarfile and the key."""
    index = json.loads((dst / "index.json").read_text())
    paths = {f"{k:09d}.jpg": row[4] for k, row in enumerate(index["samples"])}
    out = {}
    for shard in index["shards"]:
        with tarfile.open(dst / shard["name"]) as tar:
            out.update({paths[m.name]: tar.extractfile(m).read() for m in tar if m.name in paths})
    return out


def listing(dst: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dst.iterdir())}


def level_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.int() - b.int()).abs().float()


# ---- a set of unresized JPEGs: the folder's samples, bit for bit ----


@pytest.fixture(scope="module")
def unresized(tmp_path_factory):
    """Baseline RGB and grayscale JPEGs (train, and val), prepared with a --max-side above
    every image, in shards of a few images each."""
    root = tmp_path_factory.mktemp("unresized")
    files = write_tree(root / "train", KINDS[:2], per_class=5)
    write_tree(root / "val", KINDS[:2], per_class=1, seed=1)
    for name in ("train", "val"):
        run_prepare(root / name, root / f"{name}-set", "--shard-mb", "0.008", max_side=64)
    return root, files


def test_tar_layout_and_index_read_back_with_tarfile(unresized):
    root, files = unresized
    dst = root / "train-set"
    index = json.loads((dst / "index.json").read_text())
    assert index["classes"] == CLASSES and len(index["shards"]) > 2
    assert [(row[4], row[3]) for row in index["samples"]] == files
    for number, shard in enumerate(index["shards"]):
        assert shard["name"] == f"shard-{number:06d}.tar"
        rows = [row for row in index["samples"] if row[0] == number]
        with tarfile.open(dst / shard["name"]) as tar:
            members = tar.getmembers()
            labels = [int(tar.extractfile(m).read()) for m in members[1::2]]
        # WebDataset's layout: <key>.jpg, then <key>.cls holding the label as text
        assert [m.name for m in members[1::2]] == [m.name[:-4] + ".cls" for m in members[::2]]
        assert [(m.offset_data, m.size) for m in members[::2]] == [tuple(r[1:3]) for r in rows]
        assert labels == [row[3] for row in rows]
    # nothing to resize or convert: each file's own bytes
    assert stored(dst) == {rel: (root / "train" / rel).read_bytes() for rel, _ in files}


def test_unresized_set_gives_the_folders_samples_bitwise(unresized):
    root, _ = unresized
    folder_cfg, shards_cfg = configs(root / "train", root / "train-set")
    folder = ImageFolder("train", **folder_cfg.dataset_kwargs())
    shards = ImageShards("train", **shards_cfg.dataset_kwargs())
    assert shards_cfg.classes == CLASSES and shards.labels == folder.labels
    names = [os.path.relpath(f, root / "train") for f in folder.files]
    assert [f.split(".tar:")[1] for f in shards.files] == names
    for epoch in (0, 1):
        for i in range(len(folder)):
            key = SampleKey(i, epoch, 7)
            (a, label_a), (b, label_b) = folder[key], shards[key]
            assert torch.equal(a, b) and label_a == label_b, (key, shards.files[i])
    # evaluation: the held-out images, and a prepared validation set as data.eval_path
    for pair in (
        configs(root / "train", root / "train-set"),
        configs(root / "train", root / "train-set", root / "val", root / "val-set"),
    ):
        folder = ImageFolder("eval", **pair[0].dataset_kwargs())
        shards = ImageShards("eval", **pair[1].dataset_kwargs())
        assert len(folder) == len(shards) > 0 and shards.labels == folder.labels
        assert all(torch.equal(folder[i][0], shards[i][0]) for i in range(len(folder)))


def test_loader_workers_map_the_shards_themselves(unresized):
    """Batches from 2 forked DataLoader workers, after this process mapped every shard; a
    dataset that has mapped them still pickles (as spawned workers get it) and reads."""
    root, _ = unresized
    folder_cfg, shards_cfg = configs(root / "train", root / "train-set", batch_size=3)
    shards_cfg.num_workers = folder_cfg.num_workers = 2
    folder = ImageFolder("train", **folder_cfg.dataset_kwargs())
    shards = ImageShards("train", **shards_cfg.dataset_kwargs())
    for i in range(len(shards)):
        shards.read_bytes(i)  # this process's maps, in the workers' forked copies too
    copy = pickle.loads(pickle.dumps(shards))
    assert all(copy.read_bytes(i) == shards.read_bytes(i) for i in range(len(shards)))
    batches = []
    for cfg, dataset in ((folder_cfg, folder), (shards_cfg, shards)):
        # closed on the way out, failing or not: its persistent workers would outlive the test
        with build_loader(cfg, dataset, cpu_runtime(), seed=3, train=True) as loader:
            loader.set_epoch(2)
            epoch = islice(loader, len(loader))  # epoch 2 of the stream
            batches.append([torch.cat(t) for t in zip(*epoch, strict=True)])
    assert all(torch.equal(a, b) for a, b in zip(*batches, strict=True))
    # decode=gpu's worker half: the JPEG's bytes and the same crop box
    gpu = ImageShards("train", **{**shards_cfg.dataset_kwargs(), "decode": "gpu"})
    cpu_gpu = ImageFolder("train", **{**folder_cfg.dataset_kwargs(), "decode": "gpu"})
    for i in range(len(gpu)):
        a, b = cpu_gpu[SampleKey(i, 1, 5)], gpu[SampleKey(i, 1, 5)]
        assert (a.data, a.box, a.flip, a.label) == (b.data, b.box, b.flip, b.label)


@pytest.mark.parametrize(
    "lose, classes, key, needle",
    [
        ("train-set/shard-000001.tar", [], "data.path", "shard-000001.tar is missing"),
        ("", ["ant", "dog"], "data.path", r"holds no images of the classes \['dog'\]"),
        ("", ["ant", "bee"], "data.eval_path", r"has classes \['cow'\] that are not among"),
    ],
)
def test_schema_checks_a_set_in_one_line(unresized, tmp_path, lose, classes, key, needle):
    shutil.copytree(unresized[0], tmp_path, dirs_exist_ok=True)
    if lose:
        (tmp_path / lose).unlink()
    args = dict(path=str(tmp_path / "train-set"), eval_path=str(tmp_path / "val-set"))
    with pytest.raises(ConfigError, match=f"^{key}='.*': .*{needle}") as err:
        ImageShardsDataConfig(**args, classes=classes)
    assert "\n" not in str(err.value)


def test_a_set_trained_on_one_class_is_one_line(unresized):
    args = dict(path=str(unresized[0] / "train-set"), classes=["ant"])
    with pytest.raises(ConfigError, match=r"^data.classes=\['ant'\]: gives one class"):
        ImageShardsDataConfig(**args)


# ---- resized and converted images ----


def test_resized_set_matches_the_folders_crop_of_the_same_box(tmp_path):
    """--max-side 24 of 48-90 pixel sides: a sample is the folder's crop of the same box, scaled
    to the original's pixels, within 2 levels on average and 12 at most (seen: 1.1 and 7). What
    differs: the stored image was resized once (Lanczos) and re-encoded (JPEG q90) before the
    crop's own bilinear resize, and the box, whole pixels of the smaller image, lands up to 1.5
    original pixels off, which on these gradients (up to 6 levels a pixel) moves a value a few
    levels. The control: the box left unscaled is tens of levels off."""
    files = write_tree(
        tmp_path / "src", ["rgb.jpg", "rgb.png"], per_class=4, sizes=((60, 90), (75, 48))
    )
    run_prepare(tmp_path / "src", tmp_path / "dst", max_side=24)
    for rel, data in stored(tmp_path / "dst").items():
        small, (width, height) = (
            Image.open(io.BytesIO(data)),
            Image.open(tmp_path / "src" / rel).size,
        )
        assert min(small.size) == 24 and abs(small.width / small.height - width / height) < 0.05
    shards = ImageShards("train", path=str(tmp_path / "dst"), image_size=SIZE, eval_samples=2)
    held = (3, 9)  # holdout(12, 2)
    named = [(f.split(".tar:")[1], y) for f, y in zip(shards.files, shards.labels, strict=True)]
    assert named == [f for k, f in enumerate(files) if k not in held]
    means, control = [], []
    for i, name in enumerate(shards.files):
        src = tmp_path / "src" / name.split(".tar:")[1]
        small = Image.open(io.BytesIO(shards.read_bytes(i))).size
        width, height = Image.open(src).size
        (left, top, w, h), flip = shards.crop(i, *small, 2, 9)
        sx, sy = width / small[0], height / small[1]
        box = (round(left * sx), round(top * sy), round(w * sx), round(h * sy))
        pixels, _ = shards[SampleKey(i, 2, 9)]
        diff = level_diff(pixels, reference_pixels(src, box, flip))
        assert diff.mean() < 2 and diff.max() <= 12, (name, diff.mean(), diff.max())
        means.append(float(diff.mean()))
        control.append(
            float(level_diff(pixels, reference_pixels(src, (left, top, w, h), flip)).mean())
        )
    assert np.mean(control) > 5 * 2, (means, control)


def test_every_kind_of_file_is_stored_as_a_baseline_jpeg(tmp_path, capsys):
    """Grayscale, CMYK and progressive JPEGs, RGB/RGBA/palette/grayscale PNGs: each stored as
    a baseline JPEG, grayscale where the source was, with its label, and handed to nvJPEG under
    decode=gpu. Only the baseline RGB and grayscale JPEGs keep their bytes; the others decode
    to the folder path's pixels as JPEG q90 keeps them: bitwise what Pillow's q90 encoding of
    those pixels decodes to, and within 4 levels of them on average (seen: up to 3.0; these
    images carry per-pixel noise of 4 levels, which q90 and its halved chroma smooth)."""
    files = write_tree(tmp_path / "src", KINDS, per_class=len(KINDS))
    run_prepare(tmp_path / "src", tmp_path / "dst")
    assert "(6 kept as they were, 18 re-encoded)" in capsys.readouterr().out
    jpegs = stored(tmp_path / "dst")
    assert sorted(jpegs) == sorted(rel for rel, _ in files)
    for rel, data in jpegs.items():
        source = tmp_path / "src" / rel
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and not image.info.get("progressive"), rel
        assert image.mode == ("L" if "gray" in rel else "RGB"), (rel, image.mode)
        assert (data == source.read_bytes()) == rel.endswith(("rgb.jpg", "gray.jpg")), rel
        folder = Image.open(source).convert(image.mode)
        q90 = io.BytesIO()
        folder.save(q90, format="JPEG", quality=90)
        assert np.array_equal(image, Image.open(q90)) or data == source.read_bytes(), rel
        assert (
            level_diff(torch.tensor(np.asarray(folder)), torch.tensor(np.asarray(image))).mean() < 4
        ), rel
    kwargs = dict(path=str(tmp_path / "dst"), image_size=SIZE, eval_samples=2, decode="gpu")
    shards = ImageShards("train", **kwargs)
    folder = ImageFolder("train", **{**kwargs, "path": str(tmp_path / "src")})
    assert shards.labels == folder.labels
    items = [shards[SampleKey(i, 0, 1)] for i in range(len(shards))]
    assert all(isinstance(x, Encoded) and x.data is not None for x in items)
    assert [x.label for x in items] == folder.labels


def test_bad_files_are_all_named_or_skipped(tmp_path, capsys):
    write_tree(tmp_path / "src", ["rgb.jpg"], per_class=4)
    (tmp_path / "src/ant/img01_rgb.jpg").write_bytes(b"not an image")
    cut = tmp_path / "src/bee/img02_rgb.jpg"  # its header intact: only decoding it all fails
    cut.write_bytes(cut.read_bytes()[:300])
    dst = tmp_path / "dst"
    with pytest.raises(SystemExit) as stop:
        run_prepare(tmp_path / "src", dst, "--shard-mb", "0.004")
    line = str(stop.value.code)  # a message: the interpreter exits 1 with it on stderr
    assert "\n" not in line and line.count("unreadable") == 1, line
    assert stop.value.code.startswith("python -m mgpu.data.prepare_images: "), line
    for name in ("ant/img01_rgb.jpg", "bee/img02_rgb.jpg"):  # each named by its path
        assert f"{tmp_path / 'src' / name}: not a readable image (" in line, line
    assert "BytesIO" not in line and "--bad-files skip" in line, line
    assert not dst.exists()  # not even the shards written before the second, nor DST itself
    run_prepare(tmp_path / "src", dst, "--bad-files", "skip")
    out = capsys.readouterr().out
    assert "skipped 2 unreadable image(s)" in out and "ant/img01_rgb.jpg" in out, out
    index = json.loads((dst / "index.json").read_text())
    assert index["skipped"] == ["ant/img01_rgb.jpg", "bee/img02_rgb.jpg"]
    assert "not a readable image (not a format Pillow knows)" in out and "BytesIO" not in out
    shards = ImageShards("eval", path=str(dst), eval_path=str(dst))
    names = [f.split(".tar:")[1] for f in shards.files]
    assert len(names) == 10 and "ant/img01_rgb.jpg" not in names
    assert shards.labels == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize(
    "src, dst, said",
    [
        ("empty", "dst", "SRC='{tmp}/empty': has no class subfolders; put each class's"),
        ("src", "file", "DST='{tmp}/file' is a file; name a folder"),
        ("src", "src/set", "DST='{tmp}/src/set' is inside SRC='{tmp}/src'; write it somewhere"),
        ("src", "done", "DST='{tmp}/done' already holds a prepared image set (index.json); pass"),
    ],
    ids=["src-without-classes", "dst-a-file", "dst-inside-src", "dst-already-prepared"],
)
def test_a_src_or_dst_that_cannot_work_exits_2_in_one_line(tmp_path, capsys, src, dst, said):
    """As argparse exits for a bad argument, before any image is read or anything written."""
    write_tree(tmp_path / "src", ["rgb.jpg"], per_class=1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("a file")
    run_prepare(tmp_path / "src", tmp_path / "done")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_prepare(tmp_path / src, tmp_path / dst)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == "", (stop.value.code, out, err)
    line = f"python -m mgpu.data.prepare_images: {said.format(tmp=tmp_path)}"
    assert err.startswith(line) and err.count("\n") == 1, err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


# Runs the command until its 15th tar member (sample 8's JPEG, a few shards in), then kills it
# outright (SIGKILL: no handler, no clean-up), with the shard it was writing still open.
KILLED = """
import os, signal, sys, tarfile
from mgpu.data.prepare_images import main
add, calls = tarfile.TarFile.addfile, []
def addfile(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 15:
        os.kill(os.getpid(), signal.SIGKILL)
    return add(self, *args, **kwargs)
tarfile.TarFile.addfile = addfile
main(sys.argv[1:])
"""


def test_killed_run_leaves_no_index_and_training_refuses(tmp_path, capsys):
    write_tree(tmp_path / "src", ["rgb.png"], per_class=6)
    src, dst = tmp_path / "src", tmp_path / "dst"
    args = [str(src), str(dst), "--max-side", "1000", "--shard-mb", "0.008", "--workers", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", KILLED, *args], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    # what it wrote is in DST's hidden temporary folder, the open shard with them, no index
    assert os.listdir(dst) == [".prepare.tmp"]
    left = listing(dst / ".prepare.tmp")
    finished = sorted(left)[:-1]  # the last one was open
    assert sorted(left) == [f"shard-{k:06d}.tar" for k in range(len(left))], sorted(left)
    with pytest.raises(ConfigError, match="not a prepared image set"):
        ImageShardsDataConfig(path=str(dst))
    # and train.py's first step (check_command_line, here in this process) says it in one line
    # (that such a line is said alone, exit 2, is tests/test_one_line.py's launch)
    training = ["data=image_shards", f"data.path={dst}", "model=resnet_tiny"]
    line = said_by_train_py(training, tmp_path)
    assert "\n" not in line, line
    assert f"data.path='{dst}': not a prepared image set (no index.json): run python -m " in line
    # a run again replaces what the killed one left, and writes what any run writes: the same
    # bytes, with 1 worker or 2
    run_prepare(src, dst, "--shard-mb", "0.008")
    run_prepare(src, tmp_path / "again", "--shard-mb", "0.008", workers=2)
    assert listing(dst) == listing(tmp_path / "again") and len(listing(dst)) > len(finished)
    # the shards the killed run had finished are the finished run's
    assert finished and all(left[name] == listing(dst)[name] for name in finished)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_prepare(src, dst, "--shard-mb", "0.008")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "already holds a prepared image set" in err, err
    run_prepare(src, dst, "--shard-mb", "0.1", "--overwrite")
    assert sorted(listing(dst)) == ["index.json", "shard-000000.tar"]  # the old shards gone


def test_resumed_run_over_shards_trains_on_the_same_crops_bitwise(tmp_path):
    """`python train.py`, decode=cpu, the shards read by a DataLoader worker: a run resumed from
    its step-6 checkpoint (mid-epoch: 8 steps an epoch) logs the losses of the run that went
    on, to the bit. One process: what a set adds to resuming is its samples, the same in any
    rank; a 2-rank resume is tests/test_resume.py's."""
    write_tree(tmp_path / "src", KINDS[:2] + KINDS[4:5], per_class=6, sizes=((30, 40), (44, 26)))
    run_prepare(tmp_path / "src", tmp_path / "dst", max_side=20)
    args = ["data=image_shards", f"data.path={tmp_path / 'dst'}", "data.decode=cpu"]
    args += ["data.image_size=16", "data.batch_size=2", "data.num_workers=1"]
    args += ["data.eval_samples=2", "model=resnet_tiny", "trainer.max_steps=10"]
    args += ["trainer.log_every=1", "trainer.eval_every=0", "ckpt.every=3"]
    env = {"CUDA_VISIBLE_DEVICES": ""}
    whole = run_train([*args, f"hydra.run.dir={tmp_path / 'a'}"], cwd=tmp_path, env=env, nproc=None)
    assert whole.returncode == 0, whole.stderr[-3000:]
    start = tmp_path / "a" / "checkpoints" / "step-00000006"
    args += [f"ckpt.resume={start}", f"hydra.run.dir={tmp_path / 'b'}"]
    resumed = run_train(args, cwd=tmp_path, env=env, nproc=None)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = [dict(read_scalars(tmp_path / run)["train/loss"]) for run in ("a", "b")]
    # 16 training images, 2 a step: steps 7-10 end epoch 0 and cross into 1
    after = [losses[1][s] for s in range(7, 11)]
    assert after == [losses[0][s] for s in range(7, 11)], losses
    assert len(set(after)) == 4  # steps that differ: the comparison can fail
