"""The side-stream prefetcher (mgpu.data.loader.DeviceLoader): the same batches as the plain
DataLoader for nested batch types, across epochs; clean early exits and worker errors; config
checks. GPU tests (skipped without CUDA): contents under slow consumers and slow copies, flat memory
across epochs, and no race under the CUDA sanitizer."""

import dataclasses
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict, namedtuple

import pytest
import torch
from conftest import ROOT
from torch.utils.data import DataLoader, Dataset

from mgpu.config.checks import ConfigError
from mgpu.data.batches import map_tensors, tensors, to_device
from mgpu.data.config import ImageDataConfig, NgramDataConfig
from mgpu.data.loader import build_dataset, build_loader
from mgpu.data.prefetch import DeviceLoader
from mgpu.data.sampler import ShardedSampler, epochs
from mgpu.runtime.dist import Runtime

Pair = namedtuple("Pair", "left right")


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    extra: dict


def make_batch(kind: str, i: int):
    """Batch `i` of a given structure; a pure function of (kind, i)."""
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 255, (4, 3), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (4,), generator=g)
    return {
        "tuple": (x, y),
        "list": [x, y, i],
        "dict": OrderedDict(x=x, y={"y": y, "note": f"batch {i}", "none": None}),
        "namedtuple": Pair(x, [y, 1.5]),
        "dataclass": Sample(x, y, name=f"s{i}"),
        "frozen": (Frozen(x, {"y": y}), "tag"),
    }[kind]


class Batches(Dataset):
    """Whole batches per index (for DataLoader(batch_size=None)); may fail or be slow."""

    def __init__(self, kind: str, n: int = 12, fail_at: int = -1, delay_s: float = 0.0):
        self.kind, self.n, self.fail_at, self.delay_s = kind, n, fail_at, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise ValueError(f"bad sample {i}")
        time.sleep(self.delay_s)
        return make_batch(self.kind, int(i))


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def new_children(before: set) -> set:
    return set(multiprocessing.active_children()) - before


def new_threads(before: set) -> set:
    return set(threading.enumerate()) - before


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Threads (multiprocessing queue feeders) end a moment after their queue is closed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


KINDS = ["tuple", "list", "dict", "namedtuple", "dataclass", "frozen"]


@pytest.mark.parametrize("kind", KINDS)
def test_map_tensors_keeps_every_structure_and_leaf(kind):
    batch = make_batch(kind, 3)
    moved = to_device(batch, torch.device("cpu"))
    assert_same(moved, batch)
    cloned = map_tensors(batch, torch.clone)
    assert_same(cloned, batch)
    assert not {id(t) for t in tensors(cloned)} & {id(t) for t in tensors(batch)}
    assert len(list(tensors(batch))) >= 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("copy_thread", [False, True])
def test_prefetched_batches_equal_the_dataloaders(kind, copy_thread):
    loader = DataLoader(Batches(kind), batch_size=None, num_workers=2)
    with DeviceLoader(loader, "cpu", depth=3, copy_thread=copy_thread) as dev:
        assert len(dev) == len(loader) == 12
        got = list(dev)
    expected = list(loader)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)


class Recorded(torch.utils.data.Sampler):
    def __init__(self, n: int, fetched: list):
        self.n, self.fetched = n, fetched

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            self.fetched.append(i)
            yield i


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_the_cuda_inline_path_keeps_order_and_every_batch(depth):
    """The inline queue logic, driven on CPU (no streams there; the same code path)."""
    loader = DataLoader(Batches("dict", n=7), batch_size=None, num_workers=0)
    dev = DeviceLoader(loader, "cpu", depth=depth)
    got = list(dev._inline_epoch())
    for a, b in zip(got, list(loader), strict=True):
        assert_same(a, b)
    fetched = []
    counted = DataLoader(Batches("dict", n=7), batch_size=None, sampler=Recorded(7, fetched))
    head = DeviceLoader(counted, "cpu", depth=depth)._inline_epoch()
    assert_same(next(head), make_batch("dict", 0))
    assert len(fetched) == min(7, depth + 1)  # the batch handed over, and `depth` in flight
    head.close()  # an early exit runs the epoch's cleanup


