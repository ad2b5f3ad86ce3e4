"""bench/real_images.py on several GPUs: each run under torchrun (here 2 processes over gloo on
the CPU), its reference on as many processes, keys that name the GPU count, every rank's data
wait; and the CPUs a job of G GPUs x N cores is pinned to. (The plain image set beside the
realistic one, and its key: tests/test_bench.py's one-process run, where a run costs a third.)"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.bench
def test_two_processes_under_torchrun(tmp_path):
    cmd = [sys.executable, "bench/real_images.py", "--quick", "--gpus", "2"]
    cmd += ["--out", str(tmp_path)]  # --quick's one image set: realistic
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (written,) = tmp_path.glob("real_images-*.json")
    result = json.loads(written.read_text())
    assert set(result["ratio"]) == {"resnet50_b8_1cores_2gpu"}
    assert result["gpus"] == [2] and result["host_cpus"]["count"] > 0
    assert set(result["folders"]) == {"realistic"} and result["folder"]["kinds"]["png"] > 0
    runs = {(r["kind"], r["mix"]): r for r in result["runs"]}
    assert set(runs) == {("reference", "-"), ("folder", "realistic")}, runs
    for row in runs.values():
        assert row["gpus"] == 2 and row["img_per_s"] > 0, row
        assert row["cmd"].startswith("torchrun --standalone --nproc_per_node=2 "), row["cmd"]
        assert row["img_per_s_per_gpu"] == pytest.approx(row["img_per_s"] / 2, rel=1e-3)
        waits = row["rank_data_wait_ms"]  # both ranks' data wait, from the rank spread
        assert waits["min"] <= waits["median"] <= waits["max"], row
        assert row["data_wait_slowest_rank"] in (0, 1), row
    assert "experiment=resnet50 " in runs["reference", "-"]["cmd"]
    assert "images_realistic" in runs["folder", "realistic"]["cmd"]


def test_job_cpus_are_the_first_allowed(monkeypatch):
    """taskset's list for G x N cores: the first CPUs this process may use, as ranges."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # bench.engines imports its neighbours so
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import real_images

    allowed = {0, 1, 2, 3, 8, 9, 10, 40}
    monkeypatch.setattr(real_images.os, "sched_getaffinity", lambda _pid: allowed)
    assert real_images.job_cpus(3) == "0-2"
    assert real_images.job_cpus(6) == "0-3,8-9"
    assert real_images.job_cpus(8) == "0-3,8-10,40"


def test_rounds_take_each_ratio_to_its_own_rounds_reference(monkeypatch):
    """--rounds N: the plan N times in turn, the traced twins once; each run's ratio is to the
    reference of its own round, and a ratio key gets every round's ratio."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import real_images

    plan = [
        ("reference", "-", None, "", ""),
        ("folder", "auto", "auto", "", "plain"),
        ("reference", "-", None, "traced", ""),
    ]
    rounds = real_images.rounds_of(plan, 3)
    assert [r[0] for r in rounds] == [0, 0, 0, 1, 1, 2, 2]
    assert all(r[4] != "traced" for r in rounds[3:]) and rounds[2][4] == "traced"
    results = {
        ("reference", "-", ""): {0: {"img_per_s": 100.0}, 1: {"img_per_s": 200.0}},
        ("folder", "auto", "_plain"): {0: {"img_per_s": 90.0}, 1: {"img_per_s": 190.0}},
        ("shards", "auto", "_plain"): {1: {"img_per_s": 0.0}, 2: {"img_per_s": 50.0}},
    }
    ratios = real_images.round_ratios(results)
    assert ratios == {("folder", "auto", "_plain"): [0.9, 0.95], ("shards", "auto", "_plain"): []}
    assert results["folder", "auto", "_plain"][1]["ratio"] == 0.95
    assert "ratio" not in results["reference", "-", ""][0]


def test_plan_runs_shards_at_each_share_and_leaves_out_what_skip_names(monkeypatch):
    """Shards run at every decode and CPU share the folder runs (a share is meaningless under
    decode=cpu, which runs once); --skip drops a kind at a decode, or at one share of it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.syspath_prepend(str(ROOT))
    from argparse import Namespace

    from bench import real_images

    args = Namespace(
        mixes=["plain"], decodes=["auto", "cpu"], cpu_shares=["auto", "0.3"], variants={},
        trace=False, skip=[],
    )  # fmt: skip
    full = real_images.plan_of(args, {"path": "shards"})
    runs = [(kind, decode, share) for kind, decode, share, _, _ in full]
    expected = [("auto", "auto"), ("auto", "0.3"), ("cpu", "auto")]
    assert runs == [("reference", "-", None)] + [
        (kind, d, x) for kind in ("folder", "shards") for d, x in expected
    ]
    args.skip = ["folder:cpu", "shards:auto:0.3"]
    kept = [(k, d, x) for k, d, x, _, _ in real_images.plan_of(args, {"path": "shards"})]
    assert kept == [
        r for r in runs if r not in {("folder", "cpu", "auto"), ("shards", "auto", "0.3")}
    ]
    assert real_images.plan_of(args, None) == [
        r for r in full if r[0] != "shards" and r[1:3] != ("cpu", "auto")
    ]
