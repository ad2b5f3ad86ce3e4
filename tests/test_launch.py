"""launch/ and the run's identity: the SLURM script under fake srun/scontrol, sweeps, what a
single-node launch listens on, the run name that every rank agrees on, and the start-up check
that all ranks resolved one config. Two torchrun agents acting as two nodes of one run are
launched in tests/test_two_nodes.py (its lost-node test checks what they share)."""

import ipaddress
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import FAST, ROOT, free_port, run_train, said_by_train_py, train_command
from faults import first_sample_of_step
from torch.distributed.run import parse_args

from mgpu.runtime.launch import (
    LaunchError,
    check_launch,
    check_sweep_launch,
    describe_config_mismatch,
    loopback_store,
    parse_launch_env,
)
from mgpu.runtime.run_name import launch_run_name, resume_advice

LAUNCH = ROOT / "launch"
FAKES = Path(__file__).resolve().parent / "fake_slurm"
# FAST, cut to two steps: these tests are about launching, not learning.
_CUT = {"trainer.max_steps": "2", "trainer.log_every": "1", "trainer.eval_every": "0"}
TINY = [o for o in FAST if o.split("=")[0] not in _CUT] + [f"{k}={v}" for k, v in _CUT.items()]
BATCH = 32  # data.batch_size's default
DATE_TIME = re.compile(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d")
UUID = "0b4f4bd5-7c5e-4d0a-9a4e-1f2d3c4b5a69"


def script_env(**extra: str) -> dict[str, str]:
    """The environment a user's shell gives the scripts: mgpu importable, one thread per rank."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    for key in ("RUN_ID", "NPROC", "NPROC_PER_NODE", "TORCHRUN_ARGS", "MAX_RESTARTS"):
        env.pop(key, None)
    env.update(extra)
    return env


# ---- the run name ----


def torchrun_env(run_id: str, nodes: int = 1, **extra: str) -> dict[str, str]:
    env = {"RANK": "0", "WORLD_SIZE": str(nodes), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    return {**env, "GROUP_WORLD_SIZE": str(nodes), "TORCHELASTIC_RUN_ID": run_id, **extra}


def test_a_chosen_rendezvous_id_names_the_run_on_one_node_too():
    assert launch_run_name(torchrun_env("gpt2-a")) == "gpt2-a"
    assert launch_run_name(torchrun_env("gpt2-a", nodes=2)) == "gpt2-a"
    # the same after torchrun restarted the workers: the name does not follow the attempt
    assert launch_run_name(torchrun_env("gpt2-a", TORCHELASTIC_RESTART_COUNT="3")) == "gpt2-a"
    # it becomes one directory name whatever the user typed
    assert launch_run_name(torchrun_env("../a/b c")) == "_._a_b_c"


def test_the_advice_to_resume_adds_to_the_command_what_it_lacks_to_come_back_and_resume():
    same = "run the same command to resume"
    for env in (torchrun_env("gpt2-a"), {"SLURM_JOB_ID": "4242"}):  # named again alike
        assert resume_advice(Path("/w/outputs") / launch_run_name(env), "auto", env) == same
    # a plain torchrun's directory is named after its start: the next launch's differs
    plain = torchrun_env(UUID)
    run_dir = Path("/w/outputs") / launch_run_name(plain)
    said = f"run the same command with hydra.run.dir={run_dir} to resume"
    assert resume_advice(run_dir, "auto", plain) == said
    assert resume_advice(Path("/w/mine"), "auto", plain) == same  # hydra.run.dir given
    # another run's checkpoint, or none: the directory's own newer ones refuse that again
    for given in ("/w/base/checkpoints/step-00000030", "never"):
        said = f"run the same command with ckpt.resume=auto (in place of ckpt.resume={given})"
        assert resume_advice(Path("/w/mine"), given, plain) == f"{said} to resume"


def test_slurm_job_names_the_run_unless_a_rendezvous_id_was_chosen():
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    assert launch_run_name(slurm) == "slurm-4242"  # plain python inside a job
    assert launch_run_name(torchrun_env(UUID, **slurm)) == "slurm-4242"  # --standalone
    assert launch_run_name(torchrun_env("none", nodes=2, **slurm)) == "slurm-4242"
    array = {**slurm, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}
    assert launch_run_name(torchrun_env(UUID, **array)) == "slurm-4240_2"
    assert launch_run_name(torchrun_env("mine", **slurm)) == "mine"


def test_without_an_id_one_node_is_named_by_its_launch_time():
    # torchrun's made-up id on one node names nothing; its agent's start time does
    assert DATE_TIME.fullmatch(launch_run_name(torchrun_env(UUID)))
    assert DATE_TIME.fullmatch(launch_run_name(torchrun_env("none")))
    # several nodes share torchrun's id, but not their agents' clocks
    assert launch_run_name(torchrun_env(UUID, nodes=2)) == UUID
    # plain python: read once, so a multirun's points agree on their sweep directory
    assert DATE_TIME.fullmatch(launch_run_name({}))
    assert launch_run_name({}) == launch_run_name({})


def test_multirun_is_refused_under_torchrun_with_several_processes():
    two = parse_launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    with pytest.raises(LaunchError, match="launch/sweep.sh"):
        check_sweep_launch(multirun=True, env=two)
    check_sweep_launch(multirun=False, env=two)
    check_sweep_launch(multirun=True, env=parse_launch_env({}))
    check_sweep_launch(multirun=True, env=parse_launch_env({"RANK": "0", "WORLD_SIZE": "1"}))


def test_ranks_without_the_stores_address_are_refused_naming_what_is_missing():
    """A launch of its own that sets RANK and WORLD_SIZE but not MASTER_ADDR (or MASTER_PORT)
    is one line naming them and the fix, before any work (it was a KeyError)."""
    two = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}
    with pytest.raises(LaunchError) as refused:
        check_launch("auto", parse_launch_env(two))
    assert "but MASTER_ADDR not: start the processes with torchrun" in str(refused.value)
    check_launch("auto", parse_launch_env({**two, "MASTER_ADDR": "127.0.0.1"}))
    check_launch("auto", parse_launch_env({}))  # python train.py: a world of one


def test_more_cpu_processes_than_cores_is_said_once_a_node(caplog):
    """On CPUs (CUDA hidden, as in the suite), a node's processes beyond its cores: rank 0 of
    the node says so and names the count that gives each a core; nothing stops."""
    cores = len(os.sched_getaffinity(0))
    many = {"RANK": "0", "WORLD_SIZE": str(cores + 1), "LOCAL_RANK": "0"}
    many |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # as torchrun sets them
    with caplog.at_level(logging.WARNING, logger="mgpu.runtime.launch"):
        assert check_launch("auto", parse_launch_env(many)) == "gloo"
        check_launch("auto", parse_launch_env({**many, "RANK": "1", "LOCAL_RANK": "1"}))
        check_launch("auto", parse_launch_env({**many, "WORLD_SIZE": str(cores)}))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith(f"{cores + 1} processes on this node share its {cores} CPU cores")
    assert said[0].endswith(f"torchrun --nproc_per_node={cores} gives each a core"), said[0]


def test_a_config_mismatch_names_the_ranks_and_the_first_key_that_differs():
    base = "trainer:\n  seed: 0\n  max_steps: 2\noptim:\n  betas:\n  - 0.9\n  - 0.95\n"
    seed = base.replace("seed: 0", "seed: 1")
    betas = base.replace("0.95", "0.99")
    assert describe_config_mismatch([base, base]) == ""
    msg = describe_config_mismatch([base, seed, base, seed])
    assert "(ranks that differ from rank 0: 1, 3)" in msg
    assert "rank 1 has 'trainer.seed: 1' where rank 0 has 'trainer.seed: 0'" in msg
    msg = describe_config_mismatch([base, betas])
    assert "'optim.betas.- 0.99' where rank 0 has 'optim.betas.- 0.95'" in msg


# ---- the scripts' command lines (a fake PYTHON records them) ----


def recorded(log: Path, program: str) -> list[list[str]]:
    """The argument lists a fake program recorded, one per call."""
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    return [c[1:] for c in calls if c and c[0] == program]


def torchrun_args(argv: list[str]):
    """torchrun's own parse of `python launch/torchrun.py ARGS`: the flags must be real."""
    assert argv[0] == str(LAUNCH / "torchrun.py"), argv
    return parse_args(argv[1:])


def srun_torchrun(srun: list[str]) -> tuple[list[str], object]:
    """srun's own options, and torchrun's parse of the command srun was given."""
    cmd = srun.index(str(FAKES / "fake-python"))
    return srun[:cmd], torchrun_args(srun[cmd + 1 :])


def run_script(script: str, tmp_path: Path, *args: str, **env: str):
    log = tmp_path / "calls.log"
    full_env = script_env(FAKE_SLURM_LOG=str(log), PYTHON=str(FAKES / "fake-python"), **env)
    proc = subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc, log


def test_single_node_names_its_rendezvous_after_run_id(tmp_path):
    proc, log = run_script("single_node.sh", tmp_path, "optim.lr=1e-3", NPROC="3", RUN_ID="a1")
    assert proc.returncode == 0, proc.stderr
    args = torchrun_args(recorded(log, "python")[0])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_id) == ("1", "3", "a1")
    assert (args.rdzv_backend, args.max_restarts) == ("c10d", 0)
    assert args.training_script == str(ROOT / "train.py")
    assert args.training_script_args == ["optim.lr=1e-3"]
    proc, log = run_script("single_node.sh", tmp_path, NPROC="2", MAX_RESTARTS="2")
    args = torchrun_args(recorded(log, "python")[-1])
    # no id: torchrun's "none", and the run is named after its launch time
    assert args.rdzv_id == "none" and args.max_restarts == 2
    proc, _ = run_script("single_node.sh", tmp_path, NPROC="2", RUN_ID="a/b")
    assert proc.returncode == 2 and "RUN_ID='a/b'" in proc.stderr


