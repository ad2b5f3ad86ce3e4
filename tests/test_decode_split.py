"""data.cpu_decode_share=auto (mgpu.data.decode_split): the rule (both sides run out of rate
together; the kind of JPEG that frees the most GPU time per core second goes to the workers
first), the measurement on the run's own JPEGs with decode=gpu's step on the CPU (Pillow
standing in for nvJPEG), a slower decode step giving the workers more, two gloo ranks agreeing
on one share, and a resumed run taking its checkpoint's share instead of measuring."""

import logging
import time
from unittest.mock import ANY

import pytest
import torch
from conftest import free_port, gloo_runtime, spawn
from PIL import Image
from test_image_folder import CLASSES, folder, pillow_jpegs, write_tree

from mgpu.config.checks import ConfigError
from mgpu.data import decode_split
from mgpu.data.config import ImageFolderDataConfig
from mgpu.data.gpu_decode import BatchDecoder, resize_each
from mgpu.data.image_folder import ImageFolder
from mgpu.data.sampler import SampleKey
from mgpu.runtime.dist import Runtime

ONE = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)


def one_kind(core, gpu):
    return decode_split.Rates(decode_split.KindRates(core, gpu, 1.0, 64), None)


@pytest.mark.parametrize("workers,core,gpu", [(14, 311, 15036), (6, 107, 6839), (1, 50, 20000)])
def test_each_side_runs_out_of_rate_at_the_same_consumption(workers, core, gpu):
    """At any rate R the step consumes, the share s loads the workers' counted rate and the
    GPU's to the same fraction: s*R / (workers*core*efficiency) == (1-s)*R / gpu; with one kind
    of JPEG measured, both kinds take that share."""
    s, scaled = decode_split.split_shares(workers, one_kind(core, gpu))
    assert 0 < s < 1 and scaled == s
    cpu_rate = workers * core * decode_split.WORKER_EFFICIENCY
    for consumed in (1000.0, 5300.0):
        assert s * consumed / cpu_rate == pytest.approx((1 - s) * consumed / gpu)
    assert decode_split.split_shares(0, one_kind(core, gpu)) == (0.0, 0.0)


def balance(workers, rates, shares):
    """(the workers' seconds, their counted cores together, and the GPU's) per JPEG of a
    stream, under `shares`."""
    cores = workers * decode_split.WORKER_EFFICIENCY
    kinds = [(rates.full, shares[0]), (rates.scaled, shares[1])]
    cpu = sum(k.fraction * x / (k.core * cores) for k, x in kinds)
    gpu = sum(k.fraction * (1 - x) / k.gpu for k, x in kinds)
    return cpu, gpu


@pytest.mark.parametrize(
    "workers,full,scaled,expect",
    [
        # a photo set's few large JPEGs: cheap on a core DCT-scaled, dear on the GPU
        (14, (230, 11000), (60, 700), "scaled all, full some"),
        (3, (230, 11000), (60, 700), "scaled some, full none"),
        # a kind the GPU decodes relatively faster than the core goes second
        (14, (60, 20000), (230, 11000), "scaled all, full some"),
    ],
)
def test_the_kind_freeing_more_gpu_time_goes_to_the_workers_first(workers, full, scaled, expect):
    """Two kinds of JPEG: the one with the most GPU time freed per core second is given to the
    workers first, then the other, until both sides spend as long on a stream's JPEGs; and no
    other pair of shares with that balance leaves the GPU less to do."""
    rates = decode_split.Rates(
        decode_split.KindRates(*full, 0.97, 64), decode_split.KindRates(*scaled, 0.03, 16)
    )
    shares = decode_split.split_shares(workers, rates)
    cpu, gpu = balance(workers, rates, shares)
    assert cpu == pytest.approx(gpu)
    first, second = (1, 0) if scaled[1] / scaled[0] < full[1] / full[0] else (0, 1)
    if expect.endswith("full some"):
        assert shares[first] == 1.0 and 0 < shares[second] < 1, shares
    else:
        assert 0 < shares[first] < 1 and shares[second] == 0.0, shares
    # the uniform share of the same balance gives the GPU more to do
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        c, g = balance(workers, rates, (mid, mid))
        lo, hi = (mid, hi) if c < g else (lo, mid)
    assert gpu < balance(workers, rates, (lo, lo))[1]


def gpu_mode_set(root, size=12):
    """JPEGs of two kinds at image size 12: 60x80 ones, mostly cropped to boxes twice that or
    more (decoded DCT-scaled on the CPU), and 16x20 ones, never; PNGs between them."""
    write_tree(root, per_class=16, sizes=((60, 80), (44, 36), (16, 20), (44, 36)))
    return gpu_mode_over(root, size)


