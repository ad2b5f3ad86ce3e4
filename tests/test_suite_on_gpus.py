"""The test suite itself on a machine whose CUDA GPUs are visible (stood in for here by a CUDA
check that answers yes): the CPU tests are refused in one message that says how to run them, and
a selection of GPU tests alone goes ahead."""

import re
import subprocess
import sys

from conftest import ROOT

AS_IF_GPUS = """
import sys, torch
torch.cuda.is_available = lambda: True  # this machine's GPUs, as conftest asks for them
import pytest
sys.exit(pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", "--co", *sys.argv[1:]]))
"""


def collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", AS_IF_GPUS, *args, "tests/test_fused_loss.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cpu_tests_beside_gpus_are_refused_saying_how_to_run_them():
    proc = collect()
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = proc.stderr.strip()
    assert re.match(r"ERROR: \d+ of the selected tests are CPU tests \(not marked gpu", said), said
    assert "CUDA_VISIBLE_DEVICES= python -m pytest -q -m 'not gpu'" in said
    assert "python -m pytest -q -m gpu" in said


def test_the_gpu_tests_alone_are_collected():
    proc = collect("-m", "gpu")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", proc.stdout), proc.stdout
