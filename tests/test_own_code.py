"""A user's own model and dataset from the user's own folder: `model._target_=mypkg.nets.TwoLayer
data._target_=mypkg.data.Pixels`, started from the folder that holds mypkg/, with train.py
elsewhere, the dataset read by a DataLoader worker. Both record the state of Python's garbage
collector in the process they run in: train.py holds collection back while the run starts and
turns it on (start-up's objects frozen) before the first step, never in a worker."""

import json

import pytest
import torch
from conftest import run_train

from mgpu.export import main as export_main

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


def test_a_model_and_dataset_from_the_working_directory_train(tmp_path, monkeypatch):
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
    # exported from the same folder: its inputs are the data set's own, not token ids
    monkeypatch.syspath_prepend(str(tmp_path))
    export_main([str(run_dir), str(tmp_path / "m.safetensors")])
    inputs = json.loads((tmp_path / "m.json").read_text())["inputs"]
    assert inputs.startswith("the inputs mypkg.data.Pixels's items hold"), inputs


@pytest.mark.parametrize(
    "wrong, said",
    [
        (
            "+model.kwargs.widht=16",
            "takes no argument 'widht' (did you mean width?) and needs 'width'",
        ),
        ("+data.kwargs.bogus=1", "Pixels takes no argument 'bogus'; it takes ['record']"),
        # a value that does not fit the parameter's annotation (width: int)
        ("+model.kwargs.width=abc", "TwoLayer takes width: int, and str is not one; give +"),
    ],
)
def test_arguments_that_do_not_fit_a_users_class_are_one_line_before_any_run(tmp_path, wrong, said):
    """A misspelt, unknown, missing or mistyped argument of the user's model or dataset: one
    line naming the key and what the class takes, exit 2, no run directory (not a TypeError
    traceback from every rank after the run started)."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(NETS)
    (tmp_path / "mypkg" / "data.py").write_text(DATA)
    given = {"+model.kwargs.width=16", f"+model.kwargs.record={tmp_path}"}
    if wrong.startswith("+model.kwargs.wid"):
        given = {wrong if a.startswith("+model.kwargs.width") else a for a in given}
    else:
        given.add(wrong)
    args = ["model=custom", "model._target_=mypkg.nets.TwoLayer", *sorted(given), "data=custom"]
    args += ["data._target_=mypkg.data.Pixels", f"+data.kwargs.record={tmp_path}", "optim=sgd"]
    proc = run_train(args, cwd=tmp_path, nproc=None, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert said in line and "+" in line and "kwargs" in line, line
    assert not (tmp_path / "outputs").exists()


class _DictOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return {"logits": self.linear(x)}


class _LogitsAndLoss(_DictOut):
    computes_loss = True  # nanoGPT's pattern: forward(x, y) returns (logits, loss)

    def forward(self, x, y):
        logits = self.linear(x)
        return logits, torch.nn.functional.cross_entropy(logits, y)


def test_a_model_that_breaks_the_forward_contract_is_one_line_naming_it():
    """A model whose forward returns a dict (or a tuple) of logits, or one that computes its
    own loss and returns (logits, loss): a config error naming the class and what to return,
    where the loss or the division by the micro-batches failed deep in the step."""
    from mgpu.config.checks import ConfigError
    from mgpu.models.loss import cross_entropy
    from mgpu.train.model_loss import ModelLoss

    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    with pytest.raises(ConfigError) as err:
        ModelLoss(_DictOut(), cross_entropy)(x, y)
    assert str(err.value).startswith("model='_DictOut': its forward returned a dict, not a tensor")
    with pytest.raises(ConfigError) as err:
        ModelLoss(_LogitsAndLoss(), None)(x, y)
    said = str(err.value)
    assert "forward(inputs, targets) returned a tuple, not the loss: return the loss alone" in said


def test_a_model_with_nothing_to_train_is_one_line_naming_it():
    """No parameter that requires grad (none at all, or all frozen): the optimizer's build says
    so, where autograd's "element 0 of tensors does not require grad" came at the first step."""
    from mgpu.config.checks import ConfigError
    from mgpu.config.schema import OptimConfig
    from mgpu.optim.optimizer import build_optimizer

    frozen = _DictOut().requires_grad_(False)
    for model in (torch.nn.Identity(), frozen):
        with pytest.raises(ConfigError) as err:
            build_optimizer(OptimConfig(), model, torch.device("cpu"))
        said = str(err.value)
        assert said.startswith(f"model='{type(model).__name__}': has no parameters that require")


DICT_DATA = """
import torch


class Named(torch.utils.data.Dataset):
    def __init__(self, split: str):
        pass

    def __len__(self):
        return 32

    def __getitem__(self, index):
        return {"inputs": torch.rand(3, 8, 8), "targets": index % 10}
"""


def test_a_data_set_of_dict_items_stops_at_its_first_batch_in_one_line(tmp_path):
    """Items as dicts: the default collate makes dict batches, whose keys an (inputs, targets)
    unpacking handed the model as its inputs (a str, failing in the user's own layers). The
    first batch, which every rank reads before the first step, says it: one line, exit 2."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(NETS)
    (tmp_path / "mypkg" / "data.py").write_text(DICT_DATA)
    args = ["model=custom", "model._target_=mypkg.nets.TwoLayer", "+model.kwargs.width=16"]
    args += [f"+model.kwargs.record={tmp_path}", "data=custom", "data._target_=mypkg.data.Named"]
    args += ["data.batch_size=8", "data.num_workers=0", "optim=sgd", "trainer.max_steps=2"]
    proc = run_train([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, nproc=None)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "are dicts" in line]
    assert len(said) == 1 and "data=['inputs', 'targets']: the data set's batches" in said[0]
    assert "Traceback" not in proc.stdout + proc.stderr
