"""A node lost mid-run, with real processes: two torchrun agents on this machine act as two nodes
(launch/multi_node.sh, c10d rendezvous on loopback), and one of them is lost as a machine is: its
agent and its workers killed at once (SIGKILL). The other node stops within dist.timeout_s + 30 s
with one line naming the lost ranks and their host, the newest checkpoint intact; relaunching
both nodes ends as an uninterrupted run, bit for bit. Elastic (NNODES=1:2, MAX_RESTARTS=1): the
node left continues alone from the newest checkpoint, with the data order docs/checkpoints.md
gives for a change of the number of processes. On GPUs the same, 2 nodes of 2 GPUs over NCCL.
The lost node's launches also show what two nodes of one run share: the ranks their agents give
out, one run directory, the event files written by rank 0 alone."""

import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port, read_scalars
from faults import first_sample_of_step, recorded
from test_resume import BATCH, RUN, assert_same_run, faulty, loss_record, shared_reference

from mgpu.ckpt.checkpoint import find_latest_valid, step_dir
from mgpu.data.sampler import epoch_order

KILL_AT = 13  # the step at which node 1 is lost: checkpoints at 5 and 10 are behind it
TIMEOUT_S = 30  # dist.timeout_s of these runs: the other node must stop within it + 30 s
NUM_SAMPLES = 100_000  # NgramTokens' default, as in the reference run
STOPPED = "stopped: another rank's process ended under a collective"


