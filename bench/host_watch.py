"""What each training process of a bench run did on the host's CPUs, read from /proc while the
run goes: a module of real_images.py (each run's `host_watch`).

Some 4-GPU runs were 3-8 ms a step slower than their neighbours from their start, with nothing
else on the machine. One explanation: a rank's main thread, the one that launches its GPU work,
shares a core with its own DataLoader workers or other busy threads and waits for the CPU. This
module owns the evidence for or against that:

- finding a run's ranks among this script's descendants (a process that runs train.py as its
  script; its local rank from LOCAL_RANK in its environment) and each rank's family (its
  descendants: the DataLoader workers that mgpu/data/loader.py forks from a forkserver started
  by the rank, the forkserver itself, torch.compile's worker pool);
- sampling every thread of each family (/proc/<pid>/task/*/stat, and the main thread's status
  and schedstat) about twice a second from a thread of the bench script;
- summing it up per rank: the main thread's CPU, involuntary context switches, run-queue wait,
  the CPUs it ran on and how often a busy thread of its family last ran on the same CPU; the
  rank's busiest other threads; its workers' count and CPU. The sums are over the rank's
  samples after its first SKIP_S seconds, torch.compile's time included (/proc cannot tell a
  compile from a step): the main thread's CPU and switches per SLICE_S seconds show where its
  steps began.

HostWatch has GpuWatch's life cycle: it starts sampling when made, `summary()` stops and sums
up, `stop()` only stops. Nothing where /proc is absent (summary() is None).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

PROC = "/proc"
HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # stat's CPU times' unit

# Between samples. A sample costs ~30 us of CPU a thread of the family (2 slow cores): ~15 ms for
# 4 ranks of ~150 threads with their workers, 3 % of a core at this rate; `sampler_cpu_s` in the
# summary says what it cost in the run.
INTERVAL_S = 0.5
DISCOVER_S = 2.0  # between looks for new processes (a full /proc scan, the dearest read)
SKIP_S = 5.0  # of each rank's start left out of its sums: imports, not training
SLICE_S = 10.0  # the main thread's timeline, a value per slice (where compile ends, steps begin)
BUSY_CORES = 0.5  # a thread that used more than this since the last sample counts as busy
TOP_THREADS = 5


def read(path: str, binary: bool = False) -> str | bytes | None:
    """A /proc file's text, or None where its process or thread ended meanwhile (ENOENT, ESRCH)
    or may not be read (another user's environ). os.read, not pathlib or open(): a sample reads
    hundreds of these, and here each costs a quarter of what Path.read_text does."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):  # cmdline and environ may be long
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return data if binary else data.decode(errors="replace")


def parse_stat(text: str) -> tuple[str, int, int, int, int]:
    """(comm, ppid, utime + stime in ticks, the CPU it last ran on, start time in ticks) of a
    /proc stat line. comm may hold spaces and parentheses: the fields are those after its
    last ')'."""
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15, starttime 22, processor 39
    return comm, int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[36]), int(fields[19])


def runs_train_py(argv: list[str]) -> bool:
    """Whether a command line runs train.py as Python's script (`python [-u ...] train.py ...`):
    torchrun's own line names train.py only as an argument (`python -m torch.distributed.run
    ... train.py`), a forkserver's is `python -c ...`."""
    rest = iter(argv[1:])
    for arg in rest:
        if arg in ("-m", "-c"):
            return False
        if arg in ("-X", "-W"):  # the options of Python's that take a value of their own
            next(rest, None)
        elif not arg.startswith("-"):
            return Path(arg).name == "train.py"
    return False