@pytest.mark.parametrize("copy_thread", [False, True])
def test_epochs_with_set_epoch_reshuffle_like_the_dataloader(copy_thread):
    data = torch.arange(40).float()
    sampler = ShardedSampler(40, 0, 1, shuffle=True, seed=3, even=True)
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=2, persistent_workers=True)
    with DeviceLoader(loader, "cpu", copy_thread=copy_thread) as dev:
        orders = []
        for epoch in range(3):
            dev.set_epoch(epoch)
            got = torch.cat(list(dev))
            sampler.set_epoch(epoch)
            assert torch.equal(got, torch.cat(list(loader)))
            orders.append(got.tolist())
        assert orders[0] != orders[1] != orders[2]
        assert all(sorted(o) == data.tolist() for o in orders)
        forever = epochs(dev)
        flat = [next(forever) for _ in range(len(dev) * 2)]
        assert sampler.epoch == 1 and torch.cat(flat).tolist() == orders[0] + orders[1]
        forever.close()


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("copy_thread", [False, True])
def test_breaking_out_early_leaves_no_threads_or_workers(persistent, copy_thread):
    threads, children = set(threading.enumerate()), set(multiprocessing.active_children())
    loader = DataLoader(
        Batches("tuple", n=40), batch_size=None, num_workers=2, persistent_workers=persistent
    )
    dev = DeviceLoader(loader, "cpu", copy_thread=copy_thread)
    for i, _ in enumerate(dev):
        if i == 2:
            copying = {t.name for t in new_threads(threads)}
            assert ("mgpu-copy" in copying) == copy_thread, copying
            break
    if not persistent:  # the epoch's iterator was its workers' only owner: they stop with it
        assert wait_until(lambda: not new_children(children))
    first = next(iter(dev))  # a new epoch starts from the top
    assert torch.equal(first[0], make_batch("tuple", 0)[0])
    dev.close()
    assert wait_until(lambda: not new_children(children))
    assert wait_until(lambda: not new_threads(threads)), new_threads(threads)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("copy_thread", [False, True])
def test_a_worker_error_surfaces_with_its_message_and_traceback(workers, copy_thread):
    threads, children = set(threading.enumerate()), set(multiprocessing.active_children())
    loader = DataLoader(Batches("tuple", fail_at=5), batch_size=None, num_workers=workers)
    dev = DeviceLoader(loader, "cpu", copy_thread=copy_thread)
    seen = 0
    with pytest.raises(ValueError, match="bad sample 5") as err:
        for _ in dev:
            seen += 1
    assert seen == 5
    if workers:
        assert "Original Traceback" in str(err.value) and "__getitem__" in str(err.value)
    del err
    dev.close()
    assert wait_until(lambda: not new_children(children))
    assert wait_until(lambda: not new_threads(threads)), new_threads(threads)


LEFT_RUNNING = """
import torch
from torch.utils.data import DataLoader
from mgpu.data.loader import DeviceLoader

data = [(torch.ones(2), torch.zeros(2))] * 50
running = []
for copy_thread in (False, True):
    loader = DataLoader(data, batch_size=None, num_workers=2, persistent_workers=True)
    dev = DeviceLoader(loader, "cpu", depth=2, copy_thread=copy_thread)
    epoch = iter(dev)
    next(epoch)
    running.append((dev, epoch))  # mid-epoch at exit: workers up, a copy thread waiting
print("EXITING")
"""