def node(
    tmp: Path, args: list[str], index: int, port: int, *, nnodes="2", restarts=0, env=None
) -> subprocess.Popen:
    """Node `index` (0 or 1) of a two-node launch through launch/multi_node.sh. Node 0 hosts the
    rendezvous store and is given the lower address, so torchrun numbers it first: node 1 holds
    the higher ranks and is the one lost (a lost node 0 takes the store with it, as the machine
    named in RDZV_ENDPOINT would)."""
    # A rendezvous of one node waits last_call_timeout for more; a node is dead to it after
    # keep_alive_interval x keep_alive_max_attempt without a heartbeat (30 s and 5 x 3 s by
    # default: shortened here, as a test waits for both).
    conf = f"is_host={int(index == 0)},last_call_timeout=6,keep_alive_interval=1"
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # the checkout first, then what the caller's Python finds its packages by
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "PYTHON": sys.executable,
        "NNODES": nnodes,
        "NPROC_PER_NODE": "1",
        "RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "RUN_ID": "two-nodes",
        "MAX_RESTARTS": str(restarts),
        "LOCAL_ADDR": f"127.0.0.{index + 1}",
        "TORCHRUN_ARGS": f"--rdzv-conf={conf}",
        **(env or {}),
    }
    return subprocess.Popen(
        ["bash", str(ROOT / "launch" / "multi_node.sh"), *args],
        cwd=tmp,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def lose_node_1(tmp: Path, args: list[str], marker: Path, envs=(None, None), **launch):
    """Both nodes, node 1 lost where the fault in `args` fires (it kills its agent, then its
    worker; a second worker there follows its agent at once: train.py's parent-death signal).
    Node 0's output and exit code; node 0 must have ended within TIMEOUT_S + 30 s of the loss."""
    port = free_port()
    nodes = [node(tmp, args, i, port, env=envs[i], **launch) for i in (0, 1)]
    lost_out, _ = nodes[1].communicate(timeout=600)  # its agent's end: the loss
    assert nodes[1].returncode == -9 and marker.exists(), lost_out[-3000:]
    try:
        out, _ = nodes[0].communicate(timeout=TIMEOUT_S + 30)
    except subprocess.TimeoutExpired as late:
        nodes[0].kill()
        out, _ = nodes[0].communicate()
        raise AssertionError(
            f"node 0 still ran {TIMEOUT_S + 30} s after the loss:\n{out}"
        ) from late
    return out, nodes[0].returncode


def both_nodes(tmp: Path, args: list[str], envs=(None, None)) -> list[str]:
    port = free_port()
    nodes = [node(tmp, args, i, port, env=envs[i]) for i in (0, 1)]
    outs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    return outs


def lost_node_stopped_the_other(out: str, code: int, lost: str, run_dir: Path, ranks=1) -> None:
    """Node 0 stopped non-zero, each of its `ranks` with one line naming the `lost` ranks ("rank
    1 (pid ") and their host, and the newest checkpoint, step 10's, passes the manifest's checks."""
    assert code != 0, out[-3000:]
    said = [line for line in out.splitlines() if STOPPED in line]
    assert len(said) == ranks, out[-3000:]
    for line in said:
        assert f"gone: {lost}" in line and f") on {socket.gethostname()} " in line, line
    newest, problems = find_latest_valid(run_dir / "checkpoints")
    assert newest == step_dir(run_dir / "checkpoints", 10) and problems == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (2 processes of one node: the same 2 ranks), test_resume.py's."""
    return shared_reference(tmp_path_factory)


def test_a_lost_node_stops_the_other_naming_it_and_a_relaunch_resumes_bit_for_bit(
    tmp_path, reference
):
    marker = tmp_path / "lost"
    args = [*RUN, *faulty("kill_job", rank=1, step=KILL_AT, marker=marker)]
    args.append(f"dist.timeout_s={TIMEOUT_S}")
    out, code = lose_node_1(tmp_path, args, marker)
    run_dir = tmp_path / "outputs" / "two-nodes"
    lost_node_stopped_the_other(out, code, "rank 1 (pid ", run_dir)
    # Both nodes wrote into one run directory: each worker its log, rank 0 alone the events.
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["two-nodes"]
    assert (run_dir / "rank0.log").exists() and (run_dir / "rank1.log").exists()
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    # The same command on both nodes again, their agents saying the ranks they give out.
    outs = both_nodes(tmp_path, args, envs=({"LOGLEVEL": "INFO"}, {"LOGLEVEL": "INFO"}))
    assert "resumed from " + str(step_dir(run_dir / "checkpoints", 10)) in outs[0]
    # each agent is one node with one worker: global ranks 0 and 1, both local rank 0
    given = sorted(re.search(r"global_ranks=\[(\d+)\]", out).group(1) for out in outs)
    assert given == ["0", "1"]
    assert all("local_ranks=[0]" in out and "group_world_size=2" in out for out in outs)
    assert "2 process(es)" in "".join(outs)
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["two-nodes"]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # one a launch, rank 0's
    assert_same_run(run_dir, reference)


def test_an_elastic_run_goes_on_with_the_node_left_from_the_newest_checkpoint(tmp_path, reference):
    marker, record = tmp_path / "lost", tmp_path / "record"
    record.mkdir()
    args = [*RUN, *faulty("kill_job", rank=1, step=KILL_AT, marker=marker)]
    args[args.index("data._target_=tests.faults.FaultyTokens")] = (
        "data._target_=tests.faults.FaultyRecordingTokens"
    )
    args += [f"+data.kwargs.record={record}", f"+data.kwargs.num_samples={NUM_SAMPLES}"]
    args.append(f"dist.timeout_s={TIMEOUT_S}")
    out, code = lose_node_1(tmp_path, args, marker, nnodes="1:2", restarts=1)
    assert code == 0, out[-3000:]
    run_dir = tmp_path / "outputs" / "two-nodes"
    assert "resumed from " + str(step_dir(run_dir / "checkpoints", 10)) in out
    # docs/checkpoints.md, Resume: on another number of processes the run goes on with the
    # samples of the epoch not yet seen, each once, and says it is not bit for bit the same.
    assert "saved by 2 process(es), this run has 1" in out
    assert "not match an uninterrupted one bit for bit" in out
    # Served per process: the first attempt's two ranks to step 13, the one process's steps
    # 11-20, BATCH samples a step (data.batch_size is per process).
    first = first_sample_of_step(11, BATCH) - 1  # each first-attempt rank's samples to step 10
    resumed, *before = sorted(recorded(record), key=len)
    assert len(before) == 2 and len(resumed) == 10 * BATCH < min(map(len, before))
    seen = before[0][:first] + before[1][:first] + resumed
    assert len(seen) == len(set(seen))  # no sample twice, none skipped:
    assert sorted(seen) == sorted(epoch_order(NUM_SAMPLES, 0, 0)[: len(seen)].tolist())
    # The loss: steps 1-10 are the uninterrupted run's, 11-20 the one process's, each once.
    losses = loss_record(run_dir)
    assert sorted(losses) == list(range(1, 21))
    assert {s: losses[s] for s in range(1, 11)} == {
        s: v for s, v in loss_record(reference).items() if s <= 10
    }
    assert [s for s, _ in read_scalars(run_dir)["train/loss"]] == list(range(1, 21))


def test_nodes_that_do_not_share_the_run_directory_stop_before_any_step(tmp_path):
    """Two nodes started in different working directories, the same RUN_ID: each resolves
    outputs/two-nodes, and the config check (which compares run directories relative to the
    working directory, as nodes may mount one share at different paths) passes. Node 1's is
    another directory, where every save would fail: both stop at start-up, exit 2, naming
    rank 1 and rank 0's directory, before any step."""
    (tmp_path / "elsewhere").mkdir()
    port = free_port()
    args = [*RUN, f"dist.timeout_s={TIMEOUT_S}"]
    nodes = [node(cwd, args, i, port) for i, cwd in enumerate((tmp_path, tmp_path / "elsewhere"))]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [2, 2], outs[0][-3000:] + outs[1][-3000:]
    said = "rank(s) 1 do not see rank 0's run directory " + str(tmp_path / "outputs" / "two-nodes")
    assert said in outs[0], outs[0][-3000:]
    assert not (tmp_path / "outputs" / "two-nodes" / "checkpoints").exists()
    assert "step 1" not in outs[0] + outs[1]


NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
NCCL_ENV |= {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}


# Bit for bit against another run needs kernels that repeat from run to run (docs/checkpoints.md,
# Resume): without trainer.deterministic, two uninterrupted runs of this GPT replayed as CUDA
# graphs differed on 2 H200s as the resumed one did (up to 4e-5 in the weights); with it, on one
# GPU and the math attention, they were equal.
GPU_RUN = [*RUN, "model.attention=math", "trainer.deterministic=true"]
GPU_RUN.append("trainer.cudnn_benchmark=false")


def gpu_nodes() -> tuple[int, list[dict]]:
    """2 nodes of 2 GPUs (of 1 on a machine of 2 or 3), each its own host to NCCL (sockets
    between the nodes): GPUs per node, and each node's environment."""
    per = min(2, torch.cuda.device_count() // 2)  # GPUs (ranks) per node
    # Each node's share of the GPUs this process sees (a pytest worker may see only some)
    seen = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    seen = seen if seen != [""] else [str(i) for i in range(torch.cuda.device_count())]
    gpus = [",".join(seen[n * per : (n + 1) * per]) for n in (0, 1)]
    envs = [
        {**NCCL_ENV, "NPROC_PER_NODE": str(per), "CUDA_VISIBLE_DEVICES": g, "NCCL_HOSTID": host}
        for g, host in zip(gpus, ("mgpu-node0", "mgpu-node1"), strict=True)
    ]
    return per, envs


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory) -> Path:
    """The uninterrupted run over gpu_nodes (both nodes, the same command), once for the file's
    GPU tests: each compares its faulty run with it."""
    tmp = tmp_path_factory.mktemp("gpu_reference")
    reference = tmp / "reference"
    never = faulty("kill_job", rank=-1, step=1, marker=tmp / "unused")
    both_nodes(tmp, [*GPU_RUN, *never, f"hydra.run.dir={reference}"], gpu_nodes()[1])
    return reference


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_gpus_a_lost_node_stops_the_other_naming_it_and_a_relaunch_resumes(
    tmp_path, gpu_reference
):
    """Over NCCL (gpu_nodes), node 1 (its ranks the higher) lost at KILL_AT; then both
    relaunched, against an uninterrupted run."""
    (per, envs), reference = gpu_nodes(), gpu_reference
    marker = tmp_path / "lost"
    args = [*GPU_RUN, *faulty("kill_job", rank=per, step=KILL_AT, marker=marker)]
    args.append(f"dist.timeout_s={TIMEOUT_S}")
    out, code = lose_node_1(tmp_path, args, marker, envs)
    run_dir = tmp_path / "outputs" / "two-nodes"
    lost = "ranks 2 (pid " if per == 2 else "rank 1 (pid "  # node 1's first rank, and its pid
    lost_node_stopped_the_other(out, code, lost, run_dir, ranks=per)
    outs = both_nodes(tmp_path, args, envs)
    assert "resumed from " + str(step_dir(run_dir / "checkpoints", 10)) in outs[0]
    assert_same_run(run_dir, reference)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_gpus_an_elastic_run_goes_on_with_the_node_left(tmp_path, gpu_reference):
    """Over NCCL (gpu_nodes), launched elastic (--nnodes=1:2, one restart): node 1 lost at
    KILL_AT, node 0's agent starts its workers again alone, and they resume from step 10's
    checkpoint, saved by both nodes' ranks, and finish; steps 1-10 are the uninterrupted run's,
    and every step is logged once (docs/checkpoints.md: another number of processes)."""
    (per, envs), reference = gpu_nodes(), gpu_reference
    marker = tmp_path / "lost"
    args = [*GPU_RUN, *faulty("kill_job", rank=per, step=KILL_AT, marker=marker)]
    args.append(f"dist.timeout_s={TIMEOUT_S}")
    out, code = lose_node_1(tmp_path, args, marker, envs, nnodes="1:2", restarts=1)
    assert code == 0, out[-3000:]
    run_dir = tmp_path / "outputs" / "two-nodes"
    assert "resumed from " + str(step_dir(run_dir / "checkpoints", 10)) in out
    assert f"saved by {2 * per} process(es), this run has {per}" in out
    losses = loss_record(run_dir)
    assert sorted(losses) == list(range(1, 21))
    assert {s: losses[s] for s in range(1, 11)} == {
        s: v for s, v in loss_record(reference).items() if s <= 10
    }
    assert [s for s, _ in read_scalars(run_dir)["train/loss"]] == list(range(1, 21))


@pytest.mark.bench
def test_bench_two_nodes_quick_runs_and_records(tmp_path):
    """bench/two_nodes.py --quick: the probe, one engines job of 2 micro-batches a step, and
    train.py on real text with torch DDP's fp32 wire and PowerSGD (from step 10 of 16) over 2
    agents, on the CPU."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "two_nodes.py"), "--quick", "--models",
         "gpt2_small", "--modes", "eager", "--engines", "none", "mgpu", "--out", str(tmp_path),
         "--loss-steps", "16", "--loss-wires", "ddp_fp32", "powersgd",
         "--socket-threads", "2", "--socks-per-thread", "4", "--accum", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (written,) = tmp_path.glob("scaling-two-nodes-cpu-*.json")  # with the scaling results
    record = json.loads(written.read_text())
    assert (record["nodes"], record["per_node"], record["wire"]["name"]) == (2, 1, "gloo")
    socket = {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "4"}
    assert record["wire"]["socket"] == socket  # recorded (gloo on the CPU reads neither)
    assert set(record["bus_bandwidth_GBps"]) == {"1", "4"}
    assert all(v > 0 for v in record["bus_bandwidth_GBps"].values())
    key = "gpt2_small_eager_2x1_socket_accum2"  # 2 micro-batches a step
    assert record["efficiency"][key] > 0
    (mgpu,) = record["by_engine"][key].values()  # "none" left out
    assert mgpu == record["efficiency"][key]
    (job,) = record["jobs"]
    assert job["world_size"] == 2 and {r["engine"] for r in job["rows"]} == {"none", "mgpu"}
    assert job["accum"] == 2 and all(r["accum"] == 2 for r in job["rows"])
    runs = record["loss"]["runs"]
    assert {n: r["status"] for n, r in runs.items()} == {"ddp_fp32": "ok", "powersgd": "ok"}
    assert "dist.compression=powersgd" in runs["powersgd"]["overrides"]
    assert all(0 < r["eval_loss"] < math.log(256) for r in runs.values())  # it learned
    change = record["loss"]["powersgd_vs_ddp_fp32"]["eval_loss"]
    assert change == runs["powersgd"]["eval_loss"] / runs["ddp_fp32"]["eval_loss"] - 1
    assert abs(change) < 0.05, change  # compressed gradients train the same model


def test_the_probe_tells_sockets_between_nodes_from_one_host_seen():
    """bench/two_nodes.py reads NCCL_DEBUG=INFO's channel lines (NCCL 2.28's form) by pair kind:
    two nodes of 2 each its own host (sockets across, NVLink within), and NCCL seeing one host."""
    spec = importlib.util.spec_from_file_location("two_nodes", ROOT / "bench" / "two_nodes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    two_hosts = """
    h:1:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0
    h:3:4 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [receive] via NET/Socket/0
    h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
    h:3:4 [1] NCCL INFO Channel 01/0 : 3[1] -> 0[0] [send] via NET/Socket/1
    """
    seen = bench.transports(two_hosts, per_node=2)
    assert seen == {"across nodes": ["NET/Socket/0", "NET/Socket/1"], "within a node": [
        "P2P/CUMEM/read"]}  # fmt: skip
    assert bench.two_hosts(seen)
    one_host = "h:1:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] via P2P/CUMEM/read"
    assert not bench.two_hosts(bench.transports(one_host, per_node=2))
    assert not bench.two_hosts(bench.transports("no channel lines", per_node=2))


def test_a_job_of_the_bf16_wire_alone_is_summarized_by_it():
    """#43 asks for the best wire setting: a job that ran only each GPU alone and mgpu's bf16
    wire reports that wire's efficiency and name; beside mgpu's fp32 wire the faster one wins,
    and torch DDP only enters "vs_ddp"."""
    spec = importlib.util.spec_from_file_location("two_nodes", ROOT / "bench" / "two_nodes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    summary: dict = {"efficiency": {}, "vs_ddp": {}, "engine": {}, "by_engine": {}}
    bench.summarize_job([{"engine": "none", "step_ms": 90.0}, {"engine": "mgpu_bf16",
                         "step_ms": 100.0}], "a", summary)  # fmt: skip
    rows = [
        {"engine": e, "step_ms": ms}
        for e, ms in (("none", 90.0), ("mgpu", 120.0), ("mgpu_bf16", 100.0), ("torch_ddp", 80.0))
    ]
    bench.summarize_job(rows, "b", summary)
    assert summary["efficiency"] == {"a": 0.9, "b": 0.9}
    assert summary["engine"] == {"a": "mgpu_bf16", "b": "mgpu_bf16"}
    assert summary["vs_ddp"] == {"b": 0.8}
    assert summary["by_engine"]["b"] == {"mgpu": 0.75, "mgpu_bf16": 0.9, "torch_ddp": 1.125}
