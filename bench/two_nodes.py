"""Two nodes on one host, in one command: two torchrun agents (c10d rendezvous on 127.0.0.1), each
a "node" of half the GPUs, that NCCL sees as two hosts (NCCL_HOSTID per agent), so that the link
between them is NCCL's socket transport over loopback (no InfiniBand) while each node's GPUs keep
NVLink: a stand-in for two machines on a network.

    python bench/two_nodes.py                      # 4 GPUs as 2 nodes of 2: the probe, then
                                                   # GPT-2-small and ResNet-50, compiled and eager
    python bench/two_nodes.py --models gpt2_small --modes eager
    python bench/two_nodes.py --wire all-socket    # every pair over sockets (the fallback)
    python bench/two_nodes.py --models --loss-steps 300   # held-out loss, fp32 wire vs PowerSGD
    python bench/two_nodes.py --quick              # CPU, gloo, 2 nodes of 1: checks the script

First a probe: all_reduce bus bandwidth across the whole 2-node job (2(n-1)/n x bytes / time, the
median of timed repeats after warm-up) at a few sizes, with NCCL_DEBUG=INFO, whose lines say
which transport each channel took between which ranks: every pair across nodes must go over
NET/Socket and no pair within a node may. Where NCCL does not see two hosts (a cross-node pair
over P2P or SHM), the whole job goes over sockets instead (NCCL_P2P_DISABLE=1,
NCCL_SHM_DISABLE=1: --wire all-socket), and the record says so. Then, per model and mode, one
2-node job of bench/engines.py: mgpu (fp32 and bf16 wire) and torch DDP (plain and with
PowerSGD) beside every GPU training alone. With --loss-steps, train.py itself over the 2 nodes
on real text (Python's sources, byte-level), once per wire setting from the same seed and data:
the held-out loss each reaches, against the fp32 wire's.

Writes bench/results/scaling-two-nodes-<device>-<time>.json (a scaling results file, beside
scaling.py's; until 2026-11-27 named two-nodes-*): scaling.py's record (machine, versions,
commit, every job's rows, "efficiency", "vs_ddp" and "engine" keyed
`<model>_<compiled|eager>_<nodes>x<per node>_socket`, then `_accum<N>` for a job of --accum N
micro-batches a step), "by_engine" (under the same keys, each
engine's efficiency: the wire settings of WIRE_ENGINES side by side), "wire" (the NCCL
settings of both nodes), "bus_bandwidth_GBps" by message size and "transport" (what NCCL chose,
by pair kind).
NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 and its companions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from children import exit_on_sigterm, stop  # noqa: E402
from scaling import MINE, MODES, summarize  # noqa: E402 - bench/ is not a package

ROOT = HERE.parent
NODES = 2
# Each wire setting as an engine of bench/engines.py: the fp32 and bf16 wires of mgpu's reducer,
# torch DDP plain and with PowerSGD (dist.compression=powersgd), beside every GPU alone.
WIRE_ENGINES = ["none", "mgpu", "mgpu_bf16", "torch_ddp", "torch_ddp_powersgd"]
# mgpu's wire settings: the fastest of those in a job is its "efficiency" and "engine"
# (#43 asks for the best setting and its name), whichever of them the job ran
MGPU_WIRES = (
    *MINE,
    "mgpu_bf16",
    "mgpu_whole_compile_cap256",
    "mgpu_whole_compile_cap256_bf16",
    "mgpu_whole_compile_cap25_bf16",
)
NO_MULTICAST = {  # docs: GPU.md, multicast must stay off on the lent machines
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# NCCL's link between the nodes: its socket transport on loopback, never InfiniBand.
SOCKET = {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}
WIRES = {
    # each node its own host to NCCL: sockets between nodes, NVLink (P2P) within each
    "hostid": {**SOCKET},
    # the fallback stand-in: every pair over sockets, within a node too
    "all-socket": {**SOCKET, "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}
PROBE_MB = {"gpu": (16, 64, 256), "cpu": (1, 4)}
# --loss-wires: each wire setting as train.py's overrides
LOSS_WIRES = {
    "fp32": [],  # mgpu's reducer, fp32 on the wire (the default)
    "bf16": ["dist.reduce_dtype=bf16"],
    "ddp_fp32": ["dist.engine=torch_ddp"],  # torch DDP, fp32: PowerSGD's engine uncompressed
    "powersgd": ["dist.engine=torch_ddp", "dist.compression=powersgd"],  # rank 4, the default
    "powersgd_r32": ["dist.engine=torch_ddp", "dist.compression=powersgd", "dist.powersgd_rank=32"],
}
# Each setting against the fp32 run of its own engine where it ran (only the wire differs),
# else against the first setting run.
LOSS_REFERENCE = {
    "bf16": "fp32",
    "powersgd": "ddp_fp32",
    "powersgd_r32": "ddp_fp32",
    "ddp_fp32": "fp32",
}
# --quick: a narrow tiny GPT, short windows, no workers, no compile (a CPU run checks the path)
QUICK_LOSS = ["model=gpt_tiny", "model.n_embd=32", "model.n_head=2", "data.seq_len=64"]
QUICK_LOSS += ["data.batch_size=4", "data.eval_samples=16", "data.num_workers=0"]
QUICK_LOSS += ["trainer.compile=false", "optim.lr=3e-3"]
# "Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0", "... : 0[0] -> 1[1] via P2P/CUMEM/read"
CHANNEL = re.compile(r"(\d+)\[\d+\] -> (\d+)\[\d+\].* via (\S+)")


def node_env(index: int, per_node: int, wire: str, quick: bool) -> dict[str, str]:
    """Node `index`'s environment: its half of the GPUs and its own host identity to NCCL."""
    env = {
        **os.environ,
        **NO_MULTICAST,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        # the workers' store is rank 0's, new each attempt (launch/multi_node.sh does the same)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    if not quick:
        first = index * per_node
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(first, first + per_node)))
        env["NCCL_HOSTID"] = f"mgpu-two-nodes-{index}"
        env.update(WIRES[wire])  # quick: "gloo", no NCCL
    return env


