"""Sharded sampling and evaluation: every rank gets equal training steps, a new shuffle every
epoch, and evaluation sees each sample exactly once across ranks."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, free_port, gloo_runtime, spawn
from torch.utils.data import DataLoader, TensorDataset

from mgpu.config.schema import Precision, TrainerConfig
from mgpu.data.batches import to_device
from mgpu.data.sampler import ShardedSampler, epochs
from mgpu.models import MLP
from mgpu.runtime.dist import Runtime
from mgpu.train.trainer import Trainer


@pytest.mark.parametrize("n, world", [(10, 2), (11, 2), (7, 3), (5, 1)])
def test_training_shards_are_equal_disjoint_and_reshuffled(n, world):
    shards = [
        list(ShardedSampler(n, r, world, shuffle=True, seed=1, even=True)) for r in range(world)
    ]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == n // world
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == n - n % world
    sampler = ShardedSampler(n, 0, world, shuffle=True, seed=1, even=True)
    sampler.set_epoch(1)
    assert list(sampler) != shards[0] or n // world < 2


@pytest.mark.parametrize("n, world", [(10, 3), (2, 3), (9, 2)])
def test_eval_shards_cover_every_sample_exactly_once(n, world):
    flat = [
        i
        for r in range(world)
        for i in ShardedSampler(n, r, world, shuffle=False, seed=0, even=False)
    ]
    assert sorted(flat) == list(range(n))


def test_epochs_iterates_past_the_end_of_an_epoch():
    sampler = ShardedSampler(4, 0, 1, shuffle=True, seed=0, even=True)
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2, sampler=sampler)
    it = epochs(loader)
    seen = [next(it)[0] for _ in range(4)]
    assert sorted(torch.cat(seen[:2]).tolist()) == [0, 1, 2, 3]
    assert sorted(torch.cat(seen[2:]).tolist()) == [0, 1, 2, 3]
    assert sampler.epoch == 1


@pytest.mark.parametrize("n, world, batch, start", [(23, 2, 3, (0, 0)), (17, 1, 4, (2, 5))])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_streaming_sampler_is_the_epochs_cut_to_whole_batches(n, world, batch, start, shuffle):
    """The training stream (stream_batch) against the reference: each epoch iterated on its
    own, through a DataLoader with drop_last, from a resumed cursor's epoch and prefix."""
    epoch, consumed = start
    for rank in range(world):
        stream = ShardedSampler(
            n, rank, world, shuffle=shuffle, seed=3, even=True, keyed=True, stream_batch=batch
        )
        stream.set_epoch(epoch, consumed)
        got = [k for _, k in zip(range(4 * n), stream, strict=False)]
        expected = []
        for e in range(epoch, epoch + 20):
            one = ShardedSampler(n, rank, world, shuffle=shuffle, seed=3, even=True, keyed=True)
            one.set_epoch(e, consumed if e == epoch else 0)
            keys = list(one)
            assert list(one.epoch_keys()) == keys
            for b in DataLoader(keys, batch_size=batch, drop_last=True, collate_fn=list):
                expected += b
        assert got == expected[: len(got)]
        assert {k.epoch for k in got} == set(range(epoch, max(k.epoch for k in got) + 1))
        assert len(stream) == (n - consumed) // world  # one epoch's, as without streaming


def test_a_streaming_loader_gives_an_epoch_loaders_batches_across_epochs():
    """Workers and all: three epochs of the stream's batches are the three epochs of batches a
    loader iterated epoch by epoch gives, and the workers go on into the next epoch."""
    data = TensorDataset(torch.arange(11))
    per_epoch = ShardedSampler(11, 0, 1, shuffle=True, seed=2, even=True)
    plain = DataLoader(data, batch_size=3, sampler=per_epoch, drop_last=True)
    expected = []
    for e in range(3):
        per_epoch.set_epoch(e)
        expected += [x for (x,) in plain]
    stream = ShardedSampler(11, 0, 1, shuffle=True, seed=2, even=True, stream_batch=3)
    loader = DataLoader(
        data, batch_size=3, sampler=stream, drop_last=True, num_workers=2, persistent_workers=True
    )
    got = [x for _, (x,) in zip(range(len(expected) + 1), epochs(loader), strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=False))
    assert len(got) == len(expected) + 1  # one more: the stream does not end with an epoch
    assert len(loader) == 3  # an epoch's batches


def test_to_device_moves_nested_tensors_and_keeps_the_rest():
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    batch = {"x": [torch.ones(1), (torch.zeros(1), "tag")], "p": Pair(torch.ones(2), 3)}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].b == 3 and moved["x"][1][1] == "tag"


