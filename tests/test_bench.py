"""The benchmark scripts that can run on a CPU still run and write their results file: they are
not tests, but a refactor that breaks one should not wait for a GPU machine to show it. Their
quick runs are marked bench and run when selected (`pytest -m bench`, before a GPU session or
after changing a script); the plans, parsers and readers here run in every suite."""

import ast
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(args: list[str], tmp_path) -> dict:
    proc = subprocess.run(
        [*args, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (written,) = tmp_path.glob("*.json")
    return json.loads(written.read_text())


@pytest.mark.bench
def test_telemetry_cost_runs_with_two_processes(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = run([*torchrun, "bench/telemetry_cost.py", "--model", "gpt_tiny", "--steps", "3",
                  "--rounds", "1"], tmp_path)  # fmt: skip
    assert result["meta"]["world_size"] == 2
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"log_every_step", "log_at_end", "no_recorder"}
    assert all(r["ms_per_step"] > 0 for r in rows.values())


@pytest.mark.bench
def test_input_pipeline_quick_runs(tmp_path):
    models = ["--models", "resnet50", "gpt2", "resnet50_folder"]
    result = run([sys.executable, "bench/input_pipeline.py", "--quick", *models], tmp_path)
    assert result["table"] and result["device"] == "cpu", result
    # the image folder source: written, decoded by Pillow in the workers, beside the resident
    folder = {r["variant"]: r for r in result["table"] if r["workload"] == "resnet-tiny-folder"}
    assert set(folder) == {"(a) resident", "(f) folder decode=cpu"}, folder
    assert folder["(f) folder decode=cpu"]["throughput"] > 0


@pytest.mark.bench
def test_vs_plain_quick_runs(tmp_path):
    result = run([sys.executable, "bench/vs_plain.py", "--quick"], tmp_path)
    assert set(result["ratio"]) == {
        "gpt2_small_eager",
        "gpt2_small_compiled",
        "resnet50_eager",
        "resnet50_compiled",
    }
    assert all(r > 0 for r in result["ratio"].values()), result["ratio"]
    assert set(result["ratio_best"]) == set(result["ratio"])
    for row in result["rows"]:
        assert row["mgpu"]["ms_per_step"] > 0 and row["plain"]["whole"]["ms_per_step"] > 0
        fastest = min(side["ms_per_step"] for side in row["plain"].values())
        assert row["plain"][row["best_plain"]]["ms_per_step"] == fastest
        assert row["ratio_best"] == fastest / row["mgpu"]["ms_per_step"]


@pytest.mark.bench
def test_engines_quick_runs_every_core_engine_on_two_processes(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # --quick's few steps, but the count given on the command line (before, --quick replaced it)
    command = ["bench/engines.py", "--quick", "--models", "gpt2_small", "--steps", "3"]
    result = run([*torchrun, *command], tmp_path)
    assert result["world_size"] == 2 and result["steps"] == 3 and result["rounds"] == 1
    rows = {r["engine"]: r for r in result["rows"]}
    assert set(rows) == {"none", "torch_ddp", "torch_ddp_tuned", "mgpu", "mgpu_sharded"}, rows
    assert all(r["step_ms"] > 0 for r in rows.values())
    assert all(r["setup_s"] > 0 for r in rows.values())  # building and warming up took time
    assert rows["mgpu_sharded"]["exposed_comm_ms"] is not None


@pytest.mark.bench
def test_scaling_quick_writes_efficiency_and_ddp_ratios_per_job(tmp_path):
    """bench/scaling.py on the CPU: one torchrun of engines.py per model and mode, summarized
    as the ratios of the steps its jobs measured (recomputed here from the rows). A job that
    ends early (GPT-2 XL's second engine here: CUDA graphs required on a CPU) keeps the engines
    it finished, and the script says which jobs did not finish, exiting non-zero."""
    scaling = [sys.executable, "bench/scaling.py", "--quick", "--models", "gpt2_small", "gpt2_xl"]
    scaling += ["--xl-engines", "none", "mgpu_graphs", "--out", str(tmp_path)]
    proc = subprocess.run(scaling, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode != 0 and "jobs that did not finish: gpt2_xl_2" in proc.stderr
    (written,) = tmp_path.glob("scaling-*.json")
    record = json.loads(written.read_text())
    jobs = {j["key"]: j for j in record["jobs"]}
    assert set(jobs) == {"gpt2_small_compiled_2", "gpt2_small_eager_2", "gpt2_xl_2"}
    xl = jobs.pop("gpt2_xl_2")
    assert xl["status"].startswith("exit 1; kept the engines it finished")
    assert [r["engine"] for r in xl["rows"]] == ["none"] and xl["rows"][0]["step_ms"] > 0
    assert all(j["status"] == "ok" and j["wall_s"] > 0 for j in jobs.values())
    for job in jobs.values():
        steps = {r["engine"]: r["step_ms"] for r in job["rows"]}
        key = job["key"]
        mgpu = steps[record["engine"][key]]
        assert record["efficiency"][key] == pytest.approx(steps["none"] / mgpu, rel=1e-3)
        ddp = min(steps["torch_ddp"], steps["torch_ddp_tuned"])
        assert record["vs_ddp"][key] == pytest.approx(ddp / mgpu, rel=1e-3)


@pytest.mark.bench
def test_engines_one_at_a_time_with_micro_batches(tmp_path):
    """GPT-2 XL's path (engines that do not fit a GPU together): each engine built, timed and
    freed in turn, several micro-batches a step; a step's tokens count every micro-batch."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # mgpu twice: its rounds pooled; the reducing micro-batch through the model's own forward
    engines = ["none", "mgpu", "torch_ddp_view", "mgpu", "mgpu_reducing_by_blocks"]
    args = ["--quick", "--models", "gpt2_xl", "--accum", "2", "--one-at-a-time"]
    result = run([*torchrun, "bench/engines.py", *args, "--engines", *engines], tmp_path)
    assert result["accum"] == 2 and result["one_at_a_time"] is True
    rows = {r["engine"]: r for r in result["rows"]}
    assert [r["engine"] for r in result["rows"]] == [
        "none", "mgpu", "torch_ddp_view", "mgpu_reducing_by_blocks"
    ]  # fmt: skip
    # --quick times one round a build
    assert len(rows["mgpu"]["step_ms_all"]) == 2 and len(rows["none"]["step_ms_all"]) == 1
    for r in rows.values():
        tokens = 4 * 32 * 2  # QUICK's gpt2_xl: 4 sequences of 32 tokens, 2 micro-batches
        assert r["per_gpu_throughput"] == pytest.approx(tokens / (r["step_ms"] / 1e3)), r
    assert rows["mgpu"]["exposed_comm_ms"] is not None
    # torch DDP's static graph cannot take micro-steps without the reduction: refused up front
    static = ["--quick", "--accum", "2", "--engines", "torch_ddp_tuned"]
    proc = subprocess.run(
        [sys.executable, "bench/engines.py", *static],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert proc.returncode == 2 and "static graph" in proc.stderr, proc.stderr


@pytest.mark.bench
def test_optim_step_quick_runs(tmp_path):
    result = run([sys.executable, "bench/probes/optim_step.py", "--quick"], tmp_path)
    assert set(result["rows"]) == {"fused", "compiled"}
    assert all(r["ms"] > 0 for r in result["rows"].values())
    # the same arithmetic on the same gradients: the two sides' parameters agree
    assert result["max_abs_diff"] < 1e-5, result["max_abs_diff"]


@pytest.mark.bench
def test_launch_stalls_quick_times_every_launch_beside_each_cases_thread(tmp_path):
    """bench/probes/launch_stalls.py --quick on the CPU (nothing to measure there): the idle and
    pin cases, each in a process of its own, launches timed, the pin thread's batches counted,
    the file named for the CPU it ran on."""
    result = run([sys.executable, "bench/probes/launch_stalls.py", "--quick"], tmp_path)
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == {"idle", "pin"}, result["rows"]
    assert all(r["launches"] > 0 and r["median_us"] > 0 for r in rows.values()), rows
    assert rows["pin"]["batches"] > 0, rows  # the thread beside the launches did its work
    assert all("error" not in r and r["queue"] == "small" for r in rows.values()), rows
    assert result["device"] == "cpu"
    refused = subprocess.run(
        [sys.executable, "bench/probes/launch_stalls.py", "--quick", "--queue", "step"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "drop --queue" in refused.stderr, refused.stderr


@pytest.mark.bench
def test_repeatable_quick_compares_two_deterministic_runs(tmp_path):
    """Two CPU runs of trainer.deterministic=true (the setting end to end through train.py):
    CPU kernels repeat, so they must compare equal, weights and losses."""
    args = [sys.executable, "bench/probes/repeatable.py", "--quick", "--cases", "deterministic"]
    row = run(args, tmp_path)["cases"]["deterministic"]
    assert row["equal"] and row["max_difference"] == 0.0, row
    assert row["first_differing_loss_step"] is None
    assert len(row["step_ms"]) == 2 and min(row["step_ms"]) > 0, row


@pytest.mark.bench
def test_real_images_quick_runs(tmp_path):
    """train.py on one GPU (one process) on a written realistic folder against the synthetic
    reference, tiny shapes: the default share (auto) and a fixed one, a named variant, the
    prepared shards (at auto; --skip leaves out the fixed share's) and the traced twins, and
    the plain image set written beside the realistic one (its default run only); runs without a
    share of their own leave the default alone.
    (Several GPUs: tests/test_real_images_gpus.py.)"""
    cmd = [sys.executable, "bench/real_images.py", "--quick", "--gpus", "1"]
    cmd += ["--mixes", "realistic", "plain", "--cpu-shares", "auto", "0.5"]
    # an override, and a variable that the run's config reads: the run fails without it
    keep = "keep=data.keep_trainer_cores=true,trainer.seed=${oc.env:MGPU_BENCH_SEED},"
    keep += "env:MGPU_BENCH_SEED=3"
    cmd += ["--variant", keep, "--shards", "24", "--trace"]
    cmd += ["--skip", "shards:auto:0.5"]  # the shards run at every share the folder runs at
    cmd += ["--set", "data.worker_nice=1"]  # every run's, the reference's too
    result = run(cmd, tmp_path)
    assert set(result["ratio"]) == {
        "resnet50_b8_1cores",
        "resnet50_b8_1cores_cpu0.5",
        "resnet50_b8_1cores_keep",
        "resnet50_b8_1cores_shards",
        "resnet50_b8_1cores_plain",
    }
    assert result["folder"]["kinds"]["png"] > 0 and result["folder"]["kinds"]["cmyk"] > 0
    plain = result["folders"]["plain"]  # only 500x375 RGB JPEGs
    assert plain["kinds"]["jpeg"] == plain["images"] and set(result["folders"]) == {
        "realistic", "plain"
    }  # fmt: skip
    assert result["shards"]["max_side"] == 24 and result["shards"]["prepare_s"] > 0
    runs = {(r["kind"], r["cpu_decode_share"], r["variant"]): r for r in result["runs"]}
    assert all(r["gpus"] == 1 and r["cmd"].startswith("python ") for r in runs.values()), runs
    assert set(runs) == {
        ("reference", None, ""),
        ("folder", None, ""),  # the plain set: the default path only
        ("folder", "auto", ""),
        ("folder", "0.5", ""),
        ("folder", None, "keep"),
        ("shards", "auto", ""),
        ("reference", None, "traced"),
        ("folder", None, "traced"),
    }, runs
    assert all(r["img_per_s"] > 0 for r in runs.values()), runs
    for r in runs.values():  # every interval's step time, the warm-up's too
        steps = r["series"]["time/step_ms"]
        assert len(steps) == r["intervals"] and all(ms > 0 for _, ms in steps), r["series"]
    assert all("data.worker_nice=1" in r["cmd"] for r in runs.values()), runs
    assert "data.cpu_decode_share=0.5" in runs["folder", "0.5", ""]["cmd"]
    assert "data.cpu_decode_share=auto" in runs["folder", "auto", ""]["cmd"]
    assert "data.keep_trainer_cores=true" in runs["folder", None, "keep"]["cmd"]
    assert "cpu_decode_share" not in runs["folder", None, "keep"]["cmd"]
    assert runs["folder", None, "keep"]["env"] == {"MGPU_BENCH_SEED": "3"}
    assert "MGPU_BENCH_SEED=3" not in runs["folder", None, "keep"]["cmd"]
    assert not runs["shards", "auto", ""]["env"]
    if not torch.cuda.is_available():  # decode=auto decodes in the workers: no share, and why
        assert runs["folder", "auto", ""]["decode_split"] == "0 (nothing is decoded on the GPU)"
    assert "data=image_shards" in runs["shards", "auto", ""]["cmd"]
    assert runs["folder", None, ""]["mix"] == "plain" and "images_plain" in runs[
        "folder", None, ""]["cmd"]  # fmt: skip
    # every other folder run (variants, shares, shards, traces) trains from the first set
    others = [r for r in runs.values() if r["kind"] != "reference" and r["mix"] != "plain"]
    assert all(r["mix"] == "realistic" for r in others) and len(others) == 5, runs
    assert all("images_plain" not in r["cmd"] for r in others), runs
    for kind in ("reference", "folder"):  # a CPU trace holds no GPU work, but was found
        trace = runs[kind, None, "traced"]["trace"]
        assert trace["path"].endswith(".pt.trace.json") and trace["streams"] == {}, trace


def test_trace_streams_sums_each_streams_kernels_per_step(tmp_path):
    """bench/trace_streams.py on a written trace: the stream busiest with other work than NCCL's
    is the training one, the rest is what ran beside it, per step; the training stream's gaps,
    the collectives' longest kernels and the host's long CUDA calls are listed."""
    sys.path.insert(0, str(ROOT))
    from bench.trace_streams import stream_summary

    def kernel(name, stream, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream}}  # fmt: skip

    events = [kernel("conv", 7, 0, 800), kernel("conv", 7, 900, 800), kernel("gemm", 7, 1700, 300)]
    events += [kernel("_resize_rows", 20, 100, 150), kernel("rgba2rgb", 33, 50, 10)]
    # a collective that waited 2.5 ms for the other rank: busier than the training stream
    events += [kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 0, 2500)]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]
    host = {"ph": "X", "cat": "cuda_runtime", "tid": 9}
    events += [{**host, "name": "cudaMalloc", "ts": -500, "dur": 20}]  # before any GPU work
    events += [{**host, "name": "cudaHostAlloc", "ts": 1000, "dur": 1500}]
    events += [{**host, "name": "cudaLaunchKernel", "ts": 1100, "dur": 5}]
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = stream_summary(path, steps=2)
    assert s["streams"]["7"]["main"] and not s["streams"]["50"]["main"]
    assert not s["streams"]["20"]["main"]
    assert s["main_busy_ms_per_step"] == 1.9 / 2
    assert s["side_busy_ms_per_step"] == (0.15 + 0.01 + 2.5) / 2
    assert s["streams"]["7"]["top"][0] == {"name": "conv", "count": 2, "ms_per_step": 0.8}
    assert s["window_ms_per_step"] == 2.5 / 2
    assert s["nccl_longest_ms"] == [2.5] and s["nccl_ms_per_step"] == 2.5 / 2
    # the training stream idle 0.1 ms between its two convs, not between conv and gemm
    assert s["main_longest_gaps_ms"] == [0.1] and s["main_gaps_ms_per_step"] == 0.1 / 2
    stall = {"name": "cudaHostAlloc", "thread": 9, "at_ms": 1.5, "ms": 1.5}
    assert s["host_stalls"] == [stall]  # the short calls are not ones; times from the first


def test_powersgd_engine_is_timed_only_over_its_compressed_steps():
    """torch's PowerSGD all-reduces its first steps uncompressed: engines.py's PowerSGD engine
    warms up over those, so that no timed step is a plain one (however few steps a job times)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # engines.py imports its bench/ siblings
    from bench.engines import ENGINES, warmup_of

    start = ENGINES["torch_ddp_powersgd"].dist.powersgd_start_step
    assert warmup_of("torch_ddp_powersgd", 0) == start and warmup_of("torch_ddp_powersgd", 9) == 9
    assert warmup_of("torch_ddp", 0) == 0 and warmup_of("mgpu", 1) == 1


@pytest.mark.bench
def test_head_loss_quick_checks_every_side_against_fp32(tmp_path):
    result = run([sys.executable, "bench/head_loss.py", "--quick"], tmp_path)
    assert set(result["shapes"]) == {"small", "xl"}
    for shape in result["shapes"].values():
        assert {"logits_eager", "fused"} <= set(shape["sides"]), shape
        # a library that cannot run here is named with its reason, never stood in for
        assert {"liger", "cce"} <= set(shape["sides"]) | set(shape["absent"]), shape
        for side in shape["sides"].values():
            assert side["ms"] > 0
            assert side["loss_abs_diff"] < 1e-3 and side["grad_w_rel_err"] < 2e-2, side


@pytest.mark.bench
def test_vs_plain_quick_runs_the_xl_paths_and_the_loss_comparison(tmp_path):
    """gpt2_xl's stand-in: gradient accumulation and checkpointed blocks on both sides, the
    plain loop freed before mgpu's run; then the loss runs on Python's own sources."""
    xl = tmp_path / "xl"
    command = [sys.executable, "bench/vs_plain.py", "--quick", "--models", "gpt2_xl"]
    result = run([*command, "--modes", "compiled", "--step-only"], xl)
    (row,) = result["rows"]
    assert row["settings"]["grad_accum_steps"] == 2 and not row["settings"]["interleaved"]
    # mgpu's step on the resident batch, built after the plain loop left the device
    assert row["mgpu_step_only"]["ms_per_step"] > 0 and len(row["mgpu_step_only"]["ms_rounds"]) == 2
    # the plain loop's rounds, one before mgpu's run and one after (built again), each with the
    # GPU's state (None on a CPU)
    assert len(row["plain"]["whole"]["ms_rounds"]) == 2 and len(row["gpu_state"]["plain"]) == 2
    assert row["settings"]["activation_checkpointing"] == "blocks"
    assert row["mgpu"]["tokens_per_s"] > 0 and row["plain"]["whole"]["tokens_per_s"] > 0
    loss = tmp_path / "loss"
    stream = "stream:trainer.precision=bf16,model.residual=autocast"  # a labelled run's overrides
    precisions = ["--loss-precisions", "bf16", "fp32", stream]
    result = run([*command, "--loss-steps", "4", *precisions], loss)
    runs = result["runs"]
    assert set(runs) == {"bf16", "fp32", "stream"} and all(r["steps"] == 4 for r in runs.values())
    # the same seed and data in both precisions: the same losses, to bf16's rounding
    assert abs(result["fp32_vs_bf16"]["eval_loss"]) < 0.01, result["fp32_vs_bf16"]
    assert abs(result["stream_vs_bf16"]["eval_loss"]) < 0.01, result["stream_vs_bf16"]
    assert runs["stream"]["overrides"] == ["trainer.precision=bf16", "model.residual=autocast"]


def test_vs_plain_loss_runs_take_labelled_overrides_and_refuse_bad_ones(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # vs_plain imports its neighbours so
    from vs_plain import loss_run

    assert loss_run("fp8") == ("fp8", ["trainer.precision=fp8"])
    skip = "trainer.fp8_skip=[attn.c_proj,c_fc]"
    assert loss_run(f"s:trainer.precision=fp8,{skip}") == ("s", ["trainer.precision=fp8", skip])
    for bad in ("s:", ":model.residual=autocast", "s:model.residual"):
        with pytest.raises(SystemExit, match="LABEL:KEY=VALUE"):
            loss_run(bad)
    proc = subprocess.run(
        [sys.executable, "bench/vs_plain.py", "--loss-steps", "2", "--loss-precisions", "bf16",
         "bf16:model.residual=autocast"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 2 and "each run needs its own label" in proc.stderr, proc.stderr


def test_profile_tables_group_kernels_by_what_bounds_a_step(monkeypatch):
    """vs_plain --profile's and engines --kernels' groups: attention kernels (whose names
    carry cutlass types) before the matrix multiplies, inductor's matrix-multiply templates
    among the multiplies, its fused kernels apart whatever ops their names fuse (but the
    logits' softmax, the head's loss), and an unknown kernel under `other`, never dropped."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.profile_tables import kernel_group

    names = {
        "void flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, cutlass::bfloat16_t>>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80": "attention",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "triton_tem_fused_mm_t_12": "matmul",
        "loss_grad_rows_0d1d2d": "head_loss",
        "triton_red_fused__log_softmax_3": "head_loss",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "triton_poi_fused_add_gelu_native_layer_norm_7": "inductor_fused",
        "triton_poi_fused__scaled_dot_product_flash_attention_transpose_3": "inductor_fused",
        "Memcpy DtoD (Device -> Device)": "copy_memset",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "nccl",
        "void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>": "other",
    }
    assert {name: kernel_group(name) for name in names} == names


@pytest.mark.bench
def test_fp8_layers_quick_times_bf16_and_each_fp8_variant(tmp_path):
    result = run([sys.executable, "bench/probes/fp8_layers.py", "--quick"], tmp_path)
    runs = result["runs"]
    assert runs["bf16"]["ms"] > 0 and result["one_block_bf16"]["layers"] == 1
    if result["torchao"] is None:  # fp8 variants need torchao (pip install -e '.[fp8]')
        assert set(runs) == {"bf16"}
        return
    for name, r in runs.items():
        if name.startswith("rowwise") and "error" in r:
            continue  # the row-wise recipes need a GPU on some torch releases (test_fp8 says why)
        assert r["ms"] > 0 and abs(r["loss"] - runs["bf16"]["loss"]) < 0.05, (name, r)


@pytest.mark.bench
def test_fp8_layers_times_the_dtype_layouts_over_micro_steps(tmp_path):
    """The layouts' own paths (bf16 stream, bf16 parameters, fp32 master weights fed by
    gradient hooks) train near bf16 over two micro-steps a step."""
    layouts = ["bf16_residual", "bf16_params", "bf16_params_fp32_grads"]
    command = [
        sys.executable,
        "bench/probes/fp8_layers.py",
        "--quick",
        "--accum",
        "2",
        "--variants",
    ]
    result = run([*command, "bf16", *layouts], tmp_path)
    runs = result["runs"]
    assert set(runs) == {"bf16", *layouts} and result["args"]["accum"] == 2
    for name in ["bf16", *layouts]:
        r = runs[name]
        assert "error" not in r and r["weights_moved"], (name, r)  # AdamW reached the weights
        assert r["ms"] > 0 and abs(r["loss"] - runs["bf16"]["loss"]) < 0.05, (name, r)
    bf16 = {name for name in runs if name.startswith("bf16_params")}
    assert {n: runs[n]["param_dtype"] for n in runs} == {
        n: "torch.bfloat16" if n in bf16 else "torch.float32" for n in runs
    }


def scripts() -> list[str]:
    """Every script of bench/ and bench/probes/, as its README row names it."""
    found = [*(ROOT / "bench").glob("*.py"), *(ROOT / "bench").glob("*.sh")]
    found += (ROOT / "bench" / "probes").glob("*.py")
    return sorted(str(p.relative_to(ROOT / "bench")) for p in found)


def test_every_benchmark_has_one_readme_row_and_a_help():
    """Each script is listed once in bench/README.md, and each that runs (a __main__ guard; a
    shell script) answers --help: read from the source, since running fifteen --help's, each
    importing torch, would cost the suite a minute (test_docs runs those the guide names)."""
    readme = (ROOT / "bench" / "README.md").read_text()
    rows = {name: readme.count(f"\n| `{name}` |") for name in scripts()}
    assert all(n == 1 for n in rows.values()), rows
    no_help = []
    for name in scripts():
        source = (ROOT / "bench" / name).read_text()
        if name.endswith(".sh"):
            ok = '"--help"' in source
        else:
            ok = "__main__" not in source or "ArgumentParser(" in source
        no_help += [] if ok else [name]
    assert not no_help


def load_scaling():
    spec = importlib.util.spec_from_file_location("scaling", ROOT / "bench" / "scaling.py")
    scaling = importlib.util.module_from_spec(spec)
    sys.modules["scaling"] = scaling  # its dataclasses look their module up
    spec.loader.exec_module(scaling)
    return scaling


@pytest.mark.parametrize(
    "args, said",
    [
        (["--models", "nosuch"], "--models: invalid choice: 'nosuch'"),
        (["--steps", "0"], "--steps: '0': give a whole number of at least 1"),
        (["--rounds", "0"], "--rounds: '0': give a whole number of at least 1"),
        (["--warmup", "0"], "--warmup: '0': give a whole number of at least 1"),
        (["--xl-accum", "0"], "--xl-accum: '0': give a whole number of at least 1"),
        (["--job-timeout-s", "0"], "--job-timeout-s: '0': give a whole number of at least 1"),
    ],
)
def test_scaling_refuses_what_no_job_could_run_before_any_starts(
    tmp_path, monkeypatch, capsys, args, said
):
    """Under --quick as without it: before, a model no job knew started every job anyway, and
    engines.py --quick ran 2 steps and 1 round for a 0, recorded as --steps 0."""
    scaling = load_scaling()
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["scaling.py", "--quick", *args, "--out", str(out)])
    monkeypatch.setattr(scaling, "run_all", None)  # a job started is a TypeError here
    with pytest.raises(SystemExit) as stop:
        scaling.main()
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"scaling.py: error: argument {said}"), last
    assert not out.exists()


def test_scaling_names_the_models_engines_builds():
    """Read from engines.py's source: importing it costs torch and mgpu."""
    source = ast.parse((ROOT / "bench" / "engines.py").read_text())
    (models,) = [
        node.value
        for node in source.body
        if isinstance(node, ast.Assign) and "MODELS" in [getattr(t, "id", "") for t in node.targets]
    ]
    assert set(load_scaling().MODELS) == {key.value for key in models.keys}


def test_scaling_plans_side_by_side_jobs_on_gpus_and_cores_of_their_own():
    """On a 4-GPU machine, 2-GPU jobs start first, the longest first (XL, then compiled), two at
    a time on aligned GPU pairs with each pair's share of the host's cores; 4-GPU jobs wait for
    the whole machine."""
    scaling = load_scaling()
    jobs = [scaling.Job(m, n, mode) for m in ("gpt2_small", "resnet50") for mode in
            ("compiled", "eager") for n in (2, 4)] + [scaling.Job("gpt2_xl", n, "compiled")
                                                      for n in (2, 4)]  # fmt: skip
    keys = [j.key for j in scaling.order(jobs)]
    assert keys[:5] == [
        "gpt2_xl_2", "gpt2_small_compiled_2", "resnet50_compiled_2",
        "gpt2_small_eager_2", "resnet50_eager_2",
    ]  # fmt: skip
    assert keys[5] == "gpt2_xl_4" and len(keys) == 10
    assert scaling.place([0, 1, 2, 3], 2) == [0, 1]
    assert scaling.place([2, 3], 2) == [2, 3]
    assert scaling.place([1, 2], 2) is None  # not aligned: GPUs 1-2 are left for later
    assert scaling.place([0, 1, 2], 4) is None
    assert scaling.place([0, 1, 2, 3], 4) == [0, 1, 2, 3]
    cpus = list(range(64))
    assert scaling.cores_of([2, 3], 4, cpus) == list(range(32, 64))
    assert scaling.cores_of([0, 1, 2, 3], 4, cpus) == cpus
    assert scaling.cores_of([2, 3], 4, [0, 1]) == [0, 1]  # fewer cores than GPUs: all of them