def gpu_mode_over(root, size=12):
    """gpu_mode_set's data set over its tree, written already."""
    kwargs = {**folder(root, eval_samples=2), "image_size": size, "classes": CLASSES}
    return ImageFolder("train", **{**kwargs, "decode": "gpu"})


def test_the_measured_share_grows_when_the_gpu_decodes_slower(tmp_path, caplog):
    """The shares are measured, not assumed: the same images, a decode step made slower by a
    pause a call, give the workers larger shares; the log names the rates and the shares, and
    the data set then decodes about those shares of each kind of its JPEGs in the workers
    (gpu_mode_set's two kinds)."""
    dataset = gpu_mode_set(tmp_path / "train")
    fast = BatchDecoder(dataset, torch.device("cpu"), pillow_jpegs, resize_each)

    def paused(data):
        time.sleep(0.05)
        return pillow_jpegs(data)

    slow = BatchDecoder(dataset, torch.device("cpu"), paused, resize_each)
    rates = decode_split.measure(dataset, fast, torch.device("cpu"))
    jpegs = [i for i, f in enumerate(dataset.files) if f.endswith(".jpg")]
    assert rates is not None and rates.scaled is not None
    assert rates.full.images + rates.scaled.images == len(jpegs)  # fewer than the probe takes
    for kind in (rates.full, rates.scaled):
        assert kind.core > 0 and kind.gpu > 0 and 0 < kind.fraction < 1
    assert rates.full.fraction + rates.scaled.fraction == pytest.approx(1)
    with caplog.at_level(logging.INFO, logger="mgpu.data.decode_split"):
        fast_shares, fast_rate = decode_split.resolve_share(dataset, fast, 2, ONE)
        slow_shares, slow_rate = decode_split.resolve_share(dataset, slow, 2, ONE)
    assert fast_rate > 0 and slow_rate > 0  # the workers' rate on every JPEG, measured too
    # the share of all JPEGs (each kind's share by its fraction; which kind goes first may
    # differ between the two measurements, so each kind's share alone need not grow)
    fractions = (rates.full.fraction, rates.scaled.fraction)
    of_all = [
        sum(f * x for f, x in zip(fractions, shares, strict=True))
        for shares in (fast_shares, slow_shares)
    ]
    assert 0 < of_all[0] < of_all[1] < 1, (fast_shares, slow_shares)
    full, scaled = slow_shares
    said = [r.getMessage() for r in caplog.records]
    line = f"auto: {full:.3f} of the JPEGs decoded at full size and {scaled:.3f} of those"
    assert any(line in m for m in said), said
    decode_split.shared_split([dataset], slow_shares)
    state = dataset.checkpoint_state()
    assert (state["cpu_decode_share"], state["cpu_decode_share_scaled"]) == slow_shares
    keys = [SampleKey(i, e, 3) for e in range(8) for i in jpegs]
    by_kind = {True: [], False: []}
    for k in keys:
        width, height = Image.open(dataset.files[k.index]).size
        box, _ = dataset.crop(k.index, width, height, k.epoch, k.seed)
        by_kind[dataset.decodes_scaled(box)].append(dataset[k].data is None)
    for is_scaled, share in ((False, full), (True, scaled)):
        picked = by_kind[is_scaled]
        assert len(picked) > 20 and abs(sum(picked) / len(picked) - share) < 0.15, (share, picked)


def test_no_workers_or_no_gpu_decode_means_no_share(tmp_path):
    dataset = gpu_mode_set(tmp_path / "train")
    step = BatchDecoder(dataset, torch.device("cpu"), pillow_jpegs, resize_each)
    assert decode_split.resolve_share(dataset, step, 0, ONE) == ((0.0, 0.0), None)
    assert decode_split.resolve_share(dataset, None, 4, ONE) == ((0.0, 0.0), None)


class CpuDecoded(ImageFolder):
    """decode=gpu's data set with its decode step on the CPU (Pillow for nvJPEG)."""

    def device_decoder(self, device):
        return BatchDecoder(self, device, pillow_jpegs, resize_each)


class NoDecoder(ImageFolder):
    def device_decoder(self, device):
        raise AssertionError("a resumed run made a decode step to measure")