def process_name(argv: list[str]) -> str:
    """A rank's descendant other than a worker, named by its command line (their comm is
    python, all of them): forkserver, resource_tracker, a module (-m) or a script's last two
    path parts (torch.compile's pool: its compile_worker package run as a script)."""
    line = " ".join(argv)
    for known in ("forkserver", "resource_tracker"):
        if f"multiprocessing.{known}" in line:
            return known
    if "-m" in argv[1:-1]:
        return argv[argv.index("-m") + 1]
    scripts = [a for a in argv[1:] if a.endswith(".py")]
    if scripts:
        return "/".join(Path(scripts[0]).parts[-2:])
    return Path(argv[0]).name if argv else "?"


def cpu_ranges(cpus: set[int] | list[int]) -> str:
    """CPUs as taskset -c writes them: 0-15,32-47."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class Window:
    """One rank's sums over a span of its samples."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.samples = 0
        self.main_ticks = 0
        self.main_nvcsw = 0
        self.main_wait_ns: int | None = 0  # None where schedstat is absent
        self.main_cpus: set[int] = set()
        self.shared = 0  # samples where a busy thread of the family last ran on main's CPU
        self.shared_with: Counter[str] = Counter()
        self.threads: dict[int, list] = {}  # the rank's other threads: tid -> [comm, ticks]
        self.worker_ticks = 0
        self.workers_most = 0
        self.other_ticks: Counter[str] = Counter()  # by process_name
        self.others_most = 0


class Rank:
    """A training process found in the run: its family as last discovered, the last sample of
    each of its threads (the next sample's deltas are taken from it) and its sums."""

    def __init__(self, pid: int, argv: list[str], local_rank: int | None, now: float) -> None:
        self.pid, self.argv = pid, argv
        self.local_rank = local_rank  # None: no LOCAL_RANK (python train.py, one process)
        self.first_seen = now
        self.family: dict[int, str] = {}  # pid -> "worker" or its process_name (not the rank)
        self.affinity_first: str | None = None
        self.affinity: str | None = None
        self.last: float | None = None  # the time of its last sample
        self.ticks: dict[tuple[int, int], int] = {}  # (pid, tid) -> CPU ticks at the last sample
        self.nvcsw: int | None = None
        self.wait_ns: int | None = None
        self.whole = Window()  # every sample
        self.steady = Window()  # the samples after SKIP_S
        self.slices: list[list[float]] = []  # per SLICE_S: [seconds, main ticks, main nvcsw]