def test_nothing_hangs_at_exit_with_an_epoch_left_running():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # A hang at exit never ends: the subprocess timeout catches it, whatever the machine's load.
    proc = subprocess.run(
        [sys.executable, "-c", LEFT_RUNNING], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "EXITING" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("copy_thread", [False, True])
def test_data_wait_counts_the_time_spent_blocked_on_batches(copy_thread):
    loader = DataLoader(Batches("tuple", n=4, delay_s=0.02), batch_size=None, num_workers=0)
    with DeviceLoader(loader, "cpu", copy_thread=copy_thread) as dev:
        assert dev.wait.take().total_ms() == 0
        batches = list(dev)
        assert len(batches) == 4
        waited = dev.wait.take().total_ms()
    assert 60 <= waited < 2000, waited  # 4 batches of 20 ms each, all waited for


def test_device_transform_auto_applies_the_datasets_and_none_leaves_inputs():
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), False)
    kw = dict(num_samples=8, eval_samples=4, image_size=8, batch_size=4, num_workers=0)
    auto_set = ImageDataConfig(**kw)
    dataset = build_dataset(auto_set, "train")
    x, y = next(iter(build_loader(auto_set, dataset, rt, seed=0, train=True)))
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    raw_set = ImageDataConfig(**kw, device_transform="none")
    raw, _ = next(iter(build_loader(raw_set, dataset, rt, seed=0, train=True)))
    assert raw.dtype == torch.uint8
    torch.testing.assert_close(x, dataset.device_transform(raw))


def test_inputs_leave_in_the_memory_format_asked_for():
    images = [(torch.rand(2, 3, 4, 4), torch.arange(2)) for _ in range(3)]
    loader = DataLoader(images, batch_size=None)
    dev = DeviceLoader(loader, "cpu", transform=torch.neg, memory_format=torch.channels_last)
    for (x, y), (ref_x, ref_y) in zip(dev, images, strict=True):
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(x, -ref_x) and torch.equal(y, ref_y)


def test_a_transform_needs_an_inputs_targets_batch():
    # a config error: at the first batch, every rank stops in one line (mgpu.train.feed)
    loader = DataLoader(Batches("dict", n=2), batch_size=None)
    with pytest.raises(ConfigError, match="data.device_transform=none"):
        next(iter(DeviceLoader(loader, "cpu", transform=torch.neg)))


@pytest.mark.parametrize(
    "key, value",
    [
        ("prefetch_depth", 0),
        ("prefetch_factor", 0),
        ("num_workers", -1),
        ("device_transform", "gpu"),
        ("batch_size", 0),
    ],
)
def test_bad_loader_settings_name_the_key_and_value(key, value):
    with pytest.raises(ConfigError, match=f"data.{key}={value!r}") as err:
        NgramDataConfig(**{key: value})
    assert "must be" in str(err.value)


def test_bad_loader_settings_fail_at_composition():
    from test_config import compose_config

    from mgpu.run.config import to_config

    with pytest.raises(ConfigError, match="data.device_transform='sometimes'"):
        to_config(compose_config("data.device_transform=sometimes"))
    with pytest.raises(ConfigError, match="data.prefetch_depth=0"):
        to_config(compose_config("data.prefetch_depth=0"))
    assert to_config(compose_config("data.prefetch_depth=4")).data.prefetch_depth == 4


def test_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="depth=0"):
        DeviceLoader(DataLoader(list(range(4))), "cpu", depth=0)


# ---- GPU (skipped without CUDA) ----


class RandomShapes(Dataset):
    """Batch i: uint8 inputs of a random shape and nested targets, fixed by i."""

    def __len__(self) -> int:
        return 300

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + int(i))
        n, c, w = (int(v) for v in torch.randint(1, 48, (3,), generator=g))
        x = torch.randint(0, 256, (n, c, w), generator=g, dtype=torch.uint8)
        y = torch.randint(0, 1000, (n,), generator=g)
        return x, {"y": y, "pair": Pair(y * 2, "tag"), "i": int(i)}


def slow_float(x: torch.Tensor) -> torch.Tensor:
    """A device transform that keeps the side stream busy a random while first."""
    torch.cuda._sleep(int(torch.randint(0, 200_000, ())))
    return x.float() * 2


