"""bench/scaling_model.py: the analytic step model behaves as its formula says (on the CPU)."""

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import ROOT

spec = importlib.util.spec_from_file_location("scaling_model", ROOT / "bench/scaling_model.py")
sm = importlib.util.module_from_spec(spec)
sys.modules["scaling_model"] = sm
spec.loader.exec_module(sm)

K = 0.3  # a slowdown of the size the fit finds; the properties hold for any k >= 0


def eff(name, nodes, link, k=K):
    return sm.project(name, sm.COMPUTE[name][0], nodes, link, sm.Setting(), k)["efficiency"]


@pytest.mark.parametrize("name", sorted(sm.MODELS))
def test_efficiency_falls_as_nodes_grow_and_links_slow(name):
    for link in (100, 200, 400):
        by_nodes = [eff(name, n, link) for n in (1, 2, 8, 64)]
        assert by_nodes == sorted(by_nodes, reverse=True) and by_nodes[0] > by_nodes[-1]
    for nodes in (2, 8, 64):
        by_link = [eff(name, nodes, link) for link in (100, 200, 400)]
        assert by_link == sorted(by_link) and by_link[0] < by_link[-1]


def test_bf16_wire_halves_the_bandwidth_term():
    """bf16 at the same bucket sizes: the same per-call latency, half the bytes' time."""
    m = sm.MODELS["gpt2_small"]
    for nodes, link in ((1, None), (8, 100), (64, 400)):
        fp32 = sm.step(m, 31.0, nodes * 8, nodes, link, sm.Setting(), K)["comm_ms"]
        bf16 = sm.step(m, 31.0, nodes * 8, nodes, link, sm.Setting(wire_bytes=2), K)["comm_ms"]
        calls = len(sm.buckets(m, 25.0)) * sm.allreduce_ms(0.0, nodes * 8, nodes, link)
        assert bf16 - calls == pytest.approx((fp32 - calls) / 2, rel=0.15)
    # across nodes the NIC bounds the bus bandwidth at every size: exactly half
    big = 1e9
    assert sm.allreduce_ms(big / 2, 64, 8, 100) - sm.allreduce_ms(0, 64, 8, 100) == pytest.approx(
        (sm.allreduce_ms(big, 64, 8, 100) - sm.allreduce_ms(0, 64, 8, 100)) / 2
    )


def test_accumulation_reduces_the_communication_share():
    m = sm.MODELS["gpt2_small"]
    runs = [sm.step(m, 31.35, 64, 8, 100, sm.Setting(accum=a), K) for a in (1, 2, 4, 8)]
    assert all(r["comm_ms"] == pytest.approx(runs[0]["comm_ms"]) for r in runs)  # once a step
    shares = [(r["step_ms"] - r["compute_ms"]) / r["step_ms"] for r in runs]
    assert shares == sorted(shares, reverse=True) and shares[-1] < shares[0] / 2


def test_a_measured_point_is_predicted_by_the_formula():
    """Recomputed by hand for the no-overlap point (no slowdown term): one all-reduce per bucket
    after backward, 2(n-1)/n * bytes / busbw each, busbw interpolated in GPU.md's figures."""
    (p,) = [p for p in sm.POINTS if p.key == "2gpu_slow_gpt2_small_no_overlap"]
    sizes = sm.buckets(sm.MODELS[p.model], 25.0)
    comm = sum(sm.ALPHA_MS + 2 * (2 - 1) / 2 * e * 4 / (27.0e9) * 1e3 for e in sizes)
    assert sm.predict_point(p, K)["efficiency"] == pytest.approx(46.6 / (46.6 + comm))
    assert sum(sizes) == pytest.approx(sm.MODELS["gpt2_small"].params)
    # the NVLink curve passes through its measured figures
    assert sm.nvlink_busbw(64) == 270.0 and sm.nvlink_busbw(1024) == 330.0
    assert 222.0 < sm.nvlink_busbw(25) < 270.0
    # the two-node stand-in: its socket bounds the 4-rank ring at every size
    (q,) = [p for p in sm.POINTS if p.key == "2x2_socket_resnet50_ddp"]
    assert sm.allreduce_ms(64e6, 4, 1, None, q.intra) == pytest.approx(
        sm.ALPHA_MS + 1.5 * 64e6 / 4.30e9 * 1e3
    )
    # a job that probed its own link is checked at that link's figures, not the table's
    (x,) = [p for p in sm.POINTS if p.key.endswith("_sockets4x4")]
    assert sm.allreduce_ms(256e6, 4, 1, None, x.intra) == pytest.approx(
        sm.ALPHA_MS + 1.5 * 256e6 / 16.64e9 * 1e3
    )