def eval_dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(13, 8, generator=g), torch.randint(0, 5, (13,), generator=g))


def evaluate_on(rt: Runtime) -> float:
    torch.manual_seed(0)
    model = MLP(in_features=8, num_classes=5, hidden=[16])
    trainer = Trainer(TrainerConfig(precision=Precision.fp32), model, None, None, rt)
    sampler = ShardedSampler(13, rt.rank, rt.world_size, shuffle=False, seed=0, even=False)
    return trainer.evaluate(DataLoader(eval_dataset(), batch_size=4, sampler=sampler))


def eval_worker(rank: int, port: int, out: str):
    with gloo_runtime(rank, port, 3) as rt:
        loss = evaluate_on(rt)
        torch.save(torch.tensor(loss, dtype=torch.float64), f"{out}/{rank}.pt")


def test_eval_across_three_ranks_equals_one_process_over_the_whole_set(tmp_path):
    spawn(eval_worker, free_port(), str(tmp_path), nprocs=3)
    expected = evaluate_on(Runtime(0, 0, 1, "gloo", torch.device("cpu"), False))
    for rank in range(3):  # 13 samples over 3 ranks: 5, 4, 4, and ragged batches
        got = torch.load(tmp_path / f"{rank}.pt", weights_only=True).item()
        assert got == pytest.approx(expected, rel=1e-9)


def test_a_stream_with_no_whole_batch_is_refused():
    """Fewer samples a rank than a batch: an endless stream that never yields; said instead."""
    with pytest.raises(ValueError, match="gets 1 samples an epoch, less than a batch of 2"):
        ShardedSampler(3, 0, 2, shuffle=True, seed=0, even=True, stream_batch=2)


def test_spare_cpus_leave_the_trainer_its_first_cores():
    from mgpu.data.loader import TRAINER_CORES, spare_cpus

    assert TRAINER_CORES == 2
    assert spare_cpus(list(range(16))) == list(range(2, 16))
    assert spare_cpus([3, 5, 8]) == [8]  # the process's own set, not the machine's numbering
    assert spare_cpus([0, 1]) == [0, 1]  # no CPU would be left to the workers: all of them
    assert spare_cpus([4]) == [4]


def cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


class _Seen(torch.utils.data.Dataset):
    """Each sample: what `read` (a module-level function, so that workers can unpickle it) says
    in the process that loads it."""

    def __init__(self, read):
        self.read = read

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(self.read())


@pytest.mark.parametrize("keep", [True, False])
def test_workers_run_on_the_spare_cpus_under_keep_trainer_cores(keep):
    """Real worker processes from build_dataloader: under data.keep_trainer_cores they run on
    spare_cpus of the training process's set (on a host of more than two CPUs, fewer CPUs than
    the trainer), and the training process keeps its own; off, they run where it may."""
    from mgpu.data.config import DataConfig
    from mgpu.data.loader import build_dataloader, spare_cpus

    mine = cpus()
    cfg = DataConfig(_target_="unused", batch_size=1, num_workers=2, keep_trainer_cores=keep)
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    loader = build_dataloader(cfg, _Seen(cpus), rt, seed=0, train=False)
    # the setting reaches the workers on any host (a host of two CPUs narrows nothing)
    assert loader.worker_init_fn.keywords["keep_trainer_cores"] == keep
    seen = {tuple(batch[0].tolist()) for batch in loader}
    assert seen == {tuple(spare_cpus(mine) if keep else mine)}
    assert sorted(os.sched_getaffinity(0)) == mine


@pytest.mark.parametrize("nice", [0, 7])
def test_workers_run_nicer_than_the_trainer_by_worker_nice(nice):
    """Real worker processes from build_dataloader run data.worker_nice nicer than the training
    process, which keeps its own priority."""
    from mgpu.data.config import DataConfig
    from mgpu.data.loader import build_dataloader

    mine = niceness()
    cfg = DataConfig(_target_="unused", batch_size=1, num_workers=2, worker_nice=nice)
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    loader = build_dataloader(cfg, _Seen(niceness), rt, seed=0, train=False)
    seen = {int(batch[0]) for batch in loader}
    assert seen == {min(mine + nice, 19)}
    assert niceness() == mine


@pytest.mark.parametrize("bad", [-1, 20, True, "high"])
def test_worker_nice_out_of_range_says_how_to_fix(bad):
    from mgpu.data.config import DataConfig

    with pytest.raises(ValueError, match=r"data\.worker_nice.*from 0 .* to 19"):
        DataConfig(_target_="unused", worker_nice=bad)


