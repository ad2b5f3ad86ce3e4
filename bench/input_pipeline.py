"""What feeding a model from DataLoader workers costs, side by side in one run, on one GPU.

Each variant trains the same model from the same data; throughput is printed with its ratio to
(a), the batch already on the GPU:
  (a) resident    the batch on the GPU, ready for the model, reused every step (upper bound)
  (b) pageable    DataLoader without pinning; .cuda() on the default stream
  (c) pinned      pinned DataLoader; .cuda(non_blocking=True) on the default stream
  (d) mgpu        mgpu.data.loader.DeviceLoader: copies issued inline on its side stream
  (e) mgpu-thread DeviceLoader(copy_thread=True): copies issued from a background thread
Images cross PCIe as uint8 and are normalised (and made channels_last) on the GPU: on the
compute stream in (b) and (c), on the loader's side stream in (d) and (e); (a) skips it.

The resnet50_folder workload feeds ResNet-50 from a folder of JPEGs (data=image_folder: random-
resized crops with flips, as training does), written by bench/make_image_folder.py (or given
with --folder), read from the page cache:
  (a) resident    the first batch, on the GPU, reused every step
  (f) folder-cpu  decode=cpu: Pillow decodes and crops in the DataLoader workers
  (g) folder-gpu  decode=gpu: the workers read the bytes, nvJPEG decodes on the copy thread
  (h) folder-gpu-inline  the same, decoded from the training loop's thread (what (g) avoids)
(g) and (h) need CUDA and torchvision; on CPU they are left out.

    python bench/input_pipeline.py                  # ResNet-50 and GPT-2-small, ~3 minutes
    python bench/input_pipeline.py --workers 12 --steps 40 --repeats 3 --models resnet50
    python bench/input_pipeline.py --quick          # tiny shapes; runs on CPU (a smoke test)
    python bench/input_pipeline.py --models resnet50_folder --folder-images 5000   # ~2 minutes
    torchrun --nproc_per_node=8 bench/input_pipeline.py --variants ad   # every GPU at once

Under torchrun every process feeds its own GPU (LOCAL_RANK) from its own DataLoader workers, all
at the same time, so workers of all GPUs compete for the host's cores, memory bandwidth and PCIe;
the processes meet at a barrier before every measurement so they measure the same variant
together. The default worker count is then the host's cores shared out per process. Rank 0
writes one file with every GPU's rows and the worst GPU per variant.

Writes bench/results/input_pipeline-<device>-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.make_image_folder import write_folder  # noqa: E402
from mgpu.data import ImageFolder, SyntheticImages, TokenFile  # noqa: E402
from mgpu.data.batches import to_device  # noqa: E402
from mgpu.data.config import ImageFolderDataConfig  # noqa: E402
from mgpu.data.gpu_decode import gpu_decode_unavailable  # noqa: E402
from mgpu.data.images import normalize_uint8  # noqa: E402
from mgpu.data.loader import worker_count  # noqa: E402
from mgpu.data.prefetch import DeviceLoader  # noqa: E402
from mgpu.data.sampler import SampleKey  # noqa: E402
from mgpu.models import GPT, ResNet  # noqa: E402
from mgpu.runtime.launch import default_cuda_connections  # noqa: E402

VARIANTS = {
    "a": "resident",
    "b": "pageable .cuda()",
    "c": "pinned non_blocking",
    "d": "mgpu prefetch (inline)",
    "e": "mgpu prefetch (thread)",
    "f": "folder decode=cpu",
    "g": "folder decode=gpu",
    "h": "folder decode=gpu inline",
}
POOL_VARIANTS, FOLDER_VARIANTS = "abcde", "afgh"
ENDLESS = 10**9  # a dataset length no run reaches: no epoch boundaries inside a measurement


class Pool(Dataset):
    """Samples from a fixed in-memory pool, index modulo its size: what workers deliver then
    costs only collation and transport, so the copy path is measured, not image generation."""

    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]):
        self.inputs = torch.stack([x for x, _ in samples])
        self.targets = torch.stack([y for _, y in samples])

    def __len__(self) -> int:
        return ENDLESS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i) % len(self.inputs)
        return self.inputs[i], self.targets[i]


class EndlessKeys(Sampler):
    """The folder's samples in order, over and over, each pass a new epoch's crops: no epoch
    boundary (and its restart of the workers' pipeline) inside a measurement."""

    def __init__(self, num_samples: int):
        self.num_samples = num_samples

    def __len__(self) -> int:
        return ENDLESS

    def __iter__(self) -> Iterator[SampleKey]:
        n = self.num_samples
        return (SampleKey(i % n, i // n, 0) for i in range(ENDLESS))


@dataclass
class Workload:
    name: str
    unit: str  # what throughput counts
    per_sample: int  # units per sample (1 image, T tokens)
    batch_size: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    dataset: Dataset
    transform: Callable[[torch.Tensor], torch.Tensor] | None
    memory_format: torch.memory_format | None
    note: str
    folder: Path | None = None  # resnet50_folder: the JPEG tree
    image_size: int = 224


def resnet50(args, device: torch.device) -> Workload:
    size, batch, classes = (32, 8, 10) if args.quick else (224, 256, 1000)
    if args.quick:
        model = ResNet(num_classes=classes, block="basic", layers=[1, 1, 1, 1], width=8)
    else:
        model = ResNet(num_classes=classes)
    model = model.to(device, memory_format=torch.channels_last)
    source = SyntheticImages("train", num_classes=classes, image_size=size, num_samples=ENDLESS)
    pool = Pool([source[i] for i in range(args.pool)])
    return Workload(
        "resnet50" if not args.quick else "resnet-tiny",
        "images/s",
        1,
        batch,
        model,
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        pool,
        normalize_uint8,
        torch.channels_last,
        f"uint8 {size}x{size} images from a pool of {args.pool} SyntheticImages samples",
    )


def resnet50_folder(args, device: torch.device, tmp: Path) -> Workload:
    work = resnet50(args, device)
    work.name = "resnet50-folder" if not args.quick else "resnet-tiny-folder"
    work.image_size = 32 if args.quick else 224
    work.folder = args.folder
    if work.folder is None and dist.is_initialized():
        raise SystemExit(
            "--models resnet50_folder under torchrun needs --folder DIR, one folder for every "
            "process (python bench/make_image_folder.py DIR writes one)"
        )
    if work.folder is None:
        work.folder = tmp / "folder"
        size = (80, 60) if args.quick else (500, 375)
        made = write_folder(
            work.folder, args.folder_images, 100 if not args.quick else 4, size=size
        )
        what = f"{made['images']} JPEGs of {size[0]}x{size[1]} (1 in 4 portrait), quality 90, "
        what += f"{made['mean_kb']:.0f} KB on average, written to {work.folder}"
    else:
        what = f"the JPEGs of {work.folder}"
    work.note = (
        f"{what}; random-resized {work.image_size}x{work.image_size} crops, from the page cache"
    )
    return work


def gpt2(args, device: torch.device, tmp: Path) -> Workload:
    vocab, seq, batch = (256, 64, 4) if args.quick else (50304, 1024, 16)
    layers, heads, width = (1, 2, 32) if args.quick else (12, 12, 768)  # GPT-2-small: 124M
    model = GPT(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width)
    model = model.to(device)
    path = tmp / "tokens.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, size=(seq + 1) * 4096, dtype=np.uint16).tofile(path)
    tokens = TokenFile("train", str(path), seq_len=seq, eval_samples=1, vocab_size=vocab)
    fused = device.type == "cuda"
    return Workload(
        "gpt2-small" if not args.quick else "gpt-tiny",
        "tokens/s",
        seq,
        batch,
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused),
        Cycle(tokens),
        None,
        None,
        f"random uint16 tokens < {vocab}, memory-mapped TokenFile (B={batch}, T={seq})",
    )


class Cycle(Dataset):
    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return ENDLESS

    def __getitem__(self, i: int):
        return self.base[int(i) % len(self.base)]


def workers_for(work: Workload, args) -> int:
    """--workers, or by default min(12, cores - 4) for a pool and mgpu's data.num_workers=auto
    (the cores less 2) for a folder."""
    if args.workers is not None:
        return args.workers
    if work.folder is not None:
        return worker_count("auto", args.cpus)
    return max(1, min(12, args.cpus - 4))


def folder_feeds(
    work: Workload, args, device: torch.device
) -> tuple[dict[str, Callable[[], Iterator]], dict[str, DeviceLoader]]:
    """(a) and (f)-(h): mgpu's image_folder dataset, DataLoader and prefetcher, as a run builds
    them (mgpu.data.loader.build_loader), over an endless sampler."""
    cuda = device.type == "cuda"
    workers = workers_for(work, args)

    def prefetcher(decode: str, copy_thread: bool) -> DeviceLoader:
        cfg = ImageFolderDataConfig(
            path=str(work.folder), image_size=work.image_size, decode=decode, eval_samples=1
        )
        dataset = ImageFolder("train", **cfg.dataset_kwargs())
        loader = DataLoader(
            dataset,
            batch_size=work.batch_size,
            sampler=EndlessKeys(len(dataset)),
            num_workers=workers,
            pin_memory=cuda,
            prefetch_factor=args.prefetch_factor if workers else None,
            persistent_workers=workers > 0,
            collate_fn=dataset.collate,
        )
        return DeviceLoader(
            loader,
            device,
            transform=work.transform,
            memory_format=work.memory_format,
            decode=dataset.device_decoder(device),
            copy_thread=copy_thread,
        )

    made = {"f": prefetcher("cpu", False)}
    if gpu_decode_unavailable() is None:
        made["g"], made["h"] = prefetcher("gpu", True), prefetcher("gpu", False)
    resident = next(iter(made["f"]))
    sources = {"a": lambda: itertools.repeat(resident)}
    sources.update({v: (lambda p=p: iter(p)) for v, p in made.items()})
    return sources, made


def train_step(
    work: Workload, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    amp = device.type == "cuda"

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = work.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
        loss.backward()
        work.optimizer.step()
        work.optimizer.zero_grad(set_to_none=True)

    return step


def on_compute_stream(work: Workload, batch, device: torch.device, non_blocking: bool):
    """(b), (c): the copy, transform and layout change all on the current (compute) stream."""
    inputs, targets = (t.to(device, non_blocking=non_blocking) for t in batch)
    if work.transform is not None:
        inputs = work.transform(inputs)
    if work.memory_format is not None:
        inputs = inputs.contiguous(memory_format=work.memory_format)
    return inputs, targets


def feeds(
    work: Workload, args, device: torch.device
) -> tuple[dict[str, Callable[[], Iterator]], dict[str, DeviceLoader]]:
    """Each variant's source of ready batches (every call starts a fresh iteration), and the
    variants' prefetchers."""
    cuda = device.type == "cuda"
    workers = workers_for(work, args)

    def loader(pinned: bool) -> DataLoader:
        return DataLoader(
            work.dataset,
            batch_size=work.batch_size,
            num_workers=workers,
            pin_memory=pinned and cuda,
            prefetch_factor=args.prefetch_factor if workers else None,
            persistent_workers=workers > 0,
            drop_last=True,
        )

    pageable, pinned = loader(False), loader(True)
    first = next(iter(pinned))
    resident = on_compute_stream(work, to_device(first, device), device, True)
    inline = DeviceLoader(
        pinned, device, transform=work.transform, memory_format=work.memory_format
    )
    thread = DeviceLoader(
        pinned,
        device,
        transform=work.transform,
        memory_format=work.memory_format,
        copy_thread=True,
    )
    return {
        "a": lambda: itertools.repeat(resident),
        "b": lambda: (on_compute_stream(work, b, device, False) for b in pageable),
        "c": lambda: (on_compute_stream(work, b, device, True) for b in pinned),
        "d": lambda: iter(inline),
        "e": lambda: iter(thread),
    }, {"d": inline, "e": thread}


def together() -> None:
    """Under torchrun: wait until every process is here, so all GPUs measure at once."""
    if dist.is_initialized():
        dist.barrier()


def measure(
    step, batches: Iterator, args, device: torch.device, prefetcher: DeviceLoader | None
) -> tuple[float, float | None]:
    """Seconds for args.steps steps after args.warmup, timed on the device's own timeline, and
    the data wait per step that the prefetcher's own meter saw over them."""
    for _ in range(args.warmup):
        step(*next(batches))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()  # benchmark only: start from an idle GPU
    together()
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    if prefetcher is not None:
        prefetcher.wait.take()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(*next(batches))
    if cuda:
        end.record()
        end.synchronize()
        seconds = begin.elapsed_time(end) / 1e3
    else:
        seconds = time.perf_counter() - start
    wait = prefetcher.wait.take().total_ms() / args.steps if prefetcher is not None else None
    return seconds, wait


def run_workload(work: Workload, args, device: torch.device) -> list[dict]:
    step = train_step(work, device)
    if work.folder is not None:
        sources, prefetchers = folder_feeds(work, args, device)
        variants = [v for v in args.variants or FOLDER_VARIANTS if v in sources]
    else:
        sources, prefetchers = feeds(work, args, device)
        variants = [v for v in args.variants or POOL_VARIANTS if v in POOL_VARIANTS]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    waits: dict[str, list[float]] = {v: [] for v in prefetchers}
    for _ in range(args.repeats):
        for v in variants:  # interleaved, so every variant sees the same machine state
            batches = sources[v]()
            took, wait = measure(step, batches, args, device, prefetchers.get(v))
            seconds[v].append(took)
            if wait is not None:
                waits[v].append(wait)
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # ends the epoch before another variant restarts the shared loader
    for p in prefetchers.values():
        p.close()
    units = work.batch_size * work.per_sample * args.steps
    base = units / statistics.median(seconds["a"]) if "a" in seconds else None
    rows = []
    for v in variants:
        rates = [units / s for s in seconds[v]]
        rate = statistics.median(rates)
        wait = statistics.median(waits[v]) if v in waits else None
        step_ms = statistics.median(seconds[v]) / args.steps * 1e3
        rows.append(
            {
                "workload": work.name,
                "variant": f"({v}) {VARIANTS[v]}",
                "rank": rank(),
                "throughput": rate,
                "unit": work.unit,
                "ratio_to_a": rate / base if base else None,
                "spread": [min(rates), max(rates)],
                "step_ms": step_ms,
                "data_wait_ms_per_step": wait,
                "data_wait_pct": 100 * wait / step_ms if wait is not None else None,
            }
        )
    return rows


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def worst_per_variant(rows: list[dict]) -> list[dict]:
    """Across GPUs: each variant's slowest GPU and its largest data wait."""
    out = []
    for key in dict.fromkeys((r["workload"], r["variant"]) for r in rows):
        mine = [r for r in rows if (r["workload"], r["variant"]) == key]
        slowest = min(mine, key=lambda r: r["throughput"])
        waited = [r for r in mine if r["data_wait_pct"] is not None]
        longest = max(waited, key=lambda r: r["data_wait_pct"]) if waited else slowest
        out.append(
            {
                **slowest,
                "rank": f"worst of {len(mine)}",
                "data_wait_ms_per_step": longest["data_wait_ms_per_step"],
                "data_wait_pct": longest["data_wait_pct"],
                "ratio_to_a": min(
                    (r["ratio_to_a"] for r in mine if r["ratio_to_a"] is not None), default=None
                ),
            }
        )
    return out


def print_table(rows: list[dict]) -> None:
    head = f"{'workload':<18} {'variant':<26} {'rank':>10} {'throughput':>21} {'vs (a)':>7}"
    print(head + f" {'spread':>23}  data wait/step (mgpu meter)")
    for r in rows:
        lo, hi = r["spread"]
        ratio = f"{r['ratio_to_a']:.3f}" if r["ratio_to_a"] is not None else "-"
        wait = r["data_wait_ms_per_step"]
        print(
            f"{r['workload']:<18} {r['variant']:<26} {r['rank']!s:>10} "
            f"{r['throughput']:>12,.0f} {r['unit']:<8} {ratio:>7} {lo:>11,.0f}-{hi:<11,.0f}  "
            + (f"{wait:.3f} ms ({r['data_wait_pct']:.2f}%)" if wait is not None else "")
        )


def environment(device: torch.device) -> dict:
    def git(*cmd: str) -> str:
        try:
            out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)
            return out.stdout.strip() if out.returncode == 0 else "unknown"
        except OSError:
            return "unknown"

    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version() if cuda else None,
        # Where the tree was copied without .git (a lent GPU machine), the caller passes it.
        "commit": os.environ.get("MGPU_COMMIT") or git("rev-parse", "HEAD"),
        "tree_dirty": git("status", "--porcelain") not in ("", "unknown"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "cpu_count": os.cpu_count(),
    }


def nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # Under torchrun the host's cores are shared out among the processes on it.
    per_process = (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers: default min(12, cores - 4) from a pool, mgpu's auto from a "
        "folder (the cores less 2)",
    )
    p.add_argument("--prefetch-factor", type=int, default=2, help="DataLoader prefetch_factor")
    p.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps before each")
    p.add_argument("--repeats", type=int, default=3, help="measurements per variant (median)")
    p.add_argument("--pool", type=int, default=256, help="distinct images in the pool")
    p.add_argument(
        "--models",
        nargs="+",
        default=["resnet50", "gpt2"],
        choices=["resnet50", "gpt2", "resnet50_folder"],
    )
    p.add_argument("--variants", default=None, help="which of (a)-(h), e.g. ade (default: all)")
    p.add_argument("--folder", type=Path, default=None, help="resnet50_folder: a JPEG tree")
    p.add_argument(
        "--folder-images", type=int, default=5000, help="JPEGs to write when --folder is not given"
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes and counts (runs on CPU)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    args.cpus = per_process
    if args.quick:
        args.workers, args.steps, args.warmup, args.repeats, args.pool = 1, 3, 1, 1, 16
        args.folder_images = 24
    if args.variants is not None:
        args.variants = "".join(v for v in args.variants if v in VARIANTS)
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "LOCAL_RANK" in os.environ:  # torchrun: one process per GPU, all measured at once
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("gloo")  # barriers and the gather of rows only
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest convolutions
    env = environment(device)
    primary = rank() == 0
    if primary:
        print(f"{env['device']} | torch {env['torch']} | commit {env['commit'][:12]}")
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            make = {"resnet50": resnet50, "gpt2": gpt2, "resnet50_folder": resnet50_folder}
            work = (
                make[name](args, device)
                if name == "resnet50"
                else make[name](args, device, Path(tmp))
            )
            notes.append(f"{work.name}: {work.note}; {workers_for(work, args)} workers")
            if primary:
                print(notes[-1], flush=True)
            rows += run_workload(work, args, device)
            del work
            if device.type == "cuda":
                torch.cuda.empty_cache()
    gpus = 1
    if dist.is_initialized():
        gpus = dist.get_world_size()
        every: list[list[dict]] = [[] for _ in range(gpus)]
        dist.all_gather_object(every, rows)
        dist.destroy_process_group()
        if not primary:
            return
        rows = [r for ranks in every for r in ranks]
        rows = sorted(rows, key=lambda r: (r["workload"], r["variant"], r["rank"]))
        rows += worst_per_variant(rows)
    print_table(rows)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"input_pipeline-{slug}-x{gpus}-{stamp}.json"
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    record = {
        **env,
        "gpus": gpus,
        "timestamp": stamp,
        "settings": settings,
        "notes": notes,
        "table": rows,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    default_cuda_connections()  # as train.py: before anything asks CUDA for a device
    main()
