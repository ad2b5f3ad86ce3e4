"""What the GPU JPEG decode step (data.decode=gpu) does beside a busy GPU: the measurement to run
first when taking up the real-images gap (bench/README.md, "Real images"). GPU only.

    python bench/gpu_decode_contention.py [--folder DIR] [--batch 128]

On one H100 the step decoded 9,000-17,000 images/s alone but 1,300-2,600 beside a loop of
convolutions and ~0 beside a loop of large matrix products, whatever the priority of its
stream. The phases below found why: one decode's latency grows with the products queued ahead
of it on another stream, default or not (queued_on_*), and the rate beside convolutions
(conv_on_*) depends on CUDA's hardware queues: 122 images/s with CUDA_DEVICE_MAX_CONNECTIONS=8
(the default), 5,639 with 32, which train.py now sets (bench/README.md, "Real images"). Run it
with the variable set either way; the file records which.

Writes bench/results/gpu_decode_contention-<device>-<time>.json: the decode alone, one decode's
latency after 0..N queued products, and the decode's rate beside a convolution loop that syncs
every K iterations (K = 1, 4, never).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engines import versions  # noqa: E402
from bench.make_image_folder import write_folder  # noqa: E402
from mgpu.data import ImageFolder  # noqa: E402
from mgpu.data.encoded import collate_encoded  # noqa: E402
from mgpu.data.sampler import SampleKey  # noqa: E402


def encoded_batches(folder: Path, batch: int, count: int, device: torch.device):
    """data.decode=gpu's batch step on `device` and `count` pinned batches of the folder's
    training images, as the workers hand them over."""
    dataset = ImageFolder("train", str(folder), decode="gpu", eval_samples=64)
    step = dataset.device_decoder(device)
    work = []
    for b in range(count):
        keys = [SampleKey((b * batch + i) % len(dataset), 0, 0) for i in range(batch)]
        work.append(collate_encoded([dataset[k] for k in keys]).pin_memory())
    return step, work


def alone(step, work, stream) -> float:
    with torch.cuda.stream(stream):
        step(work[0])
        torch.cuda.synchronize()
        start = time.perf_counter()
        for encoded in work:
            step(encoded)
        torch.cuda.synchronize()
    return len(work) * len(work[0].labels) / (time.perf_counter() - start)


def latency_after_queue(step, work, stream, queued: int, a: torch.Tensor, on) -> float:
    """ms from calling the decode step to its result, with `queued` products queued ahead of
    it on the stream `on` (host-side: the step's own host waits included)."""
    times = []
    for encoded in work[:6]:
        torch.cuda.synchronize()
        with torch.cuda.stream(on):
            for _ in range(queued):
                a @ a
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            step(encoded)
            stream.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def beside_conv(step, work, stream, sync_every: int | None, seconds: float, on) -> dict:
    """The decode on a thread beside a convolution loop on this one, on the stream `on`, that
    syncs every `sync_every` iterations (None: never); decode img/s and the loop's ms per
    iteration."""
    device = stream.device
    x = torch.randn(128, 256, 56, 56, device=device, dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(256, 256, 3, padding=1).to(device, torch.bfloat16)
    conv = conv.to(memory_format=torch.channels_last)

    def loop(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(on):
            for i in range(n):
                conv(x)
                if sync_every and (i + 1) % sync_every == 0:
                    on.synchronize()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e3

    per = loop(20)
    n = max(50, int(seconds * 1e3 / per))
    solo_ms = loop(n)
    stop, done = threading.Event(), []

    def decode() -> None:
        k = 0
        with torch.cuda.device(device), torch.cuda.stream(stream):
            while not stop.is_set():
                step(work[k % len(work)])
                stream.synchronize()
                done.append(time.perf_counter())
                k += 1

    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(0.5)
    start = time.perf_counter()
    busy_ms = loop(n)
    end = time.perf_counter()
    stop.set()
    thread.join()
    images = sum(start <= t <= end for t in done) * len(work[0].labels)
    return {
        "conv_ms_alone": solo_ms,
        "conv_ms_beside": busy_ms,
        "decode_img_per_s_beside": images / (end - start),
    }


def python_rate(step, work, stream, seconds: float = 1.0) -> dict:
    """Iterations a second of a pure-Python loop on this thread, alone and while another thread
    decodes: whether the decode step holds the GIL while it waits for the GPU."""

    def count(until: float) -> float:
        n, start = 0, time.perf_counter()
        while time.perf_counter() < until:
            n += 1
        return n / (time.perf_counter() - start)

    solo = count(time.perf_counter() + seconds)
    stop = threading.Event()

    def decode() -> None:
        k = 0
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            while not stop.is_set():
                step(work[k % len(work)])
                stream.synchronize()
                k += 1

    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(0.3)
    beside = count(time.perf_counter() + seconds)
    stop.set()
    thread.join()
    return {"alone": solo, "beside_decode": beside}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--folder", type=Path)
    p.add_argument("--images", type=int, default=2400)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--queued", type=int, nargs="+", default=[0, 5, 20, 50])
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument(
        "--phases",
        nargs="*",
        help="only these (alone python queued_on_default queued_on_own "
        "conv_on_default conv_on_own); one per process keeps a fault in one from hiding the rest",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: it measures the GPU decode beside GPU work")
    folder = args.folder
    if folder is None:
        folder = Path(tempfile.mkdtemp()) / "images"
        write_folder(folder, args.images, 100, mix="realistic")
    device = torch.device("cuda", torch.cuda.current_device())
    step, work = encoded_batches(folder, args.batch, 12, device)
    stream = torch.cuda.Stream(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    product_ms = (time.perf_counter() - start) / 20 * 1e3
    # The other work on torch's default stream (the legacy stream 0, where train.py's step runs)
    # and on a non-blocking stream of its own: the decode waited behind both alike.
    loops = {"default": torch.cuda.default_stream(device), "own": torch.cuda.Stream(device)}
    phases = {
        "alone": lambda: alone(step, work, stream),
        "python": lambda: python_rate(step, work, stream),
    }
    for name, on in loops.items():
        phases[f"queued_on_{name}"] = lambda on=on: {
            q: latency_after_queue(step, work, stream, q, a, on) for q in args.queued
        }
        phases[f"conv_on_{name}"] = lambda on=on: {
            str(k): beside_conv(step, work, stream, k, args.seconds, on) for k in (1, 4, None)
        }
    # Read by the CUDA driver as it starts: this process's hardware queues (8 when unset).
    record = {
        "one_product_ms": product_ms,
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)"),
    }
    for name in args.phases or list(phases):
        record[name] = phases[name]()
        print(json.dumps({name: record[name]}), flush=True)
    print(json.dumps(record, indent=1))
    meta = versions()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    record.update(meta, argv=sys.argv, time=stamp)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "-".join(args.phases or ["all"])
    path = args.out / f"gpu_decode_contention-{meta['device'].replace(' ', '_')}-{stamp}-{tag}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
