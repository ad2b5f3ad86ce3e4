"""dist.nccl_high_priority and dist.nccl_max_ctas (mgpu.comm.groups): refused where they cannot
work, before any training, with the key, the value and the fix. Their effect on NCCL's streams
is checked on GPUs (test_reducer_gpu.py's mgpu_graphs_priority)."""

import pytest
import torch
from conftest import one_line_under_torchrun, run_train

from mgpu.comm.groups import comm_group, comm_stream
from mgpu.config.checks import ConfigError
from mgpu.config.schema import DistConfig, Engine
from mgpu.runtime.dist import Runtime


def test_high_priority_is_mgpus_reducer_setting_only():
    DistConfig(engine=Engine.mgpu, nccl_high_priority=True)
    with pytest.raises(ConfigError, match=r"dist.nccl_high_priority=True: .*set it false"):
        DistConfig(engine=Engine.torch_ddp, nccl_high_priority=True)


@pytest.mark.parametrize(
    "cfg, said",
    [
        (DistConfig(nccl_high_priority=True), "dist.nccl_high_priority=True: needs the nccl "
         "backend, not gloo; set dist.nccl_high_priority=false"),
        (DistConfig(nccl_max_ctas=4), "dist.nccl_max_ctas=4: needs the nccl backend, not gloo; "
         "set dist.nccl_max_ctas=0"),
    ],
    ids=["high_priority", "max_ctas"],
)  # fmt: skip
def test_an_nccl_setting_on_gloo_names_the_key_and_the_fix(cfg, said):
    # Refused before any collective: no process group is needed to see it
    rt = Runtime(0, 0, 2, "gloo", torch.device("cpu"), has_process_group=False)
    with pytest.raises(ConfigError) as err:
        comm_group(rt, cfg)
    assert str(err.value) == said
    assert comm_group(rt, DistConfig()) is None  # neither set: the default group
    assert comm_stream(rt, cfg) is None  # no stream on a CPU


def test_train_py_on_cpus_stops_before_training_saying_so(tmp_path):
    """Known once the backend is (dist.backend=auto: gloo on CPUs): one line, exit code 2 from
    each rank, no training step."""
    run = ["dist.nccl_high_priority=true", "trainer.max_steps=2", "data.num_workers=0"]
    proc = run_train([*run, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, nproc=2)
    said = "dist.nccl_high_priority=True: needs the nccl backend, not gloo"
    one_line_under_torchrun(proc, None, prefix=said)
    assert "step 1/" not in proc.stdout + proc.stderr
