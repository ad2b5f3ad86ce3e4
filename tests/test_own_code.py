"""A user's own model from the user's own folder: `model._target_=mypkg.nets.TwoLayer`, started
from the folder that holds mypkg/, under torchrun as users launch it, with train.py elsewhere."""

import torch
from conftest import run_train

NETS = """
from torch import nn


class TwoLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 8 * 8, width), nn.ReLU(), nn.Linear(width, 10)
        )

    def forward(self, x):
        return self.net(x)
"""


def test_a_model_from_the_working_directory_trains(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(NETS)
    run_dir = tmp_path / "run"
    args = ["model=custom", "model._target_=mypkg.nets.TwoLayer", "+model.kwargs.width=16"]
    args += ["data=images", "data.image_size=8", "data.num_workers=0", "optim=sgd"]
    args += ["trainer.max_steps=2", "trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    proc = run_train(args, cwd=tmp_path, nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(next(run_dir.glob("checkpoints/*/state.pt")), weights_only=True)
    assert state["model"]["net.1.weight"].shape == (16, 3 * 8 * 8)  # the user's model trained
