"""Where each rank's training thread spends its time during a run: py-spy's native stacks of
every thread, sampled from outside the process, then the main thread's samples sorted into the
step's parts, and how many of them wait to take the GIL back after a torch call.

    # beside a run (real_images.py writes its runs' logs under /tmp/real_images-*/<run>/):
    python bench/probes/host_stacks.py watch OUT --logs '/tmp/real_images-*/*/rank0.log'
    python bench/probes/host_stacks.py summary OUT/spy-*.txt > OUT/summary.json

`watch` waits for each new run's log to reach step --at, then records every rank process
(train.py under torchrun, or train.py alone) for --seconds at --rate samples a second, all ranks
at once, into OUT/spy-<run>-<pid>.txt (py-spy's raw format), until stopped. py-spy stops a process
for every sample: the runs it watches are slower, and their timings are not measurements.
py-spy is not one of mgpu's dependencies: `pip install py-spy` (on the GPU machines, carry its
wheel), or give its path with --py-spy.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import time
from pathlib import Path

# The step's parts, by the frames a sample is under (the first part that matches wins).
PARTS = [
    ("waiting for the verdict LAG steps old", ("Event.synchronize",)),
    ("update", ("Update.__call__",)),
    ("backward", ("Tensor.backward",)),
    ("forward", ("GraphedLoss.__call__", "ModelLoss.forward")),
    ("data", ("Feed.prepare", "_prepended")),
    ("recorder", ("Recorder.",)),
]


def ranks(rows: str) -> list[int]:
    """The training processes among `ps -eo pid=,ppid=,args=` rows: train.py under torchrun, or
    train.py started by something else (one GPU). Not their DataLoader workers."""
    procs = {}
    for line in rows.splitlines():
        pid, ppid, args = (line.strip().split(None, 2) + [""])[:3]
        procs[int(pid)] = (int(ppid), args)
    found = []
    for pid, (ppid, args) in procs.items():
        parent = procs.get(ppid, (0, ""))[1]
        launched = "torchrun" in parent or "torch.distributed.run" in parent
        launcher = "torchrun" in args or "torch.distributed.run" in args
        if "train.py" in args and not launcher and (launched or "train.py" not in parent):
            found.append(pid)
    return sorted(found)


def watch(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    started, done = time.time(), set()
    while True:
        for log in glob.glob(args.logs):
            if log in done or os.path.getmtime(os.path.dirname(log)) < started - 5:
                continue
            if f"step {args.at}/" not in Path(log).read_text(errors="replace"):
                continue
            done.add(log)
            run = Path(log).parent.name
            ps = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
            pids = ranks(ps.stdout)
            print(time.strftime("%H:%M:%S"), run, "ranks", pids, flush=True)
            spies = [
                subprocess.Popen(
                    [args.py_spy, "record", "--native", "--threads", "--idle", "-r",
                     str(args.rate), "-d", str(args.seconds), "-f", "raw", "-p", str(pid),
                     "-o", str(args.out / f"spy-{run}-{pid}.txt")],
                    stdout=subprocess.DEVNULL,
                )
                for pid in pids
            ]  # fmt: skip
            for spy in spies:
                spy.wait()
        time.sleep(1)


def part_of(stack: str) -> str:
    return next((name for name, frames in PARTS if any(f in stack for f in frames)), "other")


def summary(files: list[Path]) -> dict:
    """Per file: the main thread's share of samples in each part of the step, and the share in
    which it waited to take the GIL back (pthread_cond_timedwait under a torch binding; not
    counted where it waits for the verdict, which releases the GIL)."""
    out = {}
    for path in files:
        parts, gil, total = collections.Counter(), collections.Counter(), 0
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if "MainThread" not in stack.split(";", 1)[0]:
                continue
            n, part = int(count), part_of(stack)
            total, parts[part] = total + n, parts[part] + n
            if "pthread_cond_timedwait" in stack and part != PARTS[0][0]:
                gil[part] += n
        if total:
            out[path.stem] = {
                "samples": total,
                "share": {k: round(v / total, 3) for k, v in parts.most_common()},
                "gil_wait_share": {k: round(v / total, 3) for k, v in gil.most_common()},
                "gil_wait_total": round(sum(gil.values()) / total, 3),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="record each new run's ranks once its log reaches --at")
    w.add_argument("out", type=Path)
    w.add_argument("--logs", default="/tmp/real_images-*/*/rank0.log", help="glob of rank 0 logs")
    w.add_argument("--at", type=int, default=260, help="the step to start at (a logged one)")
    w.add_argument("--seconds", type=int, default=10)
    w.add_argument("--rate", type=int, default=50, help="samples a second")
    w.add_argument("--py-spy", default="py-spy")
    s = sub.add_parser("summary", help="the main thread's parts, as JSON")
    s.add_argument("files", type=Path, nargs="+")
    args = p.parse_args()
    if args.cmd == "watch":
        watch(args)
    else:
        print(json.dumps(summary(args.files), indent=1))


if __name__ == "__main__":
    main()