@pytest.mark.parametrize(
    "script, env, said",
    [
        ("single_node.sh", {"NPROC": "0"}, "NPROC='0': give a whole number of at least 1"),
        ("single_node.sh", {"NPROC": "two"}, "NPROC='two': give a whole number"),
        ("single_node.sh", {"NPROC": "2", "MAX_RESTARTS": "-1"}, "MAX_RESTARTS='-1': give"),
        ("multi_node.sh", {"NNODES": "two"}, "NNODES='two': give a number of nodes"),
        ("multi_node.sh", {"NNODES": "2", "NPROC_PER_NODE": "0"}, "NPROC_PER_NODE='0': give"),
        # torchrun's AssertionError, and its ValueError for the port, before these
        ("multi_node.sh", {"NNODES": "2:1"}, "NNODES='2:1': a range is MIN:MAX with MIN <= MAX"),
        (
            "multi_node.sh",
            {"NNODES": "2", "RDZV_ENDPOINT": "node0:abc"},
            "RDZV_ENDPOINT='node0:abc'",
        ),
        ("multi_node.sh", {"NNODES": "2", "RDZV_ENDPOINT": "node0:0"}, "RDZV_ENDPOINT='node0:0'"),
        ("multi_node.sh", {"NNODES": "2", "RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT='node0'"),
    ],
)
def test_a_count_that_cannot_work_is_one_line_from_the_launch_script(tmp_path, script, env, said):
    env = {"RDZV_ENDPOINT": "127.0.0.1:29400", "RUN_ID": "a", **env}
    proc, log = run_script(script, tmp_path, **env)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{script}: {said}"), line
    assert not log.exists()  # torchrun never started


def test_single_node_keeps_its_rendezvous_in_a_private_file_that_it_leaves_behind(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    extra = "--rdzv-conf=join_timeout=900 --log-dir=logs --rdzv_conf read_timeout=5"
    proc, log = run_script(
        "single_node.sh", tmp_path, NPROC="2", TMPDIR=str(tmp), TORCHRUN_ARGS=extra
    )
    assert proc.returncode == 0, proc.stderr
    args = torchrun_args(recorded(log, "python")[0])
    # the state lives in a file, held open by torchrun alone, not in a store that listens
    assert re.fullmatch(r"/proc/\d+/fd/\d+", args.rdzv_endpoint), args.rdzv_endpoint
    assert not list(tmp.iterdir())  # removed as soon as it was open
    # the user's rendezvous settings are kept, the file store added to them
    assert args.rdzv_conf == "join_timeout=900,read_timeout=5,store_type=file"
    assert args.log_dir == "logs"
    # the workers' MASTER_ADDR, which mgpu keeps their own sockets on
    assert args.local_addr == "127.0.0.1"


def test_multi_node_takes_an_elastic_range_and_needs_its_identity(tmp_path):
    need = {"NNODES": "2:4", "RDZV_ENDPOINT": "node0:29400", "RUN_ID": "big", "NPROC_PER_NODE": "8"}
    proc, log = run_script("multi_node.sh", tmp_path, "model=mlp", **need)
    assert proc.returncode == 0, proc.stderr
    args = torchrun_args(recorded(log, "python")[0])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2:4", "8", "c10d")
    assert (args.rdzv_endpoint, args.rdzv_id) == ("node0:29400", "big")
    assert args.training_script_args == ["model=mlp"]
    for missing in ("NNODES", "RDZV_ENDPOINT", "RUN_ID"):
        env = {k: v for k, v in need.items() if k != missing}
        proc, _ = run_script("multi_node.sh", tmp_path, **env)
        assert proc.returncode == 2 and f"set {missing}" in proc.stderr


# ---- SLURM, under fake srun and scontrol ----

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_SUBMIT_DIR": str(ROOT),
    "FAKE_NODES": "gpu07 gpu08",
}


@pytest.fixture
def fake_slurm(tmp_path):
    """fake srun and scontrol first on PATH; copied so that they run whatever their file mode."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        shutil.copy(FAKES / name, bin_dir / name)
        (bin_dir / name).chmod(0o755)
    return {**SLURM, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_slurm_runs_one_torchrun_per_node_with_the_jobs_identity(tmp_path, fake_slurm):
    proc, log = run_script("slurm.sbatch", tmp_path, "model=mlp", "data=images", **fake_slurm)
    assert proc.returncode == 0, proc.stderr
    assert recorded(log, "scontrol") == [["show", "hostnames", "gpu[07-08]"]]  # no requeue
    (srun,) = recorded(log, "srun")
    srun_options, args = srun_torchrun(srun)
    assert set(srun_options) == {"--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"}
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "4", "c10d")
    assert args.rdzv_endpoint == f"gpu07:{slurm_port(4242)}"  # the allocation's first node
    assert args.training_script == str(ROOT / "train.py")
    assert args.training_script_args == ["model=mlp", "data=images"]
    # every worker, on any node and after a requeue, names the run directory the same way
    worker = torchrun_env(args.rdzv_id, nodes=2, **SLURM)
    assert args.rdzv_id == launch_run_name(worker) == "slurm-4242"

    array = {**fake_slurm, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}
    proc, log = run_script("slurm.sbatch", tmp_path, **array)
    _, args = srun_torchrun(recorded(log, "srun")[-1])
    assert args.rdzv_id == launch_run_name(torchrun_env(UUID, **array)) == "slurm-4240_2"
    # an array task without its array's job id: the job's own, as run_name.py names it
    del array["SLURM_ARRAY_JOB_ID"]
    proc, log = run_script("slurm.sbatch", tmp_path, **array)
    assert proc.returncode == 0, proc.stderr
    _, args = srun_torchrun(recorded(log, "srun")[-1])
    assert args.rdzv_id == launch_run_name(torchrun_env(UUID, **array)) == "slurm-4242_2"


def slurm_port(job: int) -> int:
    """The rendezvous port slurm.sbatch derives from a job id (where nothing listens on it)."""
    return 20000 + job % 9000


@pytest.mark.parametrize(
    "missing", ["SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_SUBMIT_DIR"]
)
def test_slurm_without_what_sbatch_sets_says_so_in_one_line(tmp_path, fake_slurm, missing):
    env = {k: v for k, v in fake_slurm.items() if k != missing}
    proc, log = run_script("slurm.sbatch", tmp_path, **env)
    assert proc.returncode == 2, proc.stderr  # bash's own "unbound variable" exits 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"slurm.sbatch: {missing} is not set: submit it with sbatch"), line
    assert not (log.exists() and recorded(log, "srun"))


def slurm_endpoint(tmp_path, fake_slurm, **env: str) -> tuple[str, int]:
    proc, log = run_script("slurm.sbatch", tmp_path, **{**fake_slurm, **env})
    assert proc.returncode == 0, proc.stderr
    host, port = srun_torchrun(recorded(log, "srun")[-1])[1].rdzv_endpoint.rsplit(":", 1)
    return host, int(port)


def listening_on_a_port_of(jobs: range) -> tuple[socket.socket, int]:
    """A socket listening, as a store would, on the port of the first of `jobs` whose port is
    free here, and that job's id."""
    for job in jobs:
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", slurm_port(job)))
        except OSError:
            held.close()
            continue
        held.listen()
        return held, job
    raise AssertionError(f"no free port for jobs {jobs}")


def test_slurm_jobs_on_one_first_node_get_ports_of_their_own(tmp_path, fake_slurm):
    """Jobs whose ids differ by a multiple of 1000 shared a port (29400 + id % 1000): the second
    joined the first's rendezvous. Ports stay clear of torch's 29400 and 29500 and of the
    kernel's for outgoing connections; one that something listens on is passed over."""
    ports = [slurm_endpoint(tmp_path, fake_slurm, SLURM_JOB_ID=str(j))[1] for j in (4242, 5242)]
    assert ports[0] != ports[1], ports
    assert all(20000 <= p < 29000 for p in ports), ports
    held, job = listening_on_a_port_of(range(90_000, 99_000))
    with held:
        taken = held.getsockname()[1]
        host, port = slurm_endpoint(tmp_path, fake_slurm, SLURM_JOB_ID=str(job))
        assert host == "gpu07" and port != taken and 20000 <= port < 29000
        # one the user chose is theirs to change: one line, nothing started
        proc, log = run_script("slurm.sbatch", tmp_path, RDZV_PORT=str(taken), **fake_slurm)
        (line,) = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and f"RDZV_PORT={taken}: something on " in line, line
        assert len(recorded(log, "srun")) == 3  # the 3 launches above, not this one
    proc, _ = run_script("slurm.sbatch", tmp_path, RDZV_PORT="abc", **fake_slurm)
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and line.startswith("slurm.sbatch: RDZV_PORT='abc': give a port")


def test_slurm_without_gpus_asks_for_them(tmp_path, fake_slurm):
    no_gpus = {k: v for k, v in fake_slurm.items() if k != "SLURM_GPUS_ON_NODE"}
    proc, _ = run_script("slurm.sbatch", tmp_path, **no_gpus)
    assert proc.returncode == 2 and "--gpus-per-node" in proc.stderr
    proc, log = run_script("slurm.sbatch", tmp_path, NPROC_PER_NODE="2", **no_gpus)
    assert srun_torchrun(recorded(log, "srun")[0])[1].nproc_per_node == "2"


@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_slurm_signal_stops_the_step_and_requeues_only_near_the_time_limit(
    tmp_path, fake_slurm, sig, requeued
):
    log = tmp_path / "calls.log"
    env = script_env(
        FAKE_SLURM_LOG=str(log), FAKE_SRUN="sleep", PYTHON=str(FAKES / "fake-python"), **fake_slurm
    )
    with open(tmp_path / "batch.err", "w") as err:
        batch = subprocess.Popen(
            ["bash", str(LAUNCH / "slurm.sbatch")], cwd=tmp_path, env=env, stderr=err
        )
    try:
        deadline = time.monotonic() + 120  # a bound on a hang, generous for a loaded machine
        while not (log.exists() and recorded(log, "srun")):  # the step is running
            assert batch.poll() is None and time.monotonic() < deadline, "srun never started"
            time.sleep(0.05)
        batch.send_signal(sig)
        batch.wait(timeout=120)
    finally:
        batch.kill()
    assert "srun got TERM" in log.read_text()  # forwarded to the step, which stopped
    requeues = [c for c in recorded(log, "scontrol") if c[0] == "requeue"]
    assert requeues == ([["requeue", "4242"]] if requeued else [])
    assert batch.returncode == 143  # the step's own status: killed by SIGTERM


# ---- how a failed launch ends ----


def test_a_failed_launch_ends_in_the_workers_one_line_and_exit_code(tmp_path):
    env = script_env(NPROC="2")
    del env["OMP_NUM_THREADS"]  # as in a user's shell: torchrun would print its banner
    proc = subprocess.run(
        ["bash", str(LAUNCH / "single_node.sh"), "optim.lrr=1e-3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = (proc.stdout + proc.stderr).strip().splitlines()
    line = "mgpu: config error: optim.lrr='1e-3': is not a key of optim; did you mean optim.lr="
    # once, and nothing of torchrun's around it: no banner, log lines, traceback or table
    assert len(said) == 1 and said[0].startswith(line), proc.stdout + proc.stderr
    assert proc.returncode == 2  # the worker's code, not torchrun's 1
    assert not (tmp_path / "outputs").exists()


WORKERS = {
    # a traceback, and exit code 1, once both ranks are up (as near together as they can)
    "crash": "import os, pathlib, time\n"
    "pathlib.Path(f\"up{os.environ['RANK']}\").touch()\n"
    "while not all(pathlib.Path(f'up{r}').exists() for r in (0, 1)):\n"
    "    time.sleep(0.01)\n"
    "raise RuntimeError('boom')",
    "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
}


@pytest.mark.parametrize(
    "worker, last, code",
    [("crash", "exited with code 1; its output above says why", 1), ("killed", "SIGKILL", 137)],
)
def test_a_worker_that_leaves_no_line_is_named_last_with_its_exit_code(
    tmp_path, worker, last, code
):
    script = tmp_path / "worker.py"
    script.write_text(WORKERS[worker] + "\n")
    proc = subprocess.run(
        [sys.executable, str(LAUNCH / "torchrun.py"), "--standalone", "--nproc-per-node=2"]
        + [str(script)],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("launch: rank ") and lines[-1].endswith(last), proc.stderr
    assert "ChildFailedError" not in proc.stderr and proc.returncode == code, proc.stderr
    if worker == "crash":  # the worker's own traceback stays, said once
        # once per rank that printed it: torchrun stops the other rank as soon as it sees the
        # first exit, which can come before the other's traceback (seen once in a suite run)
        assert 1 <= proc.stderr.count("RuntimeError: boom") <= 2, proc.stderr


def test_a_launch_on_a_port_in_use_names_the_fix_in_one_line(tmp_path):
    """Two torchrun launches with one --master-port (static rendezvous) on one machine: the
    second cannot listen there (EADDRINUSE). A listening socket stands for the first."""
    with socket.socket() as first:
        first.bind(("127.0.0.1", 0))
        first.listen()
        port = first.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, str(LAUNCH / "torchrun.py"), f"--master-port={port}"]
            + ["--nproc-per-node=2", str(ROOT / "train.py"), *TINY],
            cwd=tmp_path,
            env=script_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(said) == 1 and f"port {port} is in use" in said[0], proc.stderr
    assert "--master-port=PORT" in said[0] and "--standalone" in said[0], said[0]
    assert proc.returncode == 1 and not (tmp_path / "outputs").exists()


def rdzv_launch(tmp_path, port: int, *flags: str) -> subprocess.CompletedProcess:
    """launch/torchrun.py with the c10d rendezvous at 127.0.0.1:port, as the scripts run it."""
    script = tmp_path / "worker.py"
    script.write_text("pass\n")
    return subprocess.run(
        [sys.executable, str(LAUNCH / "torchrun.py"), "--nproc-per-node=1", "--rdzv-backend=c10d"]
        + [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=r", *flags, str(script)],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_rendezvous_on_a_port_in_use_names_the_endpoint_in_one_line(tmp_path):
    """The c10d rendezvous wraps EADDRINUSE in its RendezvousConnectionError. The node that
    hosts the store (is_host=1, as tests/test_two_nodes.py gives node 0) cannot listen there."""
    with socket.socket() as first:
        first.bind(("127.0.0.1", 0))
        first.listen()
        port = first.getsockname()[1]
        proc = rdzv_launch(tmp_path, port, "--nnodes=1", "--rdzv-conf=is_host=1")
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(said) == 1, proc.stderr
    assert f"rendezvous endpoint 127.0.0.1:{port} is in use" in said[0], said[0]
    assert "RDZV_ENDPOINT=HOST:PORT" in said[0] and proc.returncode == 1


def launched(tmp_path, worker: str, *flags: str, timeout: float = 60):
    """launch/torchrun.py with one worker running the Python `worker`, and `flags`."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    command = [sys.executable, str(LAUNCH / "torchrun.py"), "--nproc-per-node=1", *flags]
    return subprocess.run(
        [*command, str(script)], cwd=tmp_path, env=script_env(), capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def test_a_rendezvous_host_that_does_not_resolve_is_said_at_once(tmp_path):
    """A misspelt RDZV_ENDPOINT host: one line naming it, at once, where the agent waited out
    read_timeout (60 s) and advised starting the node at that address first."""
    flags = ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=nosuchhost.invalid:29412"]
    proc = launched(tmp_path, "pass\n", *flags, timeout=30)
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(said) == 1 and proc.returncode == 2, proc.stderr
    assert said[0].startswith("launch: the rendezvous endpoint nosuchhost.invalid:29412: its ")
    assert "host 'nosuchhost.invalid' does not resolve" in said[0], said[0]


def test_a_failed_worker_whose_output_went_to_files_is_pointed_at_them(tmp_path):
    """--redirects sends a worker's output to torchrun's files: the launch's one line names
    their folder, where it said "its output above" with nothing above it."""
    worker = "import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n"
    proc = launched(tmp_path, worker, "--standalone", "--redirects=3", "--log-dir=logs")
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(said) == 1 and proc.returncode == 3, proc.stderr
    (logs,) = (tmp_path / "logs").glob("*/attempt_0/0")
    assert (logs / "stderr.log").read_text() == "boom\n"
    where = logs.relative_to(tmp_path)
    assert said[0].endswith(f"exited with code 3; its output, in {where}, says why"), said[0]


def test_a_rendezvous_that_never_gathers_its_nodes_says_so_in_one_line(tmp_path):
    """One node of two: it says that it waits, then, at its join timeout, what it waited for."""
    port = free_port()
    proc = rdzv_launch(tmp_path, port, "--nnodes=2:3", "--rdzv-conf=join_timeout=2")
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(said) == 2, proc.stderr
    endpoint = f"127.0.0.1:{port}"
    assert said[0].startswith(f"launch: waiting for 2 to 3 nodes at {endpoint} (for up to 2 s")
    assert said[1].startswith(f"launch: fewer than 2 nodes joined the rendezvous at {endpoint}")
    assert "within 2 s" in said[1] and "join_timeout=SECONDS" in said[1]
    assert proc.returncode == 1


def test_a_node_that_never_reaches_the_rendezvous_says_so_in_one_line(tmp_path):
    """A node whose endpoint never answers (the node hosting it not started, a wrong address, a
    closed port) says how long it waits for the endpoint, then, at the c10d rendezvous's read
    timeout, the endpoint, that time and the fixes, exit 1: not torch's traceback and C++
    stack, after a waiting line that promised only the nodes' join timeout."""
    port = free_port()  # nothing listens there
    proc = rdzv_launch(tmp_path, port, "--nnodes=2", "--rdzv-conf=is_host=0,read_timeout=2")
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(said) == 2 and proc.returncode == 1, proc.stderr[-3000:]
    assert said[0].endswith("; the endpoint must answer within 2 s (read_timeout)"), said[0]
    endpoint = f"127.0.0.1:{port}"
    assert said[1].startswith(f"launch: nothing answered at the rendezvous endpoint {endpoint}")
    assert "within 2 s" in said[1] and "--rdzv-conf=read_timeout=SECONDS" in said[1], said[1]


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the command name may hold spaces and parentheses: fields resume after the last ')'
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # not a process, or one that has just exited
        parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets a process holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (listdir's own descriptor, for one)
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket those processes hold open."""
    found = []
    for pid in pids:
        try:
            inodes = socket_inodes(pid)
            tables = {n: Path(f"/proc/{pid}/net/{n}").read_text() for n in ("tcp", "tcp6")}
        except OSError:
            continue  # exited meanwhile
        for table, text in tables.items():
            for fields in (line.split() for line in text.splitlines()[1:]):
                if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: TCP_LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                # /proc prints the address as 32-bit words in host (little-endian) order
                words = range(0, len(hex_addr), 8)
                raw = b"".join(int(hex_addr[i : i + 8], 16).to_bytes(4, "little") for i in words)
                family = socket.AF_INET if table == "tcp" else socket.AF_INET6
                found.append((pid, socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def default_route_interface() -> str | None:
    """The interface of this machine's default route (a LAN one), or None."""
    try:
        rows = [line.split() for line in Path("/proc/net/route").read_text().splitlines()[1:]]
    except OSError:
        return None
    return next((row[0] for row in rows if len(row) > 1 and row[1] == "00000000"), None)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One launch/sweep.sh of two points, each a launch/single_node.sh of 2 processes (the most
    costly thing this file starts: a torchrun agent and two training processes a point), which
    three tests read: the sweep's points, what a running single-node launch listens on, and the
    CPU blocks dist.cpu_affinity gave its workers. Point 0's rank 0 holds its second step
    (tests.faults.PausingTokens) while its process tree's sockets are read, then the sweep
    goes on; point 1 finds the go file there already and does not wait."""
    tmp = tmp_path_factory.mktemp("sweep")
    paused, go = tmp / "paused", tmp / "go"
    env = script_env(NPROC="2", SWEEP_DIR="sweeps/seeds")
    lan = default_route_interface()
    if lan is not None:
        # What a cluster's environment may set for its multi-node runs; gloo would then listen
        # there, as it does on the address of the host's name when nothing is set.
        env.update(GLOO_SOCKET_IFNAME=lan, NCCL_SOCKET_IFNAME=lan)
    pause = [  # step 1 logged: every rank has joined the process group and run collectives
        "data=custom",
        "data._target_=tests.faults.PausingTokens",
        "model.vocab_size=256",  # NgramTokens' own, which data=ngram would give the model
        "+data.kwargs.rank=0",
        f"+data.kwargs.at_sample={first_sample_of_step(2, BATCH)}",
        f"+data.kwargs.paused={paused}",
        f"+data.kwargs.go={go}",
        "+data.kwargs.eval_samples=64",
    ]
    overrides = [o for o in TINY if not o.startswith("data.eval_samples=")] + pause
    if len(os.sched_getaffinity(0)) >= 2:  # a block of at least one CPU for each of 2 workers
        overrides.append("dist.cpu_affinity=true")
    log = tmp / "sweep.log"
    with open(log, "w") as out:
        launch = subprocess.Popen(
            ["bash", str(LAUNCH / "sweep.sh"), *overrides, "trainer.seed=1,2"],
            cwd=tmp,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120  # a bound on a hang, generous for a loaded machine
        while not paused.exists():
            assert launch.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "point 0 never reached its second step"
            time.sleep(0.2)
        tree = process_tree(launch.pid)  # sweep.sh, then point 0's torchrun and its workers
        listening = listening_sockets(tree)
        (agent,) = [p for p in tree if "launch/torchrun.py" in cmdline(p)]
        workers = [p for p in process_tree(agent)[1:] if "train.py" in cmdline(p)]
        master_port = next(
            line.split("=", 1)[1]
            for line in Path(f"/proc/{workers[0]}/environ").read_text().split("\0")
            if line.startswith("MASTER_PORT=")
        )
        go.touch()
        launch.wait(timeout=180)
    finally:
        go.touch()
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
    return SimpleNamespace(
        returncode=launch.returncode,
        output=log.read_text(),
        dir=tmp / "sweeps" / "seeds",
        listening=listening,
        workers=workers,
        master_port=int(master_port),
    )


def cmdline(pid: int) -> str:
    """A process's command line, or "" for one that has just exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def test_a_single_node_run_listens_on_loopback_only(sweep):
    listening = sweep.listening
    assert len(sweep.workers) == 2
    # the sockets looked at are the run's: rank 0's store and each worker's gloo listener
    assert sweep.master_port in {port for _, _, port in listening}, listening
    assert set(sweep.workers) <= {pid for pid, _, _ in listening}, listening
    exposed = [s for s in listening if not ipaddress.ip_address(s[1]).is_loopback]
    assert not exposed, f"listening beyond loopback (pid, address, port): {exposed}"


def test_only_a_loopback_master_addr_keeps_the_store_on_loopback(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    one = parse_launch_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    for host in ("node0", "10.0.0.5", "localhost"):  # names may stand for any interface
        monkeypatch.setenv("MASTER_ADDR", host)
        assert loopback_store(one, 10) is None
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    shared = parse_launch_env(
        {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    )
    assert loopback_store(shared, 10) is None  # the agent's store: not the worker's to bind
    assert loopback_store(parse_launch_env({}), 10) is None  # no torchrun, no process group
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # restored after the test
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    kept = loopback_store(one, 10)
    port = int(os.environ["MASTER_PORT"])
    assert ("127.0.0.1", port) in {(a, p) for _, a, p in listening_sockets([os.getpid()])}
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("lo", "=lo")
    kept.set("k", "v")
    assert kept.get("k") == b"v"


def test_ranks_that_resolve_different_configs_stop_with_one_clear_line(tmp_path):
    # A run directory that differs per rank: check_same_config appends it to the config text
    # and compares the whole, so a key of the config that differs per rank (trainer.seed=
    # ${oc.env:LOCAL_RANK}) takes the very same path, its line the one describe_config_mismatch
    # gives above.
    per_rank = "hydra.run.dir=split${oc.env:LOCAL_RANK}"
    first_difference = "'run_dir: split1' where rank 0 has 'run_dir: split0'"
    proc = run_train([*TINY, per_rank], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    said = proc.stdout.count(f"rank 1 has {first_difference}")
    assert said == 1, proc.stdout[-3000:]  # rank 0, for every rank
    assert "failed (exitcode: 2)" in proc.stderr, proc.stderr[-3000:]  # a config error's code
    assert not list(tmp_path.glob("**/events.out.tfevents.*"))  # stopped before any work


def test_multirun_under_torchrun_stops_before_any_work(tmp_path):
    # One process given the variables torchrun gives rank 0 of 2: the refusal reads only them,
    # at Hydra's multirun start, before any process group; its exit (one line, exit code 2)
    # is the one a config error has, launched under torchrun in test_one_line.py.
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    world |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = run_train(["-m", *TINY, "trainer.seed=1,2"], cwd=tmp_path, nproc=None, env=world)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "hydra -m (multirun) cannot run under torchrun with 2 processes" in proc.stderr
    assert "launch/sweep.sh" in proc.stderr
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


def test_multirun_in_a_world_of_one_runs_each_point(tmp_path):
    proc = run_train(["-m", *TINY, "trainer.seed=1,2"], cwd=tmp_path, nproc=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "multirun").glob("*/*")
    for n, seed in enumerate((1, 2)):
        assert f"seed: {seed}\n" in (sweep_dir / str(n) / "config.yaml").read_text()


def test_a_sweep_is_checked_point_by_point_before_its_first_point_trains(tmp_path):
    """`-m` with a bad value in a later point, a typo'd key or group: mgpu's one line (the
    typo's closest key), exit 2, before any point ran or any sweep directory exists (Hydra
    alone met the bad value after point 0 trained, and said a typo in several lines)."""
    for args, words in (
        (["trainer.seed=1,2", "optim.lr=1e-3,-1"], "optim.lr=-1.0: must be > 0"),
        (["optim.lrr=1e-3,3e-4"], "is not a key of optim; did you mean optim.lr=0.001?"),
        (["model=gpt2,gpt_tiny"], "model='gpt2': is not a model config; did you mean"),
    ):
        assert words in said_by_train_py(["-m", *args], tmp_path)
    proc = run_train(["-m", *TINY, "optim.lr=1e-3,-1"], cwd=tmp_path, nproc=None)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = "mgpu: config error: optim.lr=-1.0: must be > 0, e.g. optim.lr=3e-4"
    assert proc.stderr.strip() == said, proc.stderr[-3000:]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


def test_a_sigterm_while_starting_is_a_preemption_said_in_one_line(tmp_path):
    """A SIGTERM before the run is built (here in the imports: held until the config checks
    passed, then acted on) ends it as a preemption with nothing to save: one line and exit code
    75, as a scheduler's requeue expects (its default action killed the process without a
    word)."""
    command, env = train_command([*TINY, f"hydra.run.dir={tmp_path / 'run'}"], nproc=None)
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(1.0)  # importing torch takes seconds
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    line = "preempted (SIGTERM) while starting, before the first step: nothing to save; exit "
    assert err.strip() == line + "code 75, run the same command to resume", err[-3000:]


def test_sweep_script_runs_one_torchrun_per_point(sweep):
    assert sweep.returncode == 0, sweep.output[-3000:]
    sweep_dir = sweep.dir
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["0", "1", "sweep.txt"]
    for n, seed in enumerate((1, 2)):
        point = sweep_dir / str(n)
        assert f"seed: {seed}\n" in (point / "config.yaml").read_text()
        assert (point / "rank0.log").exists() and (point / "rank1.log").exists()
        assert len(list(point.glob("events.out.tfevents.*"))) == 1
    assert "trainer.seed=2" in (sweep_dir / "sweep.txt").read_text().splitlines()[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_cpu_affinity_gives_each_worker_its_own_block_of_cpus(sweep):
    # the sweep's points run with dist.cpu_affinity=true (sweep, above): a torchrun launch of 2
    assert sweep.returncode == 0, sweep.output[-3000:]
    for point in ("0", "1"):
        blocks = []
        for rank in (0, 1):
            text = (sweep.dir / point / f"rank{rank}.log").read_text()
            found = re.search(rf"rank {rank} pinned to CPUs (\d+)-(\d+)", text)
            first, last = map(int, found.groups())
            blocks.append(set(range(first, last + 1)))
        assert blocks[0] and blocks[1] and not blocks[0] & blocks[1]
        assert blocks[0] | blocks[1] <= set(os.sched_getaffinity(0))


def test_cpu_affinity_with_more_workers_than_cpus_says_how_to_fix():
    from mgpu.runtime.launch import pin_host_cpus

    with pytest.raises(ValueError, match="dist.cpu_affinity=false"):
        pin_host_cpus(0, len(os.sched_getaffinity(0)) + 1)


def test_cuda_gets_32_queues_unless_the_environment_chose(monkeypatch, caplog):
    """train.py's default_cuda_connections, and the warning data.decode=gpu gives where the
    environment chose fewer queues (nvJPEG's uploads then wait behind the training step)."""
    from mgpu.data.gpu_decode import resolve_decode
    from mgpu.runtime.launch import (
        CUDA_CONNECTIONS,
        cuda_connections_warning,
        default_cuda_connections,
    )

    # set, then deleted: monkeypatch then restores the variable's absence (or its value)
    monkeypatch.setenv(CUDA_CONNECTIONS, "0")
    monkeypatch.delenv(CUDA_CONNECTIONS)
    default_cuda_connections()
    assert os.environ[CUDA_CONNECTIONS] == "32" and cuda_connections_warning() is None
    monkeypatch.setenv(CUDA_CONNECTIONS, "7")
    default_cuda_connections()
    assert os.environ[CUDA_CONNECTIONS] == "7"  # the user's choice stands
    said = cuda_connections_warning()
    assert said is not None and "CUDA_DEVICE_MAX_CONNECTIONS=7" in said and "unset it" in said
    with caplog.at_level("WARNING"):
        assert resolve_decode("cpu") == "cpu"
        assert not caplog.records  # the CPU path shares no queues with anything
        assert resolve_decode("gpu") == "gpu"
        assert resolve_decode("gpu") == "gpu"  # the eval set's: said once a process
    assert [r.getMessage() for r in caplog.records] == [f"data.decode=gpu: {said}"]
    assert cuda_connections_warning({CUDA_CONNECTIONS: "32"}) is None
    assert cuda_connections_warning({CUDA_CONNECTIONS: "1"}) is not None
    monkeypatch.setenv(CUDA_CONNECTIONS, "")  # empty: as if unset
    default_cuda_connections()
    assert os.environ[CUDA_CONNECTIONS] == "32"
    with pytest.raises(ValueError, match="decode='fast'"):
        resolve_decode("fast")