class HostWatch:
    """Samples the threads of every rank of the run that this process (`root`) launches, from a
    daemon thread, every `interval_s` seconds, from now until summary() or stop()."""

    def __init__(
        self, root: int | None = None, interval_s: float = INTERVAL_S, skip_s: float = SKIP_S
    ) -> None:
        self.root = os.getpid() if root is None else root
        self.interval_s, self.skip_s = interval_s, skip_s
        self.ranks: dict[int, Rank] = {}  # pid -> its state
        self.known: dict[int, tuple[int, list[str], int | None]] = {}  # pid -> start, argv, rank
        self.samples = 0
        self.sampler_cpu_s = 0.0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not os.path.exists(f"{PROC}/self/stat"):  # not Linux: nothing to read
            return
        self._thread = threading.Thread(target=self._loop, name="host_watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        started = time.thread_time()
        next_look = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                # a full look while no rank is known yet, so that a run's start is not missed
                if now >= next_look or not self.ranks:
                    self._discover(now)
                    next_look = now + DISCOVER_S
                for rank in self.ranks.values():
                    self._sample(rank, now)
                self.samples += 1
            except Exception as e:  # a bug here must not end the run, nor go unsaid
                self.error = f"{type(e).__name__}: {e}"
                return
            finally:
                # its own cost, recorded: it runs unpinned and could be the thread in the way
                self.sampler_cpu_s = time.thread_time() - started
            self._stop.wait(self.interval_s)

    def _identity(self, pid: int, start: int) -> tuple[list[str], int | None] | None:
        """A process's argv and LOCAL_RANK, read once per process (a pid reused is a new one)."""
        known = self.known.get(pid)
        if known is None or known[0] != start:
            raw = read(f"{PROC}/{pid}/cmdline", binary=True)
            if raw is None:
                return None
            argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
            local_rank = None
            if runs_train_py(argv):  # only a rank's environment matters (and is read)
                environ = read(f"{PROC}/{pid}/environ", binary=True) or b""
                for item in environ.split(b"\0"):
                    value = item.removeprefix(b"LOCAL_RANK=")
                    if value != item and value.isdigit():
                        local_rank = int(value)
            known = self.known[pid] = (start, argv, local_rank)
        return known[1], known[2]

    def _discover(self, now: float) -> None:
        """The run's ranks and each one's family, from every process's parent. A rank is the
        first process on a path down from `root` that runs train.py as its script: a DataLoader
        worker forked straight from a rank (the fork start method) runs the same command line
        and is its family, not a rank."""
        children: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for name in os.listdir(PROC):
            text = read(f"{PROC}/{name}/stat") if name.isdigit() else None
            if text is None:  # ended between the listing and the read
                continue
            _, ppid, _, _, start = parse_stat(text)
            pid = int(name)
            children.setdefault(ppid, []).append(pid)
            starts[pid] = start
        queue = list(children.get(self.root, []))
        while queue:
            pid = queue.pop()
            identity = self._identity(pid, starts[pid])
            if identity is None:
                continue
            argv, local_rank = identity
            if not runs_train_py(argv):
                queue += children.get(pid, [])
                continue
            rank = self.ranks.get(pid)
            if rank is None:
                rank = self.ranks[pid] = Rank(pid, argv, local_rank, now)
            rank.family = self._family(rank, children, starts)
            try:
                rank.affinity = cpu_ranges(os.sched_getaffinity(pid))  # its main thread's
            except OSError:  # it ended
                continue
            rank.affinity_first = rank.affinity_first or rank.affinity

    def _family(self, rank: Rank, children, starts) -> dict[int, str]:
        """A rank's descendants, each named by _classify."""
        family: dict[int, str] = {}
        queue = [(c, rank.pid) for c in children.get(rank.pid, [])]
        while queue:  # a parent is named before its children (a worker's parent: a forkserver)
            pid, parent = queue.pop()
            name = self._classify(rank, family, pid, parent, starts[pid])
            if name is not None:
                family[pid] = name
                queue += [(c, pid) for c in children.get(pid, [])]
        return family

    def _classify(self, rank: Rank, family: dict, pid: int, parent: int, start: int) -> str | None:
        """A rank's descendant: "forkserver" (the server that mgpu/data/loader.py starts from the
        rank), "worker" (a DataLoader worker: forked by that server, or by the rank itself under
        the fork start method, whose workers run the rank's own command line), or else its
        process_name (torch.compile's pool, a resource tracker); None if it ended."""
        identity = self._identity(pid, start)
        if identity is None:
            return None
        argv = identity[0]
        if parent == rank.pid and any("multiprocessing.forkserver" in a for a in argv):
            return "forkserver"
        if family.get(parent) == "forkserver" or (parent == rank.pid and argv == rank.argv):
            return "worker"
        return process_name(argv)

    def _adopt(self, rank: Rank) -> None:
        """Children new since the last look, of the rank and of its family, from their main
        threads' children lists (one read a process): a DataLoader's workers start when its
        iteration does and a short run's evaluation workers live for a second or two, less than
        DISCOVER_S. Children forked by other threads wait for the next full look."""
        for parent in [rank.pid, *rank.family]:
            listed = read(f"{PROC}/{parent}/task/{parent}/children")
            for child in map(int, (listed or "").split()):  # "" where the kernel lacks the file
                if child in rank.family:
                    continue
                stat = read(f"{PROC}/{child}/stat")
                name = stat and self._classify(
                    rank, rank.family, child, parent, parse_stat(stat)[4]
                )
                if name:
                    rank.family[child] = name

    def _threads(self, pid: int) -> dict[int, tuple[str, int, int]]:
        """A process's threads: tid -> (comm, CPU ticks, CPU last run on); none if it ended."""
        try:
            tids = os.listdir(f"{PROC}/{pid}/task")
        except OSError:
            return {}
        threads = {}
        for tid in tids:
            text = read(f"{PROC}/{pid}/task/{tid}/stat")
            if text is not None:
                comm, _, ticks, cpu, _ = parse_stat(text)
                threads[int(tid)] = (comm, ticks, cpu)
        return threads

    def _sample(self, rank: Rank, now: float) -> None:
        """One sample of a rank's family: each thread's CPU since the last sample, added to the
        rank's windows."""
        self._adopt(rank)
        own = self._threads(rank.pid)
        if rank.pid not in own:  # the rank ended (or is ending)
            return
        task = f"{PROC}/{rank.pid}/task/{rank.pid}"
        status = read(f"{task}/status") or ""
        nvcsw = next(
            (int(line.split()[1]) for line in status.splitlines()
             if line.startswith("nonvoluntary_ctxt_switches:")),
            None,
        )  # fmt: skip
        schedstat = (read(f"{task}/schedstat") or "").split()
        wait_ns = int(schedstat[1]) if len(schedstat) > 1 else None  # ns runnable, not running
        # every thread of the family, labelled as the shared-CPU count names it
        threads: dict[tuple[int, int], tuple[str, int, int, str]] = {}
        for tid, (comm, ticks, cpu) in own.items():
            threads[(rank.pid, tid)] = (comm, ticks, cpu, f"thread {comm}")
        members = Counter()
        for pid, name in rank.family.items():
            found = self._threads(pid)
            members["worker" if name == "worker" else "other"] += bool(found)
            for tid, (comm, ticks, cpu) in found.items():
                threads[(pid, tid)] = (comm, ticks, cpu, name)
        previous, rank.ticks = rank.ticks, {key: t[1] for key, t in threads.items()}
        before_nvcsw, rank.nvcsw = rank.nvcsw, nvcsw
        before_wait, rank.wait_ns = rank.wait_ns, wait_ns
        last, rank.last = rank.last, now
        if last is None or nvcsw is None or before_nvcsw is None:
            return  # the first sample: only the baseline
        seconds = now - last
        main_cpu = own[rank.pid][2]
        shared_with = set()
        deltas: dict[tuple[int, int], int] = {}
        for key, (_, ticks, cpu, label) in threads.items():
            # a thread new since the last sample counts from this one on
            deltas[key] = ticks - previous.get(key, ticks)
            busy = deltas[key] / HZ / seconds > BUSY_CORES
            if key != (rank.pid, rank.pid) and busy and cpu == main_cpu:
                shared_with.add(label)
        windows = [rank.whole] + ([rank.steady] if now - rank.first_seen >= self.skip_s else [])
        for w in windows:
            w.seconds += seconds
            w.samples += 1
            w.main_ticks += deltas[(rank.pid, rank.pid)]
            w.main_nvcsw += nvcsw - before_nvcsw
            if w.main_wait_ns is not None and wait_ns is not None and before_wait is not None:
                w.main_wait_ns += wait_ns - before_wait
            else:
                w.main_wait_ns = None
            w.main_cpus.add(main_cpu)
            w.shared += bool(shared_with)
            w.shared_with.update(shared_with)
            for (pid, tid), (comm, _, _, _) in threads.items():
                if pid == rank.pid and tid != rank.pid:
                    entry = w.threads.setdefault(tid, [comm, 0])
                    entry[0] = comm  # a thread may name itself after it starts
                    entry[1] += deltas[(pid, tid)]
                elif pid != rank.pid:
                    name = rank.family.get(pid, "?")
                    if name == "worker":
                        w.worker_ticks += deltas[(pid, tid)]
                    else:
                        w.other_ticks[name] += deltas[(pid, tid)]
            w.workers_most = max(w.workers_most, members["worker"])
            w.others_most = max(w.others_most, members["other"])
        index = int((now - rank.first_seen) // SLICE_S)
        while len(rank.slices) <= index:
            rank.slices.append([0.0, 0, 0])
        rank.slices[index][0] += seconds
        rank.slices[index][1] += deltas[(rank.pid, rank.pid)]
        rank.slices[index][2] += nvcsw - before_nvcsw

    def summary(self) -> dict | None:
        """Stops the sampling; per rank (keyed by its local rank), over its samples after the
        first `skip_s` seconds of its life (`window`; the whole of it where it lived no longer):
        the main thread's (tid == pid) CPU affinity, CPU use in cores, involuntary context
        switches a second, share of the time it waited runnable for a CPU (schedstat), how many
        CPUs it ran on, the share of samples where a busy thread of the rank's family (above
        BUSY_CORES since the last sample) last ran on the main thread's CPU and which ones; the
        rank's other threads with the most CPU; its DataLoader workers' count (the most at
        once) and CPU, the same for its other descendants; and the main thread's CPU and
        involuntary switches per SLICE_S seconds of the whole run."""
        if self._thread is None:
            return None
        self.stop()
        ranks = {}
        for rank in sorted(self.ranks.values(), key=lambda r: (r.local_rank or 0, r.first_seen)):
            w = rank.steady if rank.steady.samples >= 2 else rank.whole
            if not w.samples:
                continue
            window = f"after {self.skip_s:g} s" if w is rank.steady else "whole (a short life)"

            def per_s(value: float, seconds: float = w.seconds) -> float | None:
                return round(value / seconds, 3) if seconds else None

            # threads that used no CPU in the window (most of them: NCCL's, the backends' pools)
            # would only fill the list
            top = sorted(w.threads.items(), key=lambda item: -item[1][1])[:TOP_THREADS]
            top = [(tid, (comm, ticks)) for tid, (comm, ticks) in top if ticks]
            row = {
                "pid": rank.pid,
                "local_rank_from": "LOCAL_RANK" if rank.local_rank is not None else "absent",
                "window": window,
                "window_s": round(w.seconds, 1),
                "samples": w.samples,
                "main_affinity": rank.affinity,
                "main_cpu_cores": per_s(w.main_ticks / HZ),
                "main_involuntary_per_s": per_s(w.main_nvcsw),
                "main_runqueue_wait_share": (
                    per_s(w.main_wait_ns / 1e9) if w.main_wait_ns is not None else None
                ),
                "main_cpus_ran_on": len(w.main_cpus),
                "main_cpus": cpu_ranges(w.main_cpus),
                "main_cpu_shared_share": round(w.shared / w.samples, 3),
                "main_cpu_shared_with": dict(w.shared_with.most_common(3)),
                "threads_top": [[comm, tid, per_s(ticks / HZ)] for tid, (comm, ticks) in top],
                "threads": len(w.threads),
                "workers": w.workers_most,
                "workers_cores": per_s(w.worker_ticks / HZ),
                "others": w.others_most,
                "others_cores": {
                    name: per_s(ticks / HZ) for name, ticks in w.other_ticks.most_common(3)
                },
                f"main_by_{SLICE_S:g}s": {
                    "cpu_cores": [per_s(t / HZ, s) for s, t, _ in rank.slices],
                    "involuntary_per_s": [per_s(n, s) for s, _, n in rank.slices],
                },
            }
            if rank.affinity_first != rank.affinity:  # dist.cpu_affinity pins a rank once started
                row["main_affinity_at_start"] = rank.affinity_first
            key = str(rank.local_rank or 0)
            ranks[key if key not in ranks else f"{key}_pid{rank.pid}"] = row
        summary = {
            "interval_s": self.interval_s,
            "samples": self.samples,
            "sampler_cpu_s": round(self.sampler_cpu_s, 2),
            "ranks": ranks,
        }
        if self.error:
            summary["error"] = self.error
        return summary
