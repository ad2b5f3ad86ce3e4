"""One run directory, one run, with real processes: a second launch on a directory in use stops
in one line while the first finishes untouched; workers end when their torchrun agent is killed,
and leave no lock behind; a fresh start sets an earlier run's TensorBoard event files aside."""

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, read_scalars, run_train, said_lines, train_command
from faults import first_sample_of_step

from mgpu.runtime.preempt import PREEMPTED_EXIT_CODE
from mgpu.runtime.run_lock import LOCK_FILE, RunDirInUse, acquire, release

BATCH = 32  # data.batch_size's default
SMALL = [  # gpt_tiny cut to one narrow layer, a loss per step, no DataLoader workers
    "model.vocab_size=256",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "trainer.log_every=1",
    "data.num_workers=0",
]
IN_USE = "is in use by another launch"


def output(proc) -> str:
    return proc.stdout + proc.stderr


def start_train(args: list[str], tmp: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """train.py on 2 processes under torchrun, started in a session (and process group) of its
    own and left running; its console goes to `tmp/<name>.out`."""
    command, env = train_command(args, nproc=2)
    out = tmp / f"{name}.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(
            command, cwd=tmp, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, out


def wait_for(done, proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            after_name = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(after_name[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Running, not merely a zombie that nobody has reaped yet."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state != "Z"


def test_a_second_launch_on_a_run_directory_in_use_stops_in_one_line(tmp_path):
    run_dir, paused, go = tmp_path / "run", tmp_path / "paused", tmp_path / "go"
    pause = [  # rank 0 holds the first launch at step 3 until the second has come and gone
        "data=custom",
        "data._target_=tests.faults.PausingTokens",
        "+data.kwargs.rank=0",
        f"+data.kwargs.at_sample={first_sample_of_step(3, BATCH)}",
        f"+data.kwargs.paused={paused}",
        f"+data.kwargs.go={go}",
        "+data.kwargs.eval_samples=64",
    ]
    common = [*SMALL, "trainer.max_steps=6", "trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    first, first_out = start_train([*common, *pause, "ckpt.every=2"], tmp_path, "first")
    try:
        wait_for(paused.exists, first, first_out)
        config = (run_dir / "config.yaml").read_text()
        workers = children(first.pid)
        # other settings, as a user who mistyped the run's name would give
        second = [*common, "optim.lr=0.01", "ckpt.every=3", "data.eval_samples=64"]
        second = run_train(second, cwd=tmp_path, timeout=120)
    finally:
        go.touch()
        first.wait(timeout=120)
    text = output(second)
    said = [line for line in said_lines(second) if IN_USE in line]
    assert second.returncode != 0 and len(said) == 1, text[-3000:]  # said once, by rank 0
    # the workers' exit code, in torchrun's report of them (torchrun's own is 1)
    assert re.search(r"exitcode\s*:\s*2 ", second.stderr), second.stderr[-3000:]
    holder = re.search(r"pid (\d+)", said[0])
    assert str(run_dir.resolve()) in said[0] and "hydra.run.dir=PATH" in said[0], said[0]
    assert holder and int(holder.group(1)) in workers, (said[0], workers)
    # no worker's traceback: torchrun's own report of the failed workers is the only one
    assert "RunDirInUse" not in text and text.count("Traceback") == text.count("ChildFailedError:")
    # nor a line of the second launch's in the first's rank logs (Hydra opened them for it)
    for log_file in ("rank0.log", "rank1.log"):
        assert IN_USE not in (run_dir / log_file).read_text(), log_file
    # The first launch, untouched: its settings, every checkpoint it saved, each step once.
    assert first.returncode == 0, first_out.read_text()[-3000:]
    assert (run_dir / "config.yaml").read_text() == config and "lr: 0.001" in config
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step-00000002", "step-00000004", "step-00000006"]
    assert [step for step, _ in read_scalars(run_dir)["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert "resumed from" not in first_out.read_text()


def still_alive(pids: list[int], seconds: float) -> list[int]:
    """Those of `pids` still running after up to `seconds` of waiting for all of them to end."""
    deadline = time.monotonic() + seconds
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def test_killing_the_agent_ends_its_workers_and_a_fresh_start_sets_old_events_aside(tmp_path):
    run_dir = tmp_path / "run"
    endless = [*SMALL, "trainer.max_steps=100000", "trainer.eval_every=2", "data.eval_samples=64"]
    endless.append("ckpt.every=0")  # nothing to resume from: the relaunch starts afresh
    agent, out = start_train([*endless, f"hydra.run.dir={run_dir}"], tmp_path, "killed")
    log = run_dir / "rank0.log"
    workers = []
    try:
        # an evaluation has flushed the first steps' points to the event file
        wait_for(lambda: log.exists() and "eval loss" in log.read_text(), agent, out)
        workers = children(agent.pid)
        assert len(workers) == 2, workers
        os.killpg(agent.pid, signal.SIGKILL)  # kill -9 of torchrun's process group
        agent.wait()
        assert not still_alive(workers, 15), "workers outlived their agent"
    finally:
        for pid in filter(alive, workers):
            os.kill(pid, signal.SIGKILL)
    before = read_scalars(run_dir)["train/loss"]
    assert before, "the killed run logged no point"
    # Relaunched in its directory: not refused (the killed run's lock went with it), and a
    # fresh start (nothing to resume) moves the killed run's event files aside.
    again = run_train(
        [*SMALL, "trainer.max_steps=3", "trainer.eval_every=0", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        nproc=None,
        timeout=120,
    )
    assert again.returncode == 0, output(again)[-3000:]
    (aside,) = run_dir.glob("earlier-*")
    assert "moved them into" in output(again) and aside.name in output(again)
    assert [step for step, _ in read_scalars(run_dir)["train/loss"]] == [1, 2, 3]
    assert read_scalars(aside)["train/loss"] == before
    # The killed run's goodput went with its events: the fresh start counts one attempt, not
    # the killed one's as its own restart.
    assert len(json.loads((aside / "goodput.json").read_text())["attempts"]) == 1
    assert len(json.loads((run_dir / "goodput.json").read_text())["attempts"]) == 1


def descendants(pid: int) -> list[int]:
    found = children(pid)
    for child in list(found):
        found += descendants(child)
    return found


def one_worker_endless(tmp: Path, nproc: int | None, *more: str) -> tuple[subprocess.Popen, Path]:
    """train.py (under torchrun for `nproc`) with one DataLoader worker a process (what
    data.num_workers=auto gives a process of 3 cores or fewer), training until stopped, in a
    session (and process group) of its own; returned once its third step is logged, with the
    file of its console."""
    args = [a for a in SMALL if not a.startswith("data.num_workers")] + ["data.num_workers=1"]
    args += ["trainer.max_steps=100000", "trainer.eval_every=0", "ckpt.every=0", *more]
    command, env = train_command([*args, f"hydra.run.dir={tmp / 'run'}"], nproc=nproc)
    out = tmp / "console.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(
            command, cwd=tmp, env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    log = tmp / "run" / "rank0.log"
    try:
        wait_for(lambda: log.exists() and "step 3/" in log.read_text(), proc, out)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, out


def test_a_preempted_run_with_a_worker_a_rank_saves_before_its_workers_go(tmp_path):
    """SIGTERM to torchrun, as a scheduler preempts a job: torchrun signals every process of
    each worker, the DataLoader's fork server and worker too. They leave it to the trainer: every
    rank saves the step they agree on and says so, not "DataLoader worker exited unexpectedly"
    with nothing saved (a fork server killed by the signal took its worker with it). Started
    with ckpt.resume=never, the line says to resume with ckpt.resume=auto instead: the same
    command would be refused by the checkpoint it just saved."""
    agent, out = one_worker_endless(tmp_path, 2, "ckpt.resume=never")
    try:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    said = out.read_text()
    assert "exited unexpectedly" not in said, said[-3000:]
    stopped = re.search(r"preempted \(SIGTERM\) after step (\d+): checkpoint saved", said)
    assert stopped, said[-3000:]
    step = int(stopped.group(1))
    assert (tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    for rank in (0, 1):
        log = (tmp_path / "run" / f"rank{rank}.log").read_text()
        said = f"after step {step}: checkpoint saved; exit code {PREEMPTED_EXIT_CODE}, run the "
        said += "same command with ckpt.resume=auto (in place of ckpt.resume=never) to resume"
        assert said in log, log[-2000:]


def test_a_killed_training_process_leaves_no_process_of_its_data_loader_behind(tmp_path):
    """kill -9 of the training process alone (as the OOM killer ends one): the processes it
    started for its DataLoader (the fork server, the workers, multiprocessing's resource tracker)
    end too, within seconds, instead of waiting on each other for good."""
    trainer, _ = one_worker_endless(tmp_path, nproc=None)
    left = []
    try:
        left = descendants(trainer.pid)
        assert len(left) >= 3, left  # the server, its worker, the tracker
        trainer.kill()
        trainer.wait()
        assert not still_alive(left, 20), "outlived their training process"
    finally:
        for pid in filter(alive, [trainer.pid, *left]):
            os.kill(pid, signal.SIGKILL)


def sleep_after(started) -> None:
    started.set()
    time.sleep(30)


def test_the_lock_names_its_holder_and_is_not_kept_by_forked_children(tmp_path):
    fd = acquire(tmp_path)
    try:
        with pytest.raises(RunDirInUse, match=rf"{IN_USE} \(rank 0 on host .*, pid {os.getpid()},"):
            acquire(tmp_path)  # another open file of it, as another process's would be
        # A child forked while the lock is held (a DataLoader worker) does not keep it.
        fork = multiprocessing.get_context("fork")
        started = fork.Event()
        child = fork.Process(target=sleep_after, args=(started,))
        child.start()
        assert started.wait(30)
    finally:
        release(fd)
    try:
        fd = acquire(tmp_path)
    finally:
        child.kill()
        child.join()
    # A restarted rank 0 waits, for a bounded time, for the attempt before it to let go.
    threading.Timer(0.5, release, args=(fd,)).start()
    release(acquire(tmp_path, wait_s=30))
    assert f"pid {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()  # stays, naming the last


# A rank 0 that takes the lock, then forks a child the way a DataLoader worker that hangs in
# CPython's post-fork code is left: through libc's fork, which runs none of Python's at-fork
# hooks. It prints the child's pid and waits to be killed; the child sleeps on as an orphan.
HOLDER_WITH_STUCK_CHILD = textwrap.dedent(
    """
    import ctypes, sys, time
    from mgpu.runtime.run_lock import acquire
    acquire(sys.argv[1])
    libc = ctypes.CDLL(None)
    child = libc.fork()
    if child == 0:
        libc.sleep(60)
        libc._exit(0)
    print(child, flush=True)
    time.sleep(60)
    """
)


def test_a_dead_holders_lock_frees_itself_though_its_forked_child_lives_on(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", HOLDER_WITH_STUCK_CHILD, str(tmp_path)]
    holder = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(RunDirInUse, match=rf"pid {holder.pid},"):
            acquire(tmp_path)  # held while its holder lives
        holder.kill()  # as the stall clock's os._exit or an OOM kill ends a rank 0
        holder.wait()
        assert alive(child)  # the orphan lives on, as the stuck worker did
        release(acquire(tmp_path))  # and does not keep the directory from a relaunch
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


# A parent that starts a worker calling end_with_agent (as under torchrun), prints its pid,
# and waits; the worker records how it is tied to its parent.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
    print(child.pid, flush=True)
    time.sleep(60)
    """
)
WORKER = textwrap.dedent(
    """
    import sys, time
    import mgpu.runtime.orphan as orphan
    mode, record = sys.argv[1], sys.argv[2]
    if mode == "parent watch":  # as where prctl is missing
        orphan._set_parent_death_signal = lambda: False
    else:  # the backstop too slow to matter
        orphan.CHECK_EVERY_S = 60.0
    with open(record, "w") as f:
        f.write(orphan.end_with_agent({"TORCHELASTIC_RUN_ID": "test"}))
    time.sleep(60)
    """
)


@pytest.mark.parametrize("mode", ["prctl", "parent watch"])
def test_a_worker_ends_when_its_parent_dies(tmp_path, mode):
    record = tmp_path / "how"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", PARENT, WORKER, mode, str(record)]
    parent = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while not (record.exists() and record.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record.read_text() == mode
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_refused_launch_closes_its_log_files_in_the_directory_only(tmp_path):
    """leave_logs_of: this process's log files inside the run directory are closed and
    removed, whether the directory or the file's path goes through a symbolic link; a log file
    elsewhere stays."""
    import logging

    from mgpu.runtime.run_lock import leave_logs_of

    real, link, elsewhere = tmp_path / "real", tmp_path / "link", tmp_path / "elsewhere"
    real.mkdir()
    elsewhere.mkdir()
    link.symlink_to(real)
    root = logging.getLogger()
    handlers = {
        "through the link": logging.FileHandler(link / "rank0.log"),
        "direct": logging.FileHandler(real / "rank1.log"),
        "elsewhere": logging.FileHandler(elsewhere / "other.log"),
    }
    for handler in handlers.values():
        root.addHandler(handler)
    try:
        leave_logs_of(real)
        kept = {name for name, handler in handlers.items() if handler in root.handlers}
        assert kept == {"elsewhere"}
        assert handlers["direct"].stream is None  # closed, not only detached
        root.addHandler(handlers["direct"])
        leave_logs_of(link)  # the run directory named through the link
        assert handlers["direct"] not in root.handlers
    finally:
        for handler in handlers.values():
            root.removeHandler(handler)
            handler.close()
