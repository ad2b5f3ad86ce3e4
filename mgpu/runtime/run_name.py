"""The run's name, `outputs/<name>`: the same on every rank and node of one launch and after a
restart, from the launch's identity (a rendezvous id, a SLURM job, the torchrun agent's start),
and whether the same command launched again gets it again."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from mgpu.runtime.launch import parse_launch_env


def _process_start_time(pid: int) -> float | None:
    """Wall-clock start of a process from /proc (Linux), or None where /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces and parentheses: fields resume after the last ')'.
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, StopIteration, IndexError):
        return None
    start_ticks = int(after_name[19])  # field 22 of proc(5), counted from field 3
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


# What torchrun makes up when no --rdzv-id is given on one node (--standalone, or a plain
# `torchrun --nproc_per_node=N`): fresh on every launch, so it names nothing a person chose.
_RANDOM_RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _slurm_run_name(env: Mapping[str, str]) -> str | None:
    """`slurm-<job>` (`slurm-<array job>_<task>` for an array task), or None outside SLURM.

    A requeued job keeps its job id, so it finds the directory it wrote before. The array form
    matches SLURM's own `%A_%a` naming of the job's output file.
    """
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task:
        return f"slurm-{env.get('SLURM_ARRAY_JOB_ID', job)}_{task}"
    return f"slurm-{job}"


def _safe_name(run_id: str) -> str:
    """A run id as one directory name: no path separators, no `..`, nothing hidden."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    return "_" + name[1:] if name.startswith(".") else name


def _agent_start_name() -> str:
    """`<date>/<time>` of the torchrun agent (this worker's parent), which all its workers share."""
    agent_start = _process_start_time(os.getppid())
    if agent_start is None:
        return time.strftime("%Y-%m-%d", time.localtime()) + f"/launch-{os.getppid()}"
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(agent_start))


@cache
def _process_clock_name() -> str:
    """`<date>/<time>` of this process, read once: a multirun's points then share one sweep dir,
    even where Hydra resolves the name again for each point and a second has passed."""
    return time.strftime("%Y-%m-%d/%H-%M-%S")


def launch_run_name(env: Mapping[str, str] | None = None) -> str:
    """`outputs/<this>`: the same string on every rank and node of one run, and after a restart.

    Each rank resolves the run directory on its own, so a clock read per process could split one
    run into several directories. The name comes from the run's identity instead, first match:
    1. a rendezvous id a person chose (`--rdzv-id=NAME`, the launch scripts' RUN_ID): NAME, on
       one node too, so re-running the same command resumes in the same directory;
    2. a SLURM job: `slurm-<jobid>`, unchanged when the job is requeued;
    3. several nodes sharing torchrun's random id: that id (their agents' clocks differ);
    4. one node: the torchrun agent's start time, which its workers share and which does not
       change when it restarts them; without torchrun, this process's start.
    Several nodes with no id at all (`--rdzv-id` left at "none") get each node's own time, which
    splits the run; `check_same_config` then stops it and says so.
    """
    env = os.environ if env is None else env
    launch = parse_launch_env(env)
    if _chosen(launch.run_id):
        return _safe_name(launch.run_id)
    slurm = _slurm_run_name(env)
    if slurm is not None:
        return slurm
    if launch.run_id != "none" and launch.num_nodes > 1:
        return launch.run_id
    if launch.under_torchrun:
        return _agent_start_name()
    return _process_clock_name()


def _chosen(run_id: str) -> bool:
    return run_id != "none" and not _RANDOM_RUN_ID.fullmatch(run_id)


def run_name_kept(env: Mapping[str, str] | None = None) -> bool:
    """Whether the same command launched again gets the same launch_run_name (1. and 2.)."""
    env = os.environ if env is None else env
    return _chosen(parse_launch_env(env).run_id) or _slurm_run_name(env) is not None


def resume_advice(run_dir: Path, ckpt_resume: str, env: Mapping[str, str] | None = None) -> str:
    """What to run to continue from the newest checkpoint of `run_dir` (for the lines of a
    preemption and a Ctrl-C): the same command where it comes back to this directory and
    resumes from it there (ckpt.resume=auto), else what to add to it. A directory named after
    the launch's start (plain torchrun, no RUN_ID, no SLURM job) is not found again; and under
    ckpt.resume=never or a path, the directory's own newer checkpoints refuse the same command."""
    add = []
    named = Path(run_dir).as_posix().endswith(f"/{launch_run_name(env)}")
    if named and not run_name_kept(env):
        add.append(f"hydra.run.dir={run_dir}")
    if ckpt_resume != "auto":
        add.append(f"ckpt.resume=auto (in place of ckpt.resume={ckpt_resume})")
    return f"run the same command{' with ' + ' '.join(add) if add else ''} to resume"
