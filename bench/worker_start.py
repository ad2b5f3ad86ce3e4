"""What an evaluation's DataLoader workers cost to start, by start method: the time from
iter(loader) to its first batch, for the default eval set (data=ngram) through mgpu's own
build_dataloader, each method in a process of its own.

    python bench/worker_start.py [--workers 1 2] [--rounds 30] [--out bench/results]

fork: the training process forked (what mgpu did: risks a child stuck in CPython's post-fork
code when another thread holds a lock); forkserver: mgpu's, forked from a server that has
WORKER_PRELOAD imported (its first start pays for the server); spawn: a new interpreter per
worker. Prints one row per method and worker count: the first start and the median of the rest,
and writes them to worker_start-<device>-<time>.json in --out with the machine, versions and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(method: str, workers: int, rounds: int) -> dict:
    import torch

    import mgpu.data.loader as loader_mod
    from mgpu.data.config import NgramDataConfig
    from mgpu.runtime.dist import Runtime

    if method != "forkserver":  # mgpu's default; the others replace its context
        loader_mod.worker_context = lambda dataset: method
    cfg = NgramDataConfig(num_workers=workers)
    dataset = loader_mod.build_dataset(cfg, "eval")
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    loader = loader_mod.build_dataloader(cfg, dataset, rt, seed=0, train=False)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        times.append(time.perf_counter() - start)
        del it  # the workers end, as after each evaluation
    return {"first_ms": 1e3 * times[0], "median_ms": 1e3 * statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # METHOD WORKERS, in a child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.rounds)))
        return
    print(f"{'method':<11} {'workers':>7} {'first start ms':>15} {'then, median ms':>16}")
    rows = []
    for workers in args.workers:
        for method in ("fork", "forkserver", "spawn"):
            command = [sys.executable, __file__, "--one", method, str(workers)]
            command += ["--rounds", str(args.rounds)]
            out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{method:<11} {workers:>7} {row['first_ms']:>15.0f} {row['median_ms']:>16.1f}")
            rows.append({"method": method, "workers": workers, **row})
    write_results(args, rows)


def write_results(args: argparse.Namespace, rows: list[dict]) -> None:
    import torch

    from bench.engines import versions

    if torch.cuda.is_available():
        facts = versions()
    else:
        head = ["git", "rev-parse", "HEAD"]
        commit = subprocess.run(head, cwd=ROOT, capture_output=True, text=True).stdout.strip()
        commit = os.environ.get("MGPU_COMMIT") or commit
        facts = {"device": "cpu", "torch": torch.__version__, "git_commit": commit}
    facts |= {"cpus": os.cpu_count(), "python": sys.version.split()[0], "rounds": args.rounds}
    name = str(facts["device"]).replace(" ", "_")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"worker_start-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**facts, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
