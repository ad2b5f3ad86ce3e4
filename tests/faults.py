"""Faults for end-to-end tests, injected through the plug-in points users have (`data=custom`,
`model=custom`): n-gram token datasets that, on one rank and once (a marker file remembers),
kill their own process, signal it or the torchrun agent, or hang, at a chosen sample; a dataset
that records the indices it served; a GPT whose loss turns NaN; a GPT that hangs in a forward.
Importing it (as `data._target_=tests.faults...` does) also registers a torch.compile backend,
`trainer.compile_backend=slow_compile`: a compile that takes SLOW_COMPILE_S a graph."""

import os
import signal
import time
from pathlib import Path

import torch

from mgpu.data import NgramTokens
from mgpu.models import GPT

SLOW_COMPILE_S = 2.5


def slow_compile(graph: torch.fx.GraphModule, example_inputs: list) -> object:
    """A compile that takes SLOW_COMPILE_S a graph (as a large model's does minutes), then runs
    the graph as traced, as torch's eager backend does."""
    time.sleep(SLOW_COMPILE_S)
    return graph.forward


# torch's documented way to add a backend; once a process, where this module is imported under
# two names (faults, tests.faults), since a second registration of a name raises.
if "slow_compile" not in torch.compiler.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(slow_compile, name="slow_compile")


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
    `at_sample`-th sample of split `in_split` (training's by default), unless `marker` exists;
    the fault creates it first.

    kill: SIGKILL to itself, as the OOM killer or a node failure would.
    kill_job: SIGKILL to the torchrun agent, then to itself: the whole job dies at once, as when
    a machine loses power (the other worker finds its peer gone at the next collective).
    term_agent: SIGTERM to its parent, the torchrun agent, as a scheduler's preemption would.
    term_self: SIGTERM to itself (a world of one, without torchrun).
    hang: stop forever, as a rank stuck in a dead collective or a deadlock would. SIGTERM gets
    its default action back first: the handler mgpu installs would wait for a step boundary that
    never comes, and torchrun would end this process only after its 30-s shutdown timeout.
    """

    def __init__(
        self, split: str, *, fault: str, rank: int, at_sample: int, marker: str,
        in_split: str = "train", **kw,
    ):  # fmt: skip
        super().__init__(split, **kw)
        self.faulty = split == in_split
        self.fault, self.fault_rank, self.at_sample = fault, rank, at_sample
        self.marker = Path(marker)
        self.served = 0

    def __getitem__(self, index: int):
        if self.faulty and int(os.environ.get("RANK", "0")) == self.fault_rank:
            self.served += 1
            if self.served == self.at_sample and not self.marker.exists():
                self.marker.touch()
                self._inject()
        return super().__getitem__(index)

    def _inject(self) -> None:
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "kill_job":
            os.kill(agent_pid(), signal.SIGKILL)
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
    """A GPT whose output (the loss the Trainer asks for with targets, or the logits) turns NaN
    on its `nan_from`-th to `nan_until`-th training forwards (no end by default), and again
    from its `nan_again`-th on (0: never), on rank `rank` only, or on every rank when it is
    None."""

    def __init__(self, *, nan_from: int, nan_until: int = 0, nan_again: int = 0, rank=None, **kw):
        super().__init__(**kw)
        self.nan_from, self.nan_until, self.forwards = nan_from, nan_until, 0
        self.nan_again = nan_again or float("inf")
        self.on_this_rank = rank is None or int(os.environ.get("RANK", "0")) == rank

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(idx, targets)
        if self.training and self.on_this_rank:
            self.forwards += 1
            until = self.nan_until or float("inf")
            if self.nan_from <= self.forwards <= until or self.forwards >= self.nan_again:
                out = out * float("nan")
        return out


class SlowTokens(NgramTokens):
    """NgramTokens whose training samples take `delay_s` each to fetch on rank `rank`: a
    starved loader on one rank."""

    def __init__(self, split: str, *, rank: int, delay_s: float, **kw):
        super().__init__(split, **kw)
        slow = split == "train" and int(os.environ.get("RANK", "0")) == rank
        self.delay_s = delay_s if slow else 0.0

    def __getitem__(self, index: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().__getitem__(index)


class SlowGPT(GPT):
    """A GPT whose training forward takes `delay_s` longer on rank `rank`: a slow device."""

    def __init__(self, *, rank: int, delay_s: float, **kw):
        super().__init__(**kw)
        self.delay_s = delay_s if int(os.environ.get("RANK", "0")) == rank else 0.0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.training and self.delay_s:
            time.sleep(self.delay_s)
        return super().forward(idx, targets)


class HangGPT(GPT):
    """A GPT whose rank `rank` stops for good in its `at_forward`-th training forward (one a step
    without accumulation), before the step's gradient all_reduce that the other ranks wait in:
    a rank stuck in its own compute (a deadlock, a slow device gone quiet). SIGTERM gets its
    default action back, as FaultyTokens' hang does."""

    def __init__(self, *, rank: int, at_forward: int, **kw):
        super().__init__(**kw)
        self.hangs = int(os.environ.get("RANK", "0")) == rank
        self.at_forward, self.forwards = at_forward, 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.training and self.hangs:
            self.forwards += 1
            if self.forwards == self.at_forward:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                while True:
                    time.sleep(60)
        return super().forward(idx, targets)


class KillInSaveGPT(GPT):
    """A GPT whose rank 0 kills itself (SIGKILL) in its `at_save`-th state_dict() call, unless
    `marker` exists: in the middle of a checkpoint save, once the ranks' own files are written
    and before the shared state and the manifest are."""

    def __init__(self, *, at_save: int, marker: str, **kw):
        super().__init__(**kw)
        self.at_save, self.marker, self.saves = at_save, Path(marker), 0

    def state_dict(self, *args, **kwargs):
        if int(os.environ.get("RANK", "0")) == 0:
            self.saves += 1
            if self.saves == self.at_save and not self.marker.exists():
                self.marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict(*args, **kwargs)


class PausingTokens(NgramTokens):
    """NgramTokens whose rank `rank` stops before serving its `at_sample`-th training sample: it
    creates `paused`, then waits until `go` exists (at most `max_wait_s`), holding the run in
    the middle of training while a test does something beside it."""

    def __init__(
        self,
        split: str,
        *,
        rank: int,
        at_sample: int,
        paused: str,
        go: str,
        max_wait_s: float = 120.0,
        **kw,
    ):
        super().__init__(split, **kw)
        self.pauses = split == "train" and int(os.environ.get("RANK", "0")) == rank
        self.at_sample, self.paused, self.go = at_sample, Path(paused), Path(go)
        self.max_wait_s, self.served = max_wait_s, 0

    def __getitem__(self, index: int):
        if self.pauses:
            self.served += 1
            if self.served == self.at_sample:
                self.paused.touch()
                deadline = time.monotonic() + self.max_wait_s
                while not self.go.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        return super().__getitem__(index)


class FaultyRecordingTokens(FaultyTokens, RecordingTokens):
    """FaultyTokens that also record the training indices each process served (RecordingTokens'
    `record`): a fault's run whose data order is checked afterwards."""