def socket_env(args) -> dict[str, str]:
    """--socket-threads and --socks-per-thread as NCCL's socket transport settings (its threads
    per connection, and sockets per thread: one each by default, which a fast link outruns)."""
    env = {}
    if args.socket_threads:
        env["NCCL_SOCKET_NTHREADS"] = str(args.socket_threads)
    if args.socks_per_thread:
        env["NCCL_NSOCKS_PERTHREAD"] = str(args.socks_per_thread)
    return env


def two_nodes(program: list[str], per_node: int, wire: str, quick: bool, timeout_s: float,
              extra_env: dict[str, str] | None = None) -> tuple[int, str]:  # fmt: skip
    """Run `program` under two torchrun agents, one per node; (worst exit code, both outputs)."""
    port = free_port()
    agents, logs = [], []
    for index in range(NODES):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={NODES}", f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=two-nodes-{os.getpid()}-{port}",
            # node 0 hosts the rendezvous and, with the lower address, holds the lower ranks
            f"--rdzv-conf=is_host={int(index == 0)}", f"--local-addr=127.0.0.{index + 1}",
            *program,
        ]  # fmt: skip
        env = {**node_env(index, per_node, wire, quick), **(extra_env or {})}
        # A file, not a pipe: NCCL_DEBUG=INFO fills a pipe that is not read while the other
        # agent is waited for, and a node blocked on its output would stall both.
        logs.append(tempfile.TemporaryFile("w+"))
        agents.append(
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=logs[-1], stderr=subprocess.STDOUT)
        )
    codes = []
    deadline = time.monotonic() + timeout_s
    try:
        for agent in agents:
            try:
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
                codes.append(agent.returncode)
            except subprocess.TimeoutExpired:
                # SIGTERM first: a SIGKILL of an agent leaves its workers (each in a session of
                # its own) running on the GPUs
                stop(agents)
                codes.append(124)
    finally:  # Ctrl-C, SIGTERM (exit_on_sigterm), an error: no agent left running
        stop(agents)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return max(codes, key=abs), "\n".join(outputs)


