"""Does torchvision's nvJPEG decode, run on a side thread as mgpu's copy thread runs it, hold the
main thread's kernel launches? The counterpart of launch_stalls.py's nvjpeg case in a plain
script: JPEGs made and torchvision imported in the main thread first (as mgpu does), then one
thread decodes batches back to back on a side stream while the main thread times its launches
of a small kernel (run-ahead bounded two groups back, as launch_stalls does).

    python bench/probes/nvjpeg_thread.py --warm-main 0 --files 64 --device cuda --vary 1

--warm-main 1 decodes four batches in the main thread before the thread starts; --files the
distinct JPEGs (make_image_folder's 500x375 photo-like images, quality 90); --vary 1 draws each
call's count around 101 of 128 as decode=gpu's split does (else 101). Prints one line and writes
bench/results/nvjpeg_thread-<device>-<time>.json.
"""

import argparse
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.make_image_folder import photo_like

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--warm-main", type=int, default=0, choices=[0, 1])
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--vary", type=int, default=1, choices=[0, 1])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    dev = torch.device(args.device)
    rng = torch.Generator().manual_seed(0)
    files = []
    for seed in range(args.files):
        buf = io.BytesIO()
        Image.fromarray(photo_like(seed, 500, 375)).save(buf, format="JPEG", quality=90)
        files.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    many = [files[k % args.files] for k in range(101)]

    def decode(data: list[torch.Tensor]) -> list[torch.Tensor]:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=dev)

    if args.warm_main:
        for _ in range(4):
            decode(many)
        torch.cuda.synchronize()
    stop, count = threading.Event(), [0]

    def work() -> None:
        side = torch.cuda.Stream(dev)
        while not stop.is_set():
            n = 101
            if args.vary:
                n = int(torch.binomial(torch.tensor(128.0), torch.tensor(0.79), generator=rng))
            with torch.cuda.stream(side):
                decode([files[k % args.files] for k in range(n)])
            count[0] += 1

    x = torch.zeros(1024, device=dev)
    for _ in range(256):
        x.add_(1)
    torch.cuda.synchronize()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    time.sleep(1.0)
    first = count[0]
    launches: list[float] = []
    marks: list[torch.cuda.Event] = []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        for _ in range(256):
            began = time.perf_counter()
            x.add_(1)
            launches.append((time.perf_counter() - began) * 1e3)
        mark = torch.cuda.Event()
        mark.record()
        marks.append(mark)
        if len(marks) > 2:
            marks.pop(0).synchronize()
    stop.set()
    thread.join(30)
    held = [t for t in launches if t > 1.0]
    row = {
        "warm_main": args.warm_main, "files": args.files, "device_arg": args.device,
        "vary": args.vary, "seconds": args.seconds, "launches": len(launches),
        "held": len(held), "held_ms": sum(held), "longest_ms": max(launches),
        "calls": count[0] - first,
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name(dev)
    commit = (
        os.environ.get("MGPU_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    )
    record = {"device": name, "torch": torch.__version__, "git_commit": commit, "row": row}
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out / f"nvjpeg_thread-{name.replace(' ', '_')}-{stamp}.json"
    path.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