def test_a_resumed_run_takes_its_checkpoints_share_without_measuring(tmp_path, caplog):
    """resolve_auto with a checkpoint's state from a run that decoded on the GPU: the saved
    share, given to every data set, and no decode step made; from a run that decoded on the
    CPU (its 0 never measured): measured anew."""
    write_tree(tmp_path / "train", per_class=12, sizes=((60, 80), (44, 36)))
    kwargs = {**folder(tmp_path / "train"), "decode": "gpu"}
    train, evaluation = NoDecoder("train", **kwargs), NoDecoder("eval", **kwargs)
    saved = {"cpu_decode_share": 0.37, "cpu_decode_share_scaled": 0.9, "decode": "gpu"}
    with caplog.at_level(logging.INFO, logger="mgpu.data.decode_split"):
        decode_split.resolve_auto("auto", 3, [train, evaluation], ONE, saved)
    for dataset in (train, evaluation):
        assert dataset.checkpoint_state() == {**saved, "workers_from": None, "held_out": ANY}
    assert "0.370 (0.900 of the DCT-scaled JPEGs), the shares the checkpoint's run" in caplog.text
    # a checkpoint from before the two kinds had one share for both
    decode_split.resolve_auto("auto", 3, [train], ONE, {"cpu_decode_share": 0.2, "decode": "gpu"})
    assert train.checkpoint_state()["cpu_decode_share_scaled"] == 0.2
    # anything but auto leaves the configured number alone
    decode_split.resolve_auto(0.0, 3, [train], ONE, {"cpu_decode_share": 0.5, "decode": "gpu"})
    assert train.checkpoint_state()["cpu_decode_share"] == 0.2
    # the round trip: what a measured run saves is what its resumed run takes
    measured = CpuDecoded("train", **kwargs)
    decode_split.resolve_auto(
        "auto", 3, [measured], ONE, {"cpu_decode_share": 0.0, "decode": "cpu"}
    )
    share = measured.checkpoint_state()["cpu_decode_share_scaled"]
    assert 0 < share <= 1  # measured, not the CPU run's 0
    resumed = NoDecoder("train", **kwargs)
    decode_split.resolve_auto("auto", 3, [resumed], ONE, measured.checkpoint_state())
    assert resumed.checkpoint_state() == measured.checkpoint_state()