def commit() -> str | None:
    """The checkout's commit (MGPU_COMMIT where the tree was copied without .git)."""
    git = ["git", "rev-parse", "HEAD"]
    found = subprocess.run(git, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return os.environ.get("MGPU_COMMIT") or found or None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transports(output: str, per_node: int) -> dict[str, list[str]]:
    """What NCCL said it used, by pair kind: {'across nodes': [...], 'within a node': [...]}."""
    seen: dict[str, set[str]] = {"across nodes": set(), "within a node": set()}
    for src, dst, via in CHANNEL.findall(output):
        across = int(src) // per_node != int(dst) // per_node
        seen["across nodes" if across else "within a node"].add(via)
    return {kind: sorted(v) for kind, v in seen.items()}


def two_hosts(seen: dict[str, list[str]]) -> bool:
    """NCCL took the network between the nodes, and only there."""
    across, within = seen["across nodes"], seen["within a node"]
    return (
        bool(across)
        and all(v.startswith("NET/") for v in across)
        and not any(v.startswith("NET/") for v in within)
    )


# ---- the probe, run by each worker (--probe-worker) ----


def probe_worker(out: Path, sizes_mb: list[int], repeats: int) -> None:
    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
    n = dist.get_world_size()
    result = {}
    for mb in sizes_mb:
        x = torch.randn(mb * 2**20 // 4, device=device)  # fp32: never time zeros
        for _ in range(3):
            dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            if on_gpu:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        # every rank's median; the slowest rank's bounds the collective
        t = torch.tensor([statistics.median(times)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        bus = 2 * (n - 1) / n * x.numel() * 4 / t.item() / 1e9
        result[str(mb)] = round(bus, 2)
    if dist.get_rank() == 0:
        meta = {"world_size": n, "device": torch.cuda.get_device_name() if on_gpu else "cpu"}
        out.write_text(json.dumps({"bus_bandwidth_GBps": result, **meta}))
    dist.destroy_process_group()


def probe(per_node: int, wire: str, args, tmp: Path) -> dict:
    """The bus-bandwidth probe over both nodes, and the transports NCCL reported."""
    out = tmp / f"probe-{wire}.json"
    sizes = PROBE_MB["cpu" if args.quick else "gpu"]
    program = [str(Path(__file__).resolve()), "--probe-worker", str(out), "--probe-repeats",
               str(args.probe_repeats), "--probe-mb", *map(str, sizes)]  # fmt: skip
    print(f"=== probe, wire {wire}: all_reduce across {NODES} nodes of {per_node}", flush=True)
    debug = {} if args.quick else {"NCCL_DEBUG": "INFO"}
    env = {**socket_env(args), **debug}
    code, output = two_nodes(program, per_node, wire, args.quick, args.job_timeout_s, env)
    if code != 0 or not out.exists():
        print(output[-5000:])
        return {"status": f"exit {code}"}
    found = json.loads(out.read_text())
    seen = transports(output, per_node) if not args.quick else {"across nodes": ["gloo/TCP"]}
    return {"status": "ok", "wire": wire, "transport": seen, **found}


def job_key(model: str, mode: str, per_node: int, accum: int) -> str:
    """`<model>_<mode>_2x<per node>_socket`, `_accum<N>` after it for N micro-batches a step."""
    return f"{model}_{mode}_{NODES}x{per_node}_socket" + (f"_accum{accum}" if accum > 1 else "")


def engines_job(model: str, mode: str, per_node: int, wire: str, accum: int, args, tmp: Path):
    """One 2-node job of bench/engines.py: its rows and metadata, and 'ok' or why not."""
    names = args.engines or WIRE_ENGINES
    tag = job_key(model, mode, per_node, accum).replace("_", "-")
    program = [
        str(HERE / "engines.py"), "--models", model, "--engines", *names,
        "--out", str(tmp), "--tag", tag, "--accum", str(accum),
    ]  # fmt: skip
    if mode == "compiled":
        program.append("--compile")
    if args.quick:  # engines.py's own few steps
        program.append("--quick")
    else:
        program += ["--steps", str(args.steps), "--rounds", str(args.rounds)]
        program += ["--warmup", str(args.warmup)]
    print(f"=== {model} {mode} x{accum} on {NODES} nodes of {per_node}, wire {wire}", flush=True)
    before = set(tmp.glob("engines-*.json"))
    code, output = two_nodes(
        program, per_node, wire, args.quick, args.job_timeout_s, socket_env(args)
    )
    print(output[-4000:] if code != 0 else output[-1500:], flush=True)
    written = sorted(set(tmp.glob("engines-*.json")) - before)
    if code != 0 or not written:
        return [], {}, f"exit {code}"
    data = json.loads(written[-1].read_text())
    return data.pop("rows"), data, "ok"


def loss_runs(per_node: int, wire: str, args, tmp: Path) -> dict:
    """--loss-steps: train.py over the two nodes on Python's own sources as byte-level tokens,
    once per --loss-wires setting, from the same seed and data order; each setting's held-out
    loss after the last step against its reference's (LOSS_REFERENCE; #43: a compressed wire
    within 0.5 % of the fp32 wire's after 300 steps)."""
    # vs_plain.py's real text (no download) and its reading of a run's TensorBoard
    from real_text import python_text, tensorboard_scalars

    text, tokens = tmp / "python.txt", tmp / "python.bin"
    python_text(text, limit=2**20 if args.quick else None)
    subprocess.run(
        [sys.executable, "-m", "mgpu.data.prepare", str(text), str(tokens)],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    steps, every = args.loss_steps, max(1, args.loss_steps // 10)
    runs = {}
    for name in args.loss_wires:
        run_dir = tmp / f"loss-{name}"
        overrides = [*args.loss_model, f"data.path={tokens}", f"trainer.max_steps={steps}"]
        overrides += [f"trainer.log_every={every}", f"trainer.eval_every={steps}", "ckpt.every=0"]
        overrides += [f"optim.warmup_steps={every}", *LOSS_WIRES[name], f"hydra.run.dir={run_dir}"]
        overrides += QUICK_LOSS if args.quick else []
        print(f"=== {steps} steps of real text on {NODES} nodes of {per_node}, {name}", flush=True)
        program = [str(ROOT / "train.py"), *overrides]
        code, output = two_nodes(
            program, per_node, wire, args.quick, args.loss_timeout_s, socket_env(args)
        )
        if code != 0:
            print(output[-4000:], flush=True)
            runs[name] = {"status": f"exit {code}", "overrides": overrides}
            continue
        scalars = tensorboard_scalars(run_dir)
        timed = [v for s, v in scalars.get("time/step_ms", []) if s > every]  # after the first
        runs[name] = {
            "status": "ok",
            "overrides": overrides,
            "eval_loss": scalars["eval/loss"][-1][1],
            "train_loss": scalars["train/loss"],
            "ms_per_step": statistics.median(timed) if timed else None,
        }
        print(json.dumps({"run": name, "eval_loss": runs[name]["eval_loss"]}), flush=True)
    result: dict = {"steps": steps, "model": args.loss_model, "runs": runs}
    first, *others = runs
    for name in others:
        ref = LOSS_REFERENCE.get(name, first)
        ref = ref if ref in runs else first
        if runs[name]["status"] == "ok" and runs[ref]["status"] == "ok":
            change = runs[name]["eval_loss"] / runs[ref]["eval_loss"] - 1
            result[f"{name}_vs_{ref}"] = {
                "eval_loss": change,
                "within_0.5pct": abs(change) <= 0.005,
            }
    return result


def summarize_job(rows: list[dict], key: str, summary: dict) -> None:
    """One job's rows into the record's summary: the fastest of mgpu's wire settings as
    "efficiency", "vs_ddp" and "engine", and every engine's own efficiency in "by_engine"."""
    summarize(rows, key, summary, MGPU_WIRES)
    steps = {r["engine"]: r["step_ms"] for r in rows}
    if "none" in steps:
        alone = steps.pop("none")
        summary["by_engine"][key] = {e: round(alone / ms, 4) for e, ms in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["gpt2_small", "resnet50"],
                        help="speed jobs (none: only the probe and --loss-steps)")  # fmt: skip
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--wire", choices=["auto", *WIRES], default="auto",
                        help="auto: hostid, else all-socket where NCCL sees one host")  # fmt: skip
    parser.add_argument("--gpus", type=int, help="GPUs in all, half a node (default: all)")
    parser.add_argument("--engines", nargs="+", help="bench/engines.py's (default: WIRE_ENGINES)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--accum", type=int, nargs="+", default=[1],
        help="micro-batches a step, a job for each (trainer.grad_accum_steps; keys _accum<N>)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--probe-repeats", type=int, default=20)
    parser.add_argument(
        "--socket-threads",
        type=int,
        default=0,
        help="NCCL_SOCKET_NTHREADS between the nodes, 1-16 (0: NCCL's own, 1)",
    )
    parser.add_argument(
        "--socks-per-thread",
        type=int,
        default=0,
        help="NCCL_NSOCKS_PERTHREAD (0: NCCL's own, 1); threads x sockets <= 64",
    )
    parser.add_argument("--job-timeout-s", type=int, default=420)
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        help="also train.py on real text this many steps per --loss-wires",
    )
    parser.add_argument(
        "--loss-wires",
        nargs="+",
        default=["fp32", "ddp_fp32", "powersgd"],
        choices=list(LOSS_WIRES),
    )
    parser.add_argument(
        "--loss-model",
        nargs="+",
        default=["experiment=gpt2_small"],
        help="train.py overrides of the model the loss runs train",
    )
    parser.add_argument("--loss-timeout-s", type=int, default=900)
    parser.add_argument("--quick", action="store_true", help="CPU, gloo, tiny models, 2 x 1")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--probe-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe-mb", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe_worker:
        probe_worker(args.probe_worker, args.probe_mb, args.probe_repeats)
        return
    exit_on_sigterm()  # `timeout`'s SIGTERM ends the agents through two_nodes' cleanup
    threads, socks = args.socket_threads, args.socks_per_thread
    if not 0 <= threads <= 16:
        parser.error(f"--socket-threads {threads}: NCCL takes 1 to 16 (0 leaves NCCL's own)")
    if socks < 0 or max(threads, 1) * max(socks, 1) > 64:
        parser.error(
            f"--socks-per-thread {socks}: at least 1 (0 leaves NCCL's own), and threads x "
            f"sockets at most 64 (NCCL's limit), here {max(threads, 1) * max(socks, 1)}"
        )
    if args.quick:
        per_node, args.probe_repeats = 1, 3
    else:
        import torch

        gpus = args.gpus or torch.cuda.device_count()
        if gpus < 2 or gpus % NODES:
            parser.error(f"{gpus} GPU(s): two nodes need an even number, at least 2 (--quick: CPU)")
        per_node = gpus // NODES
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        wires = [args.wire] if args.wire != "auto" else ["hostid", "all-socket"]
        wires = ["gloo"] if args.quick else wires
        for wire in wires:
            found = probe(per_node, wire, args, tmp)
            if found["status"] == "ok" and (args.quick or two_hosts(found["transport"])):
                break
            print(f"wire {wire}: NCCL did not keep sockets between the nodes alone: {found}")
        if found["status"] != "ok":
            sys.exit(f"the probe failed ({found['status']}); its output is above")
        summary: dict = {"efficiency": {}, "vs_ddp": {}, "engine": {}, "by_engine": {}}
        results, meta = [], {}
        jobs = [(m, mode, a) for m in args.models for mode in args.modes for a in args.accum]
        for model, mode, accum in jobs:
            rows, job_meta, status = engines_job(model, mode, per_node, wire, accum, args, tmp)
            key = job_key(model, mode, per_node, accum)
            meta = meta or {k: v for k, v in job_meta.items() if k != "command"}
            results.append({"key": key, "status": status, **job_meta, "rows": rows})
            summarize_job(rows, key, summary)
        losses = loss_runs(per_node, wire, args, tmp) if args.loss_steps else None
    device = str(meta.get("device", found.get("device", "cpu"))).replace(" ", "_")
    record = {
        "what": "bench/two_nodes.py: 2 torchrun agents on one host as 2 nodes, NCCL sockets "
        "between them; mgpu against each GPU alone and torch DDP, one job per model and mode",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": meta.get("device", found.get("device", "cpu")),
        "gpus": NODES * per_node,
        "nodes": NODES,
        "per_node": per_node,
        "torch": meta.get("torch"),
        "nccl": meta.get("nccl"),
        "git_commit": meta.get("git_commit") or commit(),
        "env": meta.get("env", {}),
        "wire": {"name": wire, "socket": socket_env(args), "nodes": [
            {**WIRES[wire], **socket_env(args), "NCCL_HOSTID": f"mgpu-two-nodes-{i}"}
            for i in range(NODES)
        ] if wire in WIRES else []},
        "bus_bandwidth_GBps": found["bus_bandwidth_GBps"],
        "transport": found["transport"],
        "wall_s": round(time.time() - started, 1),
        **summary,
        "jobs": results,
        **({"loss": losses} if losses else {}),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"scaling-two-nodes-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"\nwire {wire}; NCCL's transports: {found['transport']}")
    sizes = ", ".join(f"{v} GB/s at {k} MB" for k, v in found["bus_bandwidth_GBps"].items())
    print(f"all_reduce bus bandwidth across {NODES} nodes of {per_node}: {sizes}")
    for r in results:  # efficiency: each GPU alone over mgpu's step; vs DDP: DDP's over mgpu's
        key = r["key"]
        said = {name: summary[name].get(key, "-") for name in ("efficiency", "vs_ddp", "engine")}
        print(f"{key}: {r['status']}, " + ", ".join(f"{k} {v}" for k, v in said.items()))
    for name, said in (losses or {}).items():
        if name.endswith(tuple(f"_vs_{w}" for w in LOSS_WIRES)):
            print(f"held-out loss, {name}: {said['eval_loss']:+.2%}")
    print(f"wrote {path} ({record['wall_s']:.0f} s)")
    failed = [r["key"] for r in results if r["status"] != "ok"]
    failed += [
        f"loss {n}" for n, r in (losses or {}).get("runs", {}).items() if r["status"] != "ok"
    ]
    if failed:
        sys.exit("jobs that did not finish: " + ", ".join(failed))


if __name__ == "__main__":
    main()
