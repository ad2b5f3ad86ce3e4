"""Does another thread's host-side CUDA work hold the training thread's kernel launches, and what
stops it? #40's 2-GPU traces (bench/README.md) show a rank's every CUDA call held for 55-80 ms
about once in 10 steps, ended by the DataLoader pinning thread's cudaHostAlloc, with nvJPEG's
copy thread silent over the same span; every other rank then waits for that one.

    python bench/probes/launch_stalls.py                 # one GPU, every case
    python bench/probes/launch_stalls.py --quick         # CPU: checks it (nothing to measure)

The main thread launches small kernels back to back for --seconds, timing each launch on the
host, its run-ahead bounded as a training loop's is (it waits on an event two groups back, and
those waits are not counted). Beside it one thread does a case's work:
  idle          nothing
  pin           what the loader's pinning thread does for decode=gpu: a batch of JPEG bytes of
                varying size (about 7.8 MB, across the caching host allocator's 8 MiB class)
                and its worker-decoded pixels (about 27 images of 224x224, varying) pinned, the
                pixels copied to the GPU on a side stream, 30 batches held as in flight
  nvjpeg        torchvision's GPU decode (nvJPEG) of a batch of JPEGs, as many a call as
                decode=gpu's split gives (a draw around 101 of 128)
  nvjpeg_fixed  the same, every call of 101 JPEGs
--queue step launches bf16 2048x2048 matmuls instead of tiny kernels, so that the GPU has
10-20 ms of work queued as in a training step: it shows whether a case's hold grows with the
queue (a lock held while the device drains would), where tiny kernels show the lock alone.
Each case runs in a process of its own, and those named in --reserve once more with torch's
pinned reserve (PYTORCH_CUDA_ALLOC_CONF=pinned_reserve_segment_size_mb:--reserve-mb, which
serves pinned blocks from one segment page-locked at the first allocation). Per run: launches,
their median and 99.9th-percentile host time, the longest, how many took over 1 ms and their
sum, and how many batches the thread got through. Writes
bench/results/launch_stalls-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASES = ["idle", "pin", "nvjpeg", "nvjpeg_fixed"]
HELD_MS = 1.0  # a launch this long was held by something else
GROUP = 256  # launches between run-ahead marks
BATCH, JPEG_SHARE, SIDE = 128, 0.79, 224  # decode=gpu's split of a B=128 batch


def jpegs(count: int) -> list[torch.Tensor]:
    """`count` ImageNet-like JPEGs (make_image_folder's 500x375 photo-like images, quality 90)."""
    from PIL import Image

    from bench.make_image_folder import photo_like

    out = []
    for seed in range(count):
        buf = io.BytesIO()
        Image.fromarray(photo_like(seed, 500, 375)).save(buf, format="JPEG", quality=90)
        out.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    return out


def pinning(device: torch.device, stop: threading.Event, done: list[int]) -> None:
    """The loader's pinning thread and the prefetcher's copies, as decode=gpu runs them."""
    rng = torch.Generator().manual_seed(0)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    held: collections.deque = collections.deque(maxlen=30)
    while not stop.is_set():
        data = int(BATCH * JPEG_SHARE * 77_600 * (1 + 0.05 * torch.randn(1, generator=rng).item()))
        images = max(1, int(BATCH * (1 - JPEG_SHARE) + 5 * torch.randn(1, generator=rng).item()))
        pixels = torch.empty(images, 3, SIDE, SIDE, dtype=torch.uint8)
        batch = [torch.empty(data, dtype=torch.uint8), pixels]
        if stream is not None:
            batch = [t.pin_memory() for t in batch]
            with torch.cuda.stream(stream):
                batch[1].to(device, non_blocking=True)
        held.append(batch)
        done[0] += 1


def decoding(
    device: torch.device, stop: threading.Event, done: list[int], fixed: bool, files: list
) -> None:
    """The prefetcher's copy thread under decode=gpu: nvJPEG through torchvision."""
    from torchvision.io import ImageReadMode, decode_jpeg

    rng = torch.Generator().manual_seed(0)
    stream = torch.cuda.Stream(device)
    mean = round(BATCH * JPEG_SHARE)
    while not stop.is_set():
        count = (
            mean
            if fixed
            else int(
                torch.binomial(torch.tensor(float(BATCH)), torch.tensor(JPEG_SHARE), generator=rng)
            )
        )
        with torch.cuda.stream(stream):
            decode_jpeg(
                [files[k % len(files)] for k in range(count)], mode=ImageReadMode.RGB, device=device
            )
        done[0] += 1


def one_case(
    case: str, seconds: float, device: torch.device, queue: str, profile: bool = False
) -> dict:
    """Times the main thread's launches while the case's thread works; with `profile`, under
    torch.profiler, and the host's CUDA calls of 1 ms or more (any thread) counted by name."""
    if not profile:
        return timed(case, seconds, device, queue)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profiler(activities=activities) as prof:
        row = timed(case, seconds, device, queue)
    calls: dict[str, list[float]] = {}
    for e in prof.events():
        ms = e.cpu_time_total / 1e3  # a runtime call: its host time
        if e.name.startswith("cuda") and ms >= HELD_MS:
            calls.setdefault(e.name, []).append(round(ms, 2))
    row["profiled"] = True
    row["slow_cuda_calls"] = {name: sorted(ms, reverse=True)[:10] for name, ms in calls.items()}
    return row


def timed(case: str, seconds: float, device: torch.device, queue: str) -> dict:
    """The main thread's launches, timed, while the case's thread works."""
    stop, done = threading.Event(), [0]
    # The JPEGs are made, and nvJPEG first used, here in the main thread before any timing, as
    # mgpu does (gpu_decoder decodes a first JPEG while it builds the step). Made and first used
    # in the decoding thread (7b733fc, 4b6ec1b), the nvjpeg cases held launches 2.7-7.1 s of
    # 6-15, where bench/probes/nvjpeg_thread.py (since removed; bench/README.md, 2026-11-28)
    # held none on the same H200; this order is not yet measured here.
    files = jpegs(64) if case.startswith("nvjpeg") else []
    if files:
        from torchvision.io import ImageReadMode, decode_jpeg

        decode_jpeg(files[:1], mode=ImageReadMode.RGB, device=device)
        torch.cuda.synchronize(device)
    failed: list[BaseException] = []
    work = {"pin": lambda: pinning(device, stop, done)}
    work["nvjpeg"] = lambda: decoding(device, stop, done, False, files)
    work["nvjpeg_fixed"] = lambda: decoding(device, stop, done, True, files)
    if queue == "step":  # ~30-40 us a matmul on an H100: a group is ~10 ms of GPU work
        x = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
        y = torch.empty_like(x)

        def launch() -> None:
            torch.mm(x, x, out=y)

    else:
        x = torch.zeros(1024, device=device)

        def launch() -> None:
            x.add_(1.0)

    cuda = device.type == "cuda"
    for _ in range(GROUP):  # the kernel loaded and the first launches' set-up paid, untimed
        launch()
    if cuda:
        torch.cuda.synchronize(device)

    def guarded() -> None:  # a thread's error is the row's, not a line on a discarded stderr
        try:
            work[case]()
        except BaseException as err:  # noqa: BLE001 - recorded in the row, then the run ends
            failed.append(err)

    thread = threading.Thread(target=guarded, daemon=True) if case != "idle" else None
    if thread is not None:
        thread.start()
        time.sleep(1.0)  # its first batches (nvJPEG's set-up, the pinned pool's first blocks)
    first = done[0]
    launches: list[float] = []
    marks: collections.deque = collections.deque()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(GROUP):
            began = time.perf_counter()
            launch()
            launches.append((time.perf_counter() - began) * 1e3)
        if cuda:  # bounded run-ahead, as a training loop's: not a launch, not counted
            mark = torch.cuda.Event()
            mark.record()
            marks.append(mark)
            if len(marks) > 2:
                marks.popleft().synchronize()
    stop.set()
    if thread is not None:
        thread.join(timeout=30)
    held = [t for t in launches if t > HELD_MS]
    ordered = sorted(launches)
    why = None
    if failed:
        why = f"the case's thread failed: {type(failed[0]).__name__}: {failed[0]}"
    elif thread is not None and thread.is_alive():
        why = "the case's thread did not end within 30 s of the stop"
    elif thread is not None and done[0] == first:
        why = "the case's thread got through no batch in the timed seconds"
    return {
        **({"error": why} if why else {}),
        "case": case,
        "queue": queue,
        "env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "launches": len(launches),
        "median_us": statistics.median(launches) * 1e3,
        "p999_us": ordered[int(0.999 * (len(ordered) - 1))] * 1e3,
        "longest_ms": ordered[-1],
        "held": len(held),
        "held_ms": sum(held),
        "batches": done[0] - first,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    p.add_argument("--reserve", nargs="*", default=["pin", "nvjpeg"], choices=CASES)
    p.add_argument("--reserve-mb", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=20.0, help="timed seconds a run (> 0)")
    p.add_argument(
        "--profile", action="store_true",
        help="each run under torch.profiler too: the host's CUDA calls of 1 ms or more by name "
        "(cudaHostAlloc, cudaFreeHost, ...); its callbacks slow launches, so held launches "
        "are best read from a run without it",
    )  # fmt: skip
    p.add_argument(
        "--queue", nargs="+", default=["small"], choices=["small", "step"], metavar="QUEUE",
        help="the main thread's kernels: tiny ones, or matmuls that queue a step's worth of "
        "GPU work (each value runs every case)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="CPU, the pin case only, briefly")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a case, in its own process
    args = p.parse_args()
    if args.seconds <= 0:
        p.error(f"--seconds {args.seconds}: give a time above 0, e.g. --seconds 20")
    if args.quick and args.queue != ["small"]:
        p.error("--quick runs the small queue only (the CPU has no queue to fill); drop --queue")
    if args.one and len(args.queue) != 1:
        p.error("--one runs one queue: give --queue small or --queue step")
    device = torch.device("cpu" if args.quick else "cuda")
    if args.one:
        print(
            json.dumps(one_case(args.one, args.seconds, device, args.queue[0], args.profile)),
            flush=True,
        )
        return
    cases = ["idle", "pin"] if args.quick else args.cases
    seconds = 1.0 if args.quick else args.seconds
    reserve = f"pinned_reserve_segment_size_mb:{args.reserve_mb}"
    plan = []
    for queue in args.queue:  # --quick: small alone (refused above otherwise)
        plan += [(case, "", queue) for case in cases]
        plan += [(c, reserve, queue) for c in args.reserve if c in cases and not args.quick]
    rows = []
    limit = 3 * seconds + 120  # its start-up, its thread's set-up, the timed seconds
    for case, conf, queue in plan:
        env = {**os.environ}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        cmd = [sys.executable, __file__, "--one", case, "--seconds", str(seconds)]
        cmd += ["--queue", queue]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--profile"] if args.profile else []
        rows.append(run_case(cmd, env, limit, {"case": case, "queue": queue, "env": conf}))
        print(json.dumps(rows[-1]), flush=True)
    write(args, rows, "cpu" if args.quick else torch.cuda.get_device_name())


def run_case(cmd: list[str], env: dict, limit: float, which: dict) -> dict:
    """One case's process: its row, or `which` with the error (a case that hangs, nvJPEG stuck,
    is recorded so, and the others still run)."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {**which, "error": f"no result within {limit:.0f} s"}
    if done.returncode != 0:
        return {**which, "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def write(args, rows: list[dict], name: str) -> None:  # noqa: ANN001
    commit = (
        os.environ.get("MGPU_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    )
    record = {"device": name, "torch": torch.__version__, "git_commit": commit, "argv": sys.argv}
    record["rows"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    path = (
        args.out / f"launch_stalls-{name.replace(' ', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