@pytest.mark.gpu
@pytest.mark.parametrize("copy_thread", [False, True])
@pytest.mark.parametrize("consumer", ["default", "own_stream"])
def test_gpu_batches_match_under_slow_consumers_and_slow_copies(copy_thread, consumer):
    dataset = RandomShapes()
    loader = DataLoader(dataset, batch_size=None, num_workers=2, pin_memory=True)
    dev = DeviceLoader(loader, "cuda", depth=3, transform=slow_float, copy_thread=copy_thread)
    stream = torch.cuda.Stream() if consumer == "own_stream" else torch.cuda.current_stream()
    copies = []
    with torch.cuda.stream(stream), dev:
        for x, rest in dev:
            # The consumer lags by a random while, then reads and writes the batch: reading too
            # early (no wait for the copy) or after reuse (no record_stream) shows as a mismatch.
            torch.cuda._sleep(int(torch.randint(0, 200_000, ())))
            x.add_(1)
            copies.append((x.clone(), rest["y"].clone(), rest["pair"].left.clone(), rest["i"]))
    torch.cuda.synchronize()
    assert [c[3] for c in copies] == list(range(len(dataset)))
    for x, y, left, i in copies:
        ref_x, ref_rest = dataset[i]
        assert torch.equal(x.cpu(), ref_x.float() * 2 + 1), i
        assert torch.equal(y.cpu(), ref_rest["y"]) and torch.equal(left.cpu(), ref_rest["y"] * 2)


class FixedShapes(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(int(i))
        return torch.randint(0, 256, (32, 3, 64, 64), generator=g, dtype=torch.uint8), i


@pytest.mark.gpu
@pytest.mark.parametrize("copy_thread", [False, True])
def test_gpu_memory_is_flat_across_epochs_on_one_stream(copy_thread):
    sampler = ShardedSampler(64, 0, 1, shuffle=True, seed=0, even=True)
    loader = DataLoader(
        FixedShapes(),
        batch_size=None,
        sampler=sampler,
        num_workers=2,
        pin_memory=True,
        persistent_workers=True,
    )
    dev = DeviceLoader(loader, "cuda", transform=lambda x: x.float() / 255, copy_thread=copy_thread)
    reserved, allocated, streams = [], [], set()
    with dev:
        for epoch in range(5):
            dev.set_epoch(epoch)
            total = torch.zeros((), device="cuda")
            for x, _ in dev:
                total += x.square().mean()
            del x
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
            allocated.append(torch.cuda.memory_allocated())
            streams.add(dev.stream.cuda_stream)
    assert len(streams) == 1  # one side stream for the loader's life
    assert len(set(allocated)) == 1, allocated  # nothing held over from any epoch
    assert len(set(reserved[1:])) == 1, reserved  # no growth once the cache is warm


SANITIZED = """
import sys
import torch
from torch.utils.data import DataLoader
from mgpu.data.loader import DeviceLoader

if sys.argv[1] == "no_wait":  # the control: a consumer that never waits for the copies
    torch.cuda.Stream.wait_event = lambda self, event: None

data = [(torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8), torch.arange(16))] * 40
loader = DataLoader(data, batch_size=None, num_workers=2, pin_memory=True)
with DeviceLoader(loader, "cuda", transform=lambda x: x.float() / 255) as dev:
    for epoch in range(2):
        for step, (x, y) in enumerate(dev):
            x.mul_(2)  # the consumer writes what the side stream wrote
            total = x.sum() + y.sum()  # no host sync: it would order the streams for CSAN
            if epoch == 0 and step == 10:
                break  # an early exit, then a full epoch
print("SANITIZED_OK")
"""


@pytest.mark.gpu
def test_gpu_prefetch_has_no_race_under_the_cuda_sanitizer():
    """Inline copies only: the sanitizer's dispatch mode is per thread, so it would not see a
    copy thread's kernels (the slow-consumer test above covers that variant)."""
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    runs = {
        mode: subprocess.run(
            [sys.executable, "-c", SANITIZED, mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        for mode in ("prefetch", "no_wait")
    }
    ok = runs["prefetch"]
    assert ok.returncode == 0 and "SANITIZED_OK" in ok.stdout, ok.stderr[-4000:]
    assert "CSAN" not in ok.stderr and "data race" not in ok.stderr, ok.stderr[-4000:]
    # The control shows the sanitizer was on and sees this kind of race.
    broken = runs["no_wait"]
    assert broken.returncode != 0 and "data race" in broken.stderr, broken.stderr[-4000:]