@pytest.mark.parametrize("left", [decode_split.MIN_PROBE, decode_split.MIN_PROBE - 1])
def test_a_bad_jpeg_is_left_out_of_the_measurement(tmp_path, left):
    """JPEGs whose header reads but whose data is cut short, among the DCT-scaled kind: the
    probe leaves them out (no error, nothing counted as replaced), and the measurement stands
    on the others: both kinds apart while MIN_PROBE of theirs are readable, as one kind when
    fewer are."""
    write_tree(tmp_path / "train", per_class=10, sizes=((60, 80), (44, 36), (16, 20), (44, 36)))
    dataset = CpuDecoded("train", **{**folder(tmp_path / "train"), "decode": "gpu"})
    full, scaled = decode_split.probe_jpegs(dataset, decode_split.PROBE_IMAGES)
    assert len(scaled) > decode_split.MIN_PROBE and len(full) >= decode_split.MIN_PROBE
    bad_ones = len(scaled) - left
    for i in scaled[:bad_ones]:
        data = open(dataset.files[i], "rb").read()
        with open(dataset.files[i], "wb") as f:
            f.write(data[: len(data) // 3])
    dataset.bad_files = "skip"
    rates = decode_split.measure(dataset, dataset.device_decoder("cpu"), torch.device("cpu"))
    assert rates is not None
    measured = rates.full.images + (rates.scaled.images if rates.scaled else 0)
    assert measured == len(full) + len(scaled) - bad_ones
    assert (rates.scaled is None) == (left < decode_split.MIN_PROBE)
    assert dataset.replaced() == 0


def test_a_set_without_jpegs_for_the_gpu_is_not_measured(tmp_path):
    """Only PNGs: nothing to measure, share 0, said as such (not a failed measurement)."""
    write_tree(tmp_path / "train", per_class=8, sizes=((40, 30),))
    for path in (tmp_path / "train").rglob("*.jpg"):
        path.unlink()
    dataset = CpuDecoded("train", **{**folder(tmp_path / "train"), "decode": "gpu"})
    assert decode_split.measure(dataset, dataset.device_decoder("cpu"), torch.device("cpu")) is None


def test_the_share_reaches_the_dataloader_workers(tmp_path):
    """Set before the workers start, the share is what they decode by: about that share of the
    JPEGs comes back as the workers' pixels."""
    from torch.utils.data import DataLoader

    write_tree(tmp_path / "train", per_class=24, sizes=((40, 30),))
    dataset = ImageFolder("train", **{**folder(tmp_path / "train"), "decode": "gpu"})
    decode_split.shared_split([dataset], (0.5, 0.5))
    loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=dataset.collate)
    jpegs = sum(f.endswith(".jpg") for f in dataset.files)
    pixels = sum(len(b.pixels_at) for b in loader) - (len(dataset.files) - jpegs)  # PNGs too
    expected = sum(dataset.on_cpu(i, 0, 0) for i, f in enumerate(dataset.files) if ".jpg" in f)
    assert pixels == expected and 0.25 * jpegs < expected < 0.75 * jpegs, (pixels, expected)


def test_auto_is_a_setting_and_bad_values_are_one_line(tmp_path):
    write_tree(tmp_path / "train")
    cfg = ImageFolderDataConfig(**folder(tmp_path / "train"), cpu_decode_share="auto")
    assert cfg.dataset_kwargs()["cpu_decode_share"] == 0.0  # measured later, before workers
    for bad in ("half", True, -0.1):
        with pytest.raises(ConfigError, match=r"data.cpu_decode_share=.*must be auto or in"):
            ImageFolderDataConfig(**folder(tmp_path / "train"), cpu_decode_share=bad)


def _agree(rank: int, port: int, out: str) -> None:
    with gloo_runtime(rank, port) as rt:
        share = decode_split.agreed((0.1 + 0.2 * rank, 0.9 - 0.2 * rank), rt)
    torch.save(share, f"{out}/share{rank}.pt")


def test_two_ranks_agree_on_the_least_share(tmp_path):
    spawn(_agree, free_port(), str(tmp_path))
    shares = [torch.load(tmp_path / f"share{r}.pt") for r in (0, 1)]
    assert shares == [(0.1, 0.7), (0.1, 0.7)]


def test_the_probe_takes_jpegs_from_the_whole_set(tmp_path):
    """Files are in class order and sizes can go by class: the probe's JPEGs span every class,
    each the GPU path's (JPEG bytes), none a PNG; with crops never twice the image size, none
    is of the DCT-scaled kind."""
    write_tree(tmp_path / "train", per_class=30, sizes=((20, 24),))
    dataset = ImageFolder("train", **{**folder(tmp_path / "train"), "decode": "gpu"})
    found, scaled = decode_split.probe_jpegs(dataset, 6)
    assert scaled == []
    picked = decode_split.spread(found, 6)
    assert len(picked) == 6 and picked == sorted(set(picked))
    assert {dataset.labels[i] for i in picked} == set(range(len(CLASSES)))
    assert all(dataset.files[i].endswith(".jpg") for i in picked)
    assert picked[-1] >= 0.75 * len(dataset)


@pytest.mark.gpu
def test_auto_measures_nvjpeg_on_the_gpu(tmp_path):
    """On a GPU: resolve_auto makes the real decode step (torchvision's nvJPEG and the batched
    crops), measures it beside one core, and gives the data set a share strictly between 0 and
    1, recorded as a GPU run's."""
    pytest.importorskip("torchvision")
    write_tree(tmp_path / "train", per_class=12, sizes=((375, 500), (333, 250)))
    device = torch.device("cuda", torch.cuda.current_device())
    rt = Runtime(0, 0, 1, "nccl", device, has_process_group=False)
    dataset = ImageFolder("train", **{**folder(tmp_path / "train"), "decode": "gpu"})
    decode_split.resolve_auto("auto", 2, [dataset], rt, None)
    state = dataset.checkpoint_state()
    assert state["decode"] == "gpu" and 0 < state["cpu_decode_share"] < 1, state


def test_the_dct_scaled_jpegs_go_to_the_workers_by_their_own_share(tmp_path):
    """Shares (0, 1): every JPEG whose crop box the CPU decodes DCT-scaled (at least twice the
    image size) comes from the workers as decode=cpu's very pixels, every other JPEG as bytes
    for the GPU; with data.reduced_decode off there is no such kind, and all go as bytes."""
    write_tree(tmp_path / "train", per_class=16, sizes=((60, 80), (44, 36), (16, 20), (44, 36)))
    kwargs = {**folder(tmp_path / "train"), "classes": CLASSES}
    cpu = ImageFolder("train", **kwargs)
    gpu = ImageFolder("train", **{**kwargs, "decode": "gpu"})
    plain = ImageFolder("train", **{**kwargs, "decode": "gpu", "reduced_decode": False})
    for dataset in (gpu, plain):
        decode_split.shared_split([dataset], (0.0, 1.0))
    jpegs = [i for i, f in enumerate(gpu.files) if f.endswith(".jpg")]
    seen = {True: 0, False: 0}
    for key in (SampleKey(i, e, 5) for e in range(3) for i in jpegs):
        width, height = Image.open(gpu.files[key.index]).size
        box, _ = gpu.crop(key.index, width, height, key.epoch, key.seed)
        scaled = min(box[2], box[3]) >= 2 * gpu.image_size
        assert gpu.decodes_scaled(box) == scaled and not plain.decodes_scaled(box)
        item = gpu[key]
        seen[scaled] += 1
        if scaled:
            assert item.data is None and torch.equal(item.pixels, cpu[key][0])
        else:
            assert item.data is not None and item.box == box
        assert plain[key].data is not None
    assert seen[True] > 10 and seen[False] > 10, seen
