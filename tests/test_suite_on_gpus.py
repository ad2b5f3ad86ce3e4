"""The test suite itself on a machine whose CUDA GPUs are visible (stood in for here by a CUDA
check that answers yes, in every pytest process): the CPU tests are refused in one message that
says how to run them, also under pytest-xdist (README's command on 4 or more GPUs), and a
selection of GPU tests alone goes ahead."""

import os
import re
import subprocess
import sys

from conftest import ROOT

# A pytest plugin (-p), so that xdist's workers load it too: this machine's GPUs, as conftest
# asks for them.
AS_IF_GPUS = "import torch\ntorch.cuda.is_available = lambda: True\n"
REFUSED = re.compile(r"\d+ of the selected tests are CPU tests \(not marked gpu")
HOW = ("CUDA_VISIBLE_DEVICES= python -m pytest -q -m 'not gpu'", "python -m pytest -q -m gpu")


def pytest_as_if_gpus(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "as_if_gpus.py").write_text(AS_IF_GPUS)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    # pytest as a user starts it: not as a worker of this run's pytest-xdist
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "as_if_gpus", "-p", "no:cacheprovider",
         *args, "tests/test_fused_loss.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**env, "PYTHONPATH": path},
    )  # fmt: skip


def test_cpu_tests_beside_gpus_are_refused_saying_how_to_run_them(tmp_path):
    proc = pytest_as_if_gpus(tmp_path, "-n", "0", "--co")
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = proc.stderr.strip()
    assert said.startswith("ERROR: ") and REFUSED.match(said.removeprefix("ERROR: ")), said
    assert all(how in said for how in HOW), said


def test_xdist_workers_refuse_them_in_the_same_words(tmp_path):
    proc = pytest_as_if_gpus(tmp_path, "-n", "1")  # one worker: the path of any number
    said = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 3), said[-3000:]  # 3: an internal error, saying nothing
    assert "INTERNALERROR" not in said, said[-3000:]
    assert REFUSED.search(said) and all(how in said for how in HOW), said[-3000:]
    assert not re.search(r"\d+ (passed|failed)", said), said[-3000:]


def test_the_gpu_tests_alone_are_collected(tmp_path):
    proc = pytest_as_if_gpus(tmp_path, "-n", "0", "--co", "-m", "gpu")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", proc.stdout), proc.stdout
