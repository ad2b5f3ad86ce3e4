"""bench/host_watch.py on real processes: a launcher that names train.py only as an argument (as
torchrun's line does) starts a rank (train.py as its script, LOCAL_RANK in its environment) that
runs a busy thread of its own and a DataLoader-like worker forked by a forkserver, as
mgpu/data/loader.py starts them."""

import os
import subprocess
import sys
import time

from conftest import ROOT

sys.path.insert(0, str(ROOT))

from bench import host_watch  # noqa: E402
from bench.host_watch import HostWatch, cpu_ranges, runs_train_py  # noqa: E402

RANK = """
import multiprocessing, sys, threading

def spin():
    while True:
        pass

def named_spin():  # a thread's name as /proc shows it (comm), as torch names its threads
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write("spinner")
    spin()

if __name__ == "__main__":
    worker = multiprocessing.get_context("forkserver").Process(target=spin, daemon=True)
    worker.start()
    threading.Thread(target=named_spin, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # the main thread waits, off the CPU, until the test closes stdin
"""

# torchrun's shape: its own command line holds train.py, its child runs it with LOCAL_RANK set
LAUNCHER = """
import os, subprocess, sys
subprocess.run([sys.executable, "-u", sys.argv[1]], env={**os.environ, "LOCAL_RANK": "3"})
"""


def test_finds_the_rank_its_busy_thread_and_its_forkserver_worker(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RANK)
    watch = HostWatch(interval_s=0.2, skip_s=0)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout.readline().strip() == "ready"
        time.sleep(2.0)  # about ten samples; nothing below depends on how many beyond two
        summary = watch.summary()
    finally:
        watch.stop()
        launcher.stdin.close()  # the rank returns from its read and exits, its worker with it
        launcher.wait(timeout=30)
    assert "error" not in summary, summary
    assert set(summary["ranks"]) == {"3"}, summary  # the launcher is not a rank
    rank = summary["ranks"]["3"]
    assert rank["pid"] != launcher.pid and rank["local_rank_from"] == "LOCAL_RANK"
    assert rank["samples"] >= 2 and rank["window"] == "after 0 s", rank
    assert rank["main_affinity"] == cpu_ranges(os.sched_getaffinity(0)), rank
    name, _, cores = rank["threads_top"][0]
    assert name == "spinner" and cores > 0, rank
    assert rank["main_cpu_cores"] < cores, rank  # the main thread sleeps in its read
    assert rank["workers"] == 1 and rank["workers_cores"] > 0, rank
    assert "forkserver" in rank["others_cores"], rank
    assert 1 <= rank["main_cpus_ran_on"] <= os.cpu_count(), rank


def test_names_only_train_py_run_as_the_script_a_rank():
    assert runs_train_py(["python", "-u", "/x/train.py", "data=a"])
    assert runs_train_py(["python", "-X", "utf8", "train.py"])
    assert not runs_train_py(["python", "-m", "torch.distributed.run", "--nproc_per_node=2",
                              "train.py"])  # fmt: skip
    assert not runs_train_py(["python", "-c", "from multiprocessing.forkserver import main"])
    assert not runs_train_py(["python", "bench/real_images.py", "train.py"])
    assert cpu_ranges({0, 1, 2, 3, 8, 9, 40}) == "0-3,8-9,40"


def test_nothing_where_proc_is_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(host_watch, "PROC", str(tmp_path / "no_proc"))
    assert HostWatch().summary() is None
