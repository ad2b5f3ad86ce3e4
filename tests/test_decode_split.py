"""data.cpu_decode_share=auto (mgpu.data.decode_split): the rule (both sides run out of rate
together), the measurement on the run's own JPEGs with decode=gpu's step on the CPU (Pillow
standing in for nvJPEG), a slower decode step giving the workers more, two gloo ranks agreeing
on one share, and a resumed run taking its checkpoint's share instead of measuring."""

import logging
import time

import pytest
import torch
from conftest import free_port, gloo_runtime, spawn
from test_image_folder import CLASSES, folder, pillow_jpegs, write_tree

from mgpu.config.checks import ConfigError
from mgpu.data import decode_split
from mgpu.data.config import ImageFolderDataConfig
from mgpu.data.gpu_decode import BatchDecoder, resize_each
from mgpu.data.image_folder import ImageFolder
from mgpu.data.sampler import SampleKey
from mgpu.runtime.dist import Runtime

ONE = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)


@pytest.mark.parametrize("workers,core,gpu", [(14, 311, 15036), (6, 107, 6839), (1, 50, 20000)])
def test_each_side_runs_out_of_rate_at_the_same_consumption(workers, core, gpu):
    """At any rate R the step consumes, the share s loads the workers' counted rate and the
    GPU's to the same fraction: s*R / (workers*core*efficiency) == (1-s)*R / gpu."""
    s = decode_split.split_share(workers, core, gpu)
    assert 0 < s < 1
    cpu_rate = workers * core * decode_split.WORKER_EFFICIENCY
    for consumed in (1000.0, 5300.0):
        assert s * consumed / cpu_rate == pytest.approx((1 - s) * consumed / gpu)
    assert decode_split.split_share(0, core, gpu) == 0.0


def gpu_mode_set(root, size=12):
    write_tree(root, per_class=12, sizes=((60, 80), (44, 36)))
    kwargs = {**folder(root, eval_samples=2), "image_size": size, "classes": CLASSES}
    return ImageFolder("train", **{**kwargs, "decode": "gpu"})


def test_the_measured_share_grows_when_the_gpu_decodes_slower(tmp_path, caplog):
    """The share is measured, not assumed: the same images, a decode step made slower by a
    pause a call, give the workers a larger share; the log names the rates and the share, and
    the data set then decodes about that share of its JPEGs in the workers."""
    dataset = gpu_mode_set(tmp_path / "train")
    fast = BatchDecoder(dataset, torch.device("cpu"), pillow_jpegs, resize_each)

    def paused(data):
        time.sleep(0.05)
        return pillow_jpegs(data)

    slow = BatchDecoder(dataset, torch.device("cpu"), paused, resize_each)
    rates = decode_split.measure(dataset, fast, torch.device("cpu"))
    jpegs = sum(f.endswith(".jpg") for f in dataset.files)
    assert rates is not None and rates.core > 0 and rates.gpu > 0
    assert rates.images == min(jpegs, decode_split.PROBE_IMAGES)
    with caplog.at_level(logging.INFO, logger="mgpu.data.decode_split"):
        share_fast = decode_split.resolve_share(dataset, fast, 2, ONE)
        share_slow = decode_split.resolve_share(dataset, slow, 2, ONE)
    assert 0 < share_fast < share_slow < 1, (share_fast, share_slow)
    said = [r.getMessage() for r in caplog.records]
    assert any(f"auto: {share_slow:.3f} of the JPEGs decoded by the 2 workers" in m for m in said)
    decode_split.shared_split([dataset], share_slow)
    assert dataset.checkpoint_state()["cpu_decode_share"] == pytest.approx(share_slow, abs=1e-9)
    jpegs = [i for i, f in enumerate(dataset.files) if f.endswith(".jpg")]
    keys = [SampleKey(i, e, 3) for e in range(8) for i in jpegs]
    on_cpu = sum(dataset[k].data is None for k in keys) / len(keys)
    assert abs(on_cpu - share_slow) < 0.12, (on_cpu, share_slow)


