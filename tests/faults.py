"""Faults for end-to-end tests, injected through the plug-in points users have (`data=custom`,
`model=custom`): n-gram token datasets that, on one rank and once (a marker file remembers),
kill their own process, signal it or the torchrun agent, or hang, at a chosen sample; a dataset
that records the indices it served; a GPT whose loss turns NaN."""

import os
import signal
import time
from pathlib import Path

import torch

from mgpu.data import NgramTokens
from mgpu.models import GPT


def first_sample_of_step(step: int, batch_size: int) -> int:
    """The 1-based count of samples a rank has fetched when it fetches step `step`'s first one
    (data.num_workers=0: fetching happens in the training process, when the step asks)."""
    return (step - 1) * batch_size + 1


def agent_pid() -> int:
    """The torchrun agent: the training process's parent. In a DataLoader worker the training
    process is the parent, so the agent is one level further up (read from /proc)."""
    from torch.utils.data import get_worker_info

    if get_worker_info() is None:
        return os.getppid()
    with open(f"/proc/{os.getppid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # field 4, ppid


class FaultyTokens(NgramTokens):
    """NgramTokens whose rank `rank` (RANK, 0 without torchrun) meets `fault` while fetching its
    `at_sample`-th training sample, unless `marker` exists; the fault creates it first.

    kill: SIGKILL to itself, as the OOM killer or a node failure would.
    term_agent: SIGTERM to its parent, the torchrun agent, as a scheduler's preemption would.
    term_self: SIGTERM to itself (a world of one, without torchrun).
    hang: stop forever, as a rank stuck in a dead collective or a deadlock would. SIGTERM gets
    its default action back first: the handler mgpu installs would wait for a step boundary that
    never comes, and torchrun would end this process only after its 30-s shutdown timeout.
    """

    def __init__(self, split: str, *, fault: str, rank: int, at_sample: int, marker: str, **kw):
        super().__init__(split, **kw)
        self.train = split == "train"
        self.fault, self.fault_rank, self.at_sample = fault, rank, at_sample
        self.marker = Path(marker)
        self.served = 0

    def __getitem__(self, index: int):
        if self.train and int(os.environ.get("RANK", "0")) == self.fault_rank:
            self.served += 1
            if self.served == self.at_sample and not self.marker.exists():
                self.marker.touch()
                self._inject()
        return super().__getitem__(index)

    def _inject(self) -> None:
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "term_agent":
            os.kill(agent_pid(), signal.SIGTERM)
        elif self.fault == "term_self":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.fault == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(60)
        else:
            raise ValueError(f"unknown fault {self.fault!r}")


class RecordingTokens(NgramTokens):
    """NgramTokens that append each training index they serve to `<record>/<pid>.txt`."""

    def __init__(self, split: str, *, record: str, **kw):
        super().__init__(split, **kw)
        self.file = Path(record) / f"{os.getpid()}.txt" if split == "train" else None

    def __getitem__(self, index: int):
        if self.file is not None:
            with open(self.file, "a") as f:
                f.write(f"{index}\n")
        return super().__getitem__(index)


def recorded(record: Path) -> list[list[int]]:
    """Each process's served indices, in order, one list per process."""
    return [[int(x) for x in p.read_text().split()] for p in sorted(record.glob("*.txt"))]


class NanGPT(GPT):
    """A GPT whose logits turn NaN from its `nan_from`-th training forward on."""

    def __init__(self, *, nan_from: int, **kw):
        super().__init__(**kw)
        self.nan_from, self.forwards = nan_from, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx)
        if self.training:
            self.forwards += 1
            if self.forwards >= self.nan_from:
                logits = logits * float("nan")
        return logits
