"""dist.cpu_affinity=auto: each rank pinned to its own block of the node's CPUs where DataLoader
workers decode the user's images, off elsewhere; a given true or false is kept. The pinning
itself is tests/test_launch.py's (test_cpu_affinity_gives_each_worker_its_own_block_of_cpus)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from test_image_folder import write_tree

from mgpu.config.checks import ConfigError
from mgpu.config.schema import DistConfig
from mgpu.run.config import to_config

CONF = Path(__file__).resolve().parents[1] / "conf"


def pins(overrides: list[str], local_ranks: int = 2) -> bool:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config(compose("config", overrides)).pins_cpus(local_ranks)


def test_auto_pins_ranks_that_decode_images_and_keeps_a_given_setting(tmp_path):
    write_tree(tmp_path / "train", per_class=4)
    folder = ["model=resnet_tiny", "data=image_folder", f"data.path={tmp_path / 'train'}"]
    folder += ["data.eval_samples=2"]
    assert pins(folder)
    assert not pins([*folder, "dist.cpu_affinity=false"])
    assert not pins([])  # data=ngram: nothing decoded
    assert not pins(["model=resnet_tiny", "data=images"])  # synthetic: no file read
    assert pins(["dist.cpu_affinity=true"])
    # more ranks on the node than CPUs it may use: auto stays off (true would stop, saying so)
    assert not pins(folder, local_ranks=len(os.sched_getaffinity(0)) + 1)


@pytest.mark.parametrize("bad", ["sometimes", 2])
def test_a_bad_cpu_affinity_names_the_key_and_its_values(bad):
    with pytest.raises(ConfigError, match=r"dist.cpu_affinity.*auto, true or false"):
        DistConfig(cpu_affinity=bad)
