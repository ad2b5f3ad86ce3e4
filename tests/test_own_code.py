"""A user's own model and dataset from the user's own folder: `model._target_=mypkg.nets.TwoLayer
data._target_=mypkg.data.Pixels`, started from the folder that holds mypkg/, with train.py
elsewhere, the dataset read by a DataLoader worker. Both record the state of Python's garbage
collector in the process they run in: train.py holds collection back while the run starts and
turns it on (start-up's objects frozen) before the first step, never in a worker."""

import torch
from conftest import run_train

NETS = """
import gc
import os
from pathlib import Path

from torch import nn


class TwoLayer(nn.Module):
    def __init__(self, width: int, record: str):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 8 * 8, width), nn.ReLU(), nn.Linear(width, 10)
        )
        self.record = Path(record)

    def forward(self, x):
        gc_state = f"{gc.isenabled()} {gc.get_freeze_count()}"
        (self.record / f"trainer-{os.getpid()}").write_text(gc_state)
        return self.net(x)
"""

DATA = """
import gc
import os
from pathlib import Path

import torch


class Pixels(torch.utils.data.Dataset):
    def __init__(self, split: str, record: str):
        self.record = Path(record)

    def __len__(self):
        return 64

    def __getitem__(self, index):
        (self.record / f"worker-{os.getpid()}").write_text(f"{gc.isenabled()}")
        pixels = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(index))
        return pixels, index % 10
"""


def test_a_model_and_dataset_from_the_working_directory_train(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(NETS)
    (tmp_path / "mypkg" / "data.py").write_text(DATA)
    record = tmp_path / "record"
    record.mkdir()
    run_dir = tmp_path / "run"
    args = ["model=custom", "model._target_=mypkg.nets.TwoLayer", "+model.kwargs.width=16"]
    args += [f"+model.kwargs.record={record}", "data=custom", "data._target_=mypkg.data.Pixels"]
    args += [f"+data.kwargs.record={record}", "data.batch_size=16", "data.num_workers=1"]
    args += ["optim=sgd", "trainer.max_steps=2", "trainer.eval_every=0"]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=None, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(next(run_dir.glob("checkpoints/*/state.pt")), weights_only=True)
    assert state["model"]["net.1.weight"].shape == (16, 3 * 8 * 8)  # the user's model trained
    said = {path.name.split("-")[0]: path.read_text() for path in record.iterdir()}
    assert set(said) == {"trainer", "worker"}, said  # one training process, its one worker
    enabled, frozen = said["trainer"].split()
    # On at the steps, with what the start made frozen (torch's modules alone are many
    # thousands of objects).
    assert enabled == "True" and int(frozen) > 10_000, said
    assert said["worker"] == "True"