def test_a_worker_keeps_quiet_only_about_the_trainer_hanging_up_mid_batch(monkeypatch, capsys):
    """A DataLoader worker's resource-sharer thread, whose hand-over of a batch's descriptor a
    Ctrl-C of the training process cut off, prints no traceback (the trainer says one line);
    the same error from elsewhere, and any other error from that thread, are printed."""
    import multiprocessing
    import sys

    from mgpu.data.loader import quiet_when_the_trainer_hangs_up

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    quiet_when_the_trainer_hangs_up()  # what start_worker does first in every worker

    def raised(error: BaseException, filename: str):
        try:
            exec(compile("raise error", filename, "exec"), {"error": error})
        except BaseException as err:  # noqa: BLE001 - the triple sys.excepthook is given
            return type(err), err, err.__traceback__

    sharer = os.path.join(os.path.dirname(multiprocessing.__file__), "resource_sharer.py")
    sys.excepthook(*raised(BrokenPipeError(32, "Broken pipe"), sharer))
    assert capsys.readouterr().err == ""
    sys.excepthook(*raised(BrokenPipeError(32, "Broken pipe"), "/elsewhere/mine.py"))
    sys.excepthook(*raised(ValueError("a bad batch"), sharer))
    printed = capsys.readouterr().err
    assert printed.count("Traceback") == 2, printed
    assert "BrokenPipeError" in printed and "ValueError: a bad batch" in printed


def test_a_data_set_smaller_than_a_batch_per_process_is_one_config_line():
    """Known only once the data set is built, after the run directory is: a ConfigError (train.py
    says one line, exit 2) naming data.batch_size and the most that fits, not a traceback."""
    from mgpu.config.checks import ConfigError
    from mgpu.data.config import DataConfig
    from mgpu.data.loader import build_dataloader

    def loader(batch_size: int, world_size: int) -> DataLoader:
        cfg = DataConfig(_target_="unused", batch_size=batch_size, num_workers=0)
        rt = Runtime(0, 0, world_size, "gloo", torch.device("cpu"), has_process_group=False)
        return build_dataloader(cfg, data, rt, seed=0, train=True)

    data = TensorDataset(torch.arange(50))  # 25 samples a process of 2
    with pytest.raises(ConfigError) as err:
        loader(32, 2)
    said = str(err.value)
    assert said.startswith("data.batch_size=32: each of the 2 processes gets only 25 "), said
    assert "at most 25 here" in said and err.value.exit_code == 2, said
    with pytest.raises(ConfigError, match="only 0 training samples, less than one batch; run"):
        loader(1, 64)  # fewer samples than processes: no batch size fits
    assert len(next(iter(loader(25, 2)))[0]) == 25
    # a user's data set with an empty eval split: said when its loader is built, before any
    # step, where the first evaluation divided by zero
    cfg = DataConfig(_target_="mypkg.Data", batch_size=4, num_workers=0)
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    with pytest.raises(ConfigError) as err:
        build_dataloader(cfg, TensorDataset(torch.arange(0)), rt, seed=0, train=False)
    assert str(err.value).startswith("data._target_='mypkg.Data': its split='eval' holds no ")

    class Stream(torch.utils.data.IterableDataset):  # a user's iterable data set
        def __iter__(self):
            yield from range(8)

    with pytest.raises(ConfigError, match="'mypkg.Data': is an iterable data set; mgpu shards"):
        build_dataloader(cfg, Stream(), rt, seed=0, train=True)


# A process that ends through mgpu's exit_process (train.py's end) while a multiprocessing
# queue's feeder thread is still sending: the item's pickling, which the feeder does, takes
# 0.5 s, so that the feeder is mid-send when the process ends, as a DataLoader's queue to a
# worker can be when a run ends. Nothing reads the pipe; the item fits in its buffer.
FEEDER_AT_EXIT = """
import multiprocessing, time
from mgpu.runtime.dist import exit_process

class SlowToPickle:
    def __reduce__(self):
        time.sleep(0.5)
        return (int, (1,))

def main():
    queue = multiprocessing.get_context("forkserver").Queue()
    queue.put(SlowToPickle())
    queue.cancel_join_thread()  # as torch's DataLoader does for its workers' queues
    del queue

exit_process(main)
"""


def test_a_process_ends_with_no_semaphore_left_to_the_resource_tracker(tmp_path):
    """Its queue's semaphores are released before it ends: the resource tracker, which outlives
    it, has no leaked semaphore to warn of (a finished run used to end with that warning)."""
    script = tmp_path / "feeder_at_exit.py"
    script.write_text(FEEDER_AT_EXIT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The tracker warns as it ends, after the process, on the stderr it shares with it: run()
    # reads that pipe until the tracker has closed it too.
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]