def test_no_workers_or_no_gpu_decode_means_no_share(tmp_path):
    dataset = gpu_mode_set(tmp_path / "train")
    step = BatchDecoder(dataset, torch.device("cpu"), pillow_jpegs, resize_each)
    assert decode_split.resolve_share(dataset, step, 0, ONE) == 0.0
    assert decode_split.resolve_share(dataset, None, 4, ONE) == 0.0


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
    saved = {"cpu_decode_share": 0.37, "decode": "gpu"}
    with caplog.at_level(logging.INFO, logger="mgpu.data.decode_split"):
        decode_split.resolve_auto("auto", 3, [train, evaluation], ONE, saved)
    for dataset in (train, evaluation):
        assert dataset.checkpoint_state() == saved
    assert "0.370, the share the checkpoint's run decoded with" in caplog.text
    # anything but auto leaves the configured number alone
    decode_split.resolve_auto(0.0, 3, [train], ONE, {"cpu_decode_share": 0.5, "decode": "gpu"})
    assert train.checkpoint_state()["cpu_decode_share"] == 0.37
    # the round trip: what a measured run saves is what its resumed run takes
    measured = CpuDecoded("train", **kwargs)
    decode_split.resolve_auto(
        "auto", 3, [measured], ONE, {"cpu_decode_share": 0.0, "decode": "cpu"}
    )
    share = measured.checkpoint_state()["cpu_decode_share"]
    assert 0 < share < 1  # measured, not the CPU run's 0
    resumed = NoDecoder("train", **kwargs)
    decode_split.resolve_auto("auto", 3, [resumed], ONE, measured.checkpoint_state())
    assert resumed.checkpoint_state() == measured.checkpoint_state()


def test_a_bad_jpeg_is_left_out_of_the_measurement(tmp_path):
    """A JPEG whose header reads but whose data is cut short: the probe leaves it out (no
    error, nothing counted as replaced), and the measurement stands on the others."""
    write_tree(tmp_path / "train", per_class=12, sizes=((60, 80), (44, 36)))
    dataset = CpuDecoded("train", **{**folder(tmp_path / "train"), "decode": "gpu"})
    jpegs = [f for f in dataset.files if f.endswith(".jpg")]
    data = open(jpegs[3], "rb").read()
    with open(jpegs[3], "wb") as f:
        f.write(data[: len(data) // 3])
    dataset.bad_files = "skip"
    rates = decode_split.measure(dataset, dataset.device_decoder("cpu"), torch.device("cpu"))
    assert rates is not None and rates.images == len(jpegs) - 1
    assert dataset.replaced() == 0


def test_the_share_reaches_the_dataloader_workers(tmp_path):
    """Set before the workers start, the share is what they decode by: about that share of the
    JPEGs comes back as the workers' pixels."""
    from torch.utils.data import DataLoader

    write_tree(tmp_path / "train", per_class=24, sizes=((40, 30),))
    dataset = ImageFolder("train", **{**folder(tmp_path / "train"), "decode": "gpu"})
    decode_split.shared_split([dataset], 0.5)
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
        share = decode_split.agreed(0.1 + 0.2 * rank, rt)
    torch.save(share, f"{out}/share{rank}.pt")


def test_two_ranks_agree_on_the_least_share(tmp_path):
    spawn(_agree, free_port(), str(tmp_path))
    shares = [torch.load(tmp_path / f"share{r}.pt") for r in (0, 1)]
    assert shares == [0.1, 0.1]


def test_the_probe_takes_jpegs_from_the_whole_set(tmp_path):
    """Files are in class order and sizes can go by class: the probe's JPEGs span every class,
    each the GPU path's (JPEG bytes), none a PNG."""
    write_tree(tmp_path / "train", per_class=30, sizes=((20, 24),))
    dataset = ImageFolder("train", **{**folder(tmp_path / "train"), "decode": "gpu"})
    picked = decode_split.probe_jpegs(dataset, 6)
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