def test_the_fitted_slowdown_is_least_squares_over_the_fit_points():
    fit = [p for p in sm.POINTS if p.fit]
    k = sm.fit_slowdown(fit)

    def sse(k):  # squared error of the step time against the measured one (range: its middle)
        measured = [p.one_gpu_ms / (sum(p.measured) / 2) for p in fit]
        return sum(
            (sm.predict_point(p, k)["step_ms"] - ms) ** 2
            for p, ms in zip(fit, measured, strict=True)
        )

    assert 0 < k < 1
    assert sse(k) <= min(sse(k - 0.02), sse(k + 0.02))


def test_exposed_includes_the_tied_embedding_at_backwards_end():
    m = sm.MODELS["gpt2_small"]
    r = sm.step(m, 31.35, 16, 2, 100, sm.Setting(), 0.0)
    last = sm.allreduce_ms(m.last_params * 4, 16, 2, 100)
    assert r["exposed_ms"] >= last


def test_help_and_a_run_that_writes_its_json(tmp_path):
    script = str(ROOT / "bench/scaling_model.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--out" in out.stdout
    proc = subprocess.run(
        [sys.executable, script, "--nodes", "1", "8", "--step-ms", "gpt2_small=35.5"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    (written,) = tmp_path.glob("scaling_model-*.json")
    result = json.loads(written.read_text())
    assert {r["nodes"] for r in result["table"]} == {1, 8}
    assert len(result["table"]) == 3 * 3 * 2 and result["check"]
    assert result["compute"]["gpt2_small"] == {"one_gpu_ms": 35.5, "source": "--step-ms"}
    across = result["measured_across_nodes"]
    # every point measured over the two-node stand-in's sockets (at the table's link or its
    # own job's probe of it), and no other
    over_sockets = {p.key for p in sm.POINTS if p.intra == sm.SOCK or isinstance(p.intra, tuple)}
    assert {r["key"] for r in across} == over_sockets
    assert len(across) >= 4
    assert "Predicted against measured" in proc.stdout


def test_the_tables_default_is_what_mgpu_does_with_a_compiled_model():
    """The table projects mgpu's defaults: a compiled model is compiled whole (nothing reduced
    while backward runs) in dist.bucket_cap_mb=auto's buckets for that, as DistConfig resolves
    them on one node and across nodes; the recommendation starts from that default."""
    from mgpu.config.schema import DistConfig

    auto = DistConfig()
    for nodes in (1, 2, 64):
        s = sm.mgpu_default(nodes)
        assert not s.overlap and s.wire_bytes == 4
        assert s.bucket_mb == auto.bucket_cap(True, one_node=nodes == 1, whole=True)
    rows = sm.table(sm.COMPUTE, [1, 8], [100, 400], K)
    for r in rows:
        ms, link = sm.COMPUTE[r["model"]][0], r["link_gbps"]
        default = sm.project(r["model"], ms, r["nodes"], link, sm.mgpu_default(r["nodes"]), K)
        assert r["default"] == round(default["efficiency"], 4)
        # the recommendation (sharded where it picks sharding) never falls below the default
        assert r["recommended"]["efficiency"] >= r["default"]


@pytest.mark.parametrize(
    "args, said",
    [
        (["--nodes", "0", "-2"], "--nodes: '0': give a whole number of nodes, at least 1"),
        (["--links", "-5"], "--links: '-5': give a bandwidth in Gb/s, a number above 0"),
        (["--links", "0"], "--links: '0': give a bandwidth"),  # was a ZeroDivisionError
        (["--step-ms", "gpt2_small=-3"], "--step-ms: 'gpt2_small=-3': give MODEL=MS, MS the"),
        (["--step-ms", "foo=3"], "--step-ms: 'foo=3': give MODEL=MS, MODEL one of gpt2_small,"),
        (["--step-ms", "gpt2_small"], "--step-ms: 'gpt2_small': give MODEL=MS"),  # a ValueError
        (["--slowdown", "-1"], "--slowdown: '-1': give compute ms per comm ms, 0 or more"),
    ],
)
def test_arguments_that_cannot_be_are_refused_in_one_line(monkeypatch, capsys, args, said):
    """Before, these printed an efficiency of 1 for 0 nodes or one below 0 for a negative link,
    or ended in a traceback."""
    monkeypatch.setattr(sys, "argv", ["scaling_model.py", *args])
    with pytest.raises(SystemExit) as stop:
        sm.parse_args()
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"scaling_model.py: error: argument {said}"), last
