"""data.cpu_decode_share=auto's move of every JPEG to the workers (mgpu.data.decode_switch): the
training order's positions that say where it starts (against each epoch's permutation, the
reference), the workers' rate it compares with the step's pace, two gloo ranks deciding
together (one rank short keeps the split on both), the samples from the move on decoded by the
workers and those before it as the split drew them, and a resumed run taking the move from its
checkpoint."""

import itertools
import statistics
import time
from unittest.mock import ANY

import pytest
import torch
from conftest import free_port, gloo_runtime, spawn
from test_decode_split import ONE, NoDecoder, gpu_mode_over, gpu_mode_set
from test_image_folder import folder, write_tree

from mgpu.data import decode_split
from mgpu.data.decode_switch import WINDOW, WorkerSwitch
from mgpu.data.prefetch import DeviceLoader
from mgpu.data.sampler import DataCursor, ShardedSampler, epoch_order, stream_position


def stream_keys(n, world, batch, seed, epoch, consumed, batches):
    """Each rank's first `batches` batches of keys from (epoch, consumed), as its training
    sampler streams them."""
    out = []
    for rank in range(world):
        sampler = ShardedSampler(
            n, rank, world, shuffle=True, seed=seed, even=True, keyed=True, stream_batch=batch
        )
        sampler.set_epoch(epoch, consumed)
        keys, it = [], iter(sampler)
        for _ in range(batches * batch):
            keys.append(next(it))
        out.append([keys[b * batch : (b + 1) * batch] for b in range(batches)])
    return out


@pytest.mark.parametrize("world,consumed", [(1, 0), (2, 0), (3, 7)])
def test_positions_follow_the_training_order_and_mark_where_a_batch_starts(world, consumed):
    """A key's position is epoch * n + its entry in the epoch's permutation (the reference:
    epoch_order), whatever the ranks; stream_position(start, b) is at most every position of
    batch b and later ones, and above every earlier one, across epoch ends and a resumed
    prefix."""
    n, batch, seed, epoch = 29, 3, 11, 2
    ranks = stream_keys(n, world, batch, seed, epoch, consumed, batches=12)
    for keys in ranks:
        for keys_b in keys:
            for key in keys_b:
                entry = key.position - key.epoch * n
                order = epoch_order(n, seed, key.epoch).tolist()
                assert order[entry] == key.index
    start = DataCursor(seed, epoch, consumed, n)
    for b in range(12):
        at = stream_position(start, b, batch_size=batch, world_size=world)
        assert all(k.position >= at for keys in ranks for later in keys[b:] for k in later)
        assert all(k.position < at for keys in ranks for earlier in keys[:b] for k in earlier)
    positions = [k.position for keys in ranks for keys_b in keys for k in keys_b]
    assert len(set(positions)) == len(positions)


def test_the_workers_rate_counts_each_kind_by_its_share_of_the_jpegs():
    full = decode_split.KindRates(core=100.0, gpu=5000.0, fraction=0.75, images=64)
    scaled = decode_split.KindRates(core=300.0, gpu=3000.0, fraction=0.25, images=16)
    cores = 8 * decode_split.WORKER_EFFICIENCY
    expected = cores / (0.75 / 100 + 0.25 / 300)  # images a second of the stream's mix
    assert decode_split.workers_rate(8, decode_split.Rates(full, scaled)) == pytest.approx(expected)
    one = decode_split.Rates(decode_split.KindRates(100.0, 5000.0, 1.0, 64), None)
    assert decode_split.workers_rate(8, one) == pytest.approx(cores * 100)


def _decide(rank, port, root, rates, out):
    """Two gloo ranks, each with its own workers' rate, over their own samplers."""
    with gloo_runtime(rank, port) as rt:
        dataset = gpu_mode_over(root)
        sampler = ShardedSampler(
            len(dataset), rank, 2, shuffle=True, seed=5, even=True, keyed=True, stream_batch=2
        )
        sampler.set_epoch(1, 4)  # a resumed run's start
        switch = WorkerSwitch(
            dataset, sampler, rt, batch_size=2, workers_rate=rates[rank], in_flight=6
        )
        for taken in range(1, WINDOW[1] + 5):
            switch.after_batch(taken)
        torch.save(dataset.workers_from(), out / f"rank{rank}.pt")


@pytest.mark.parametrize("rates,moves", [((1e12, 1e12), True), ((1e12, 0.0), False)])
def test_ranks_move_every_jpeg_to_the_workers_together_from_one_place(tmp_path, rates, moves):
    """Workers far faster than any step on both ranks: both move, from the same place, the
    first sample of the batch `in_flight` after the deciding one; one rank's workers short (a
    rate of 0): neither moves."""
    write_tree(tmp_path / "train", per_class=16, sizes=((60, 80), (44, 36), (16, 20), (44, 36)))
    spawn(_decide, free_port(), tmp_path / "train", rates, tmp_path)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    n = len(gpu_mode_over(tmp_path / "train"))
    at = stream_position(DataCursor(5, 1, 4, n), WINDOW[1] + 6, batch_size=2, world_size=2)
    assert got == ([at, at] if moves else [None, None])


def test_from_the_move_the_workers_decode_every_jpeg_and_before_it_as_drawn(tmp_path):
    """Samples before the place are decoded where the split's draw put them (some JPEGs left
    to the GPU); from it on, every JPEG by the workers; the same draw without a move is the
    reference for the earlier ones."""
    dataset = gpu_mode_set(tmp_path / "train")
    reference = gpu_mode_over(tmp_path / "train")
    for d in (dataset, reference):
        decode_split.shared_split([d], (0.5, 0.5))
    keys = [k for rank in stream_keys(len(dataset), 1, 4, 3, 0, 0, 30) for b in rank for k in b]
    place = keys[len(keys) // 2].position
    dataset.workers_decode_from(place)
    before = [dataset[k].data is None for k in keys if k.position < place]
    drawn = [reference[k].data is None for k in keys if k.position < place]
    after = [dataset[k].data is None for k in keys if k.position >= place]
    assert before == drawn and not all(before)  # some JPEGs stayed the GPU's
    assert after and all(after)
    assert dataset.checkpoint_state()["workers_from"] == place


def test_a_resumed_run_takes_the_move_from_its_checkpoint(tmp_path):
    """A checkpoint of a run that moved: the resumed training set moves from the same place
    before its workers start, and no switch is left to decide (resolve_auto returns None)."""
    write_tree(tmp_path / "train", per_class=12, sizes=((60, 80), (44, 36)))
    kwargs = {**folder(tmp_path / "train"), "decode": "gpu"}
    train, evaluation = NoDecoder("train", **kwargs), NoDecoder("eval", **kwargs)
    saved = {"cpu_decode_share": 0.3, "cpu_decode_share_scaled": 0.6, "decode": "gpu"}
    rate = decode_split.resolve_auto(
        "auto", 3, [train, evaluation], ONE, {**saved, "workers_from": 812}
    )
    assert rate is None
    assert train.workers_from() == 812 and evaluation.workers_from() is None
    assert train.checkpoint_state() == {**saved, "workers_from": 812, "held_out": ANY}


def test_the_loader_counts_the_batches_it_hands_over_each_iteration():
    """after_batch gets 1, 2, ... in each iteration, after the batch's data wait is counted."""
    seen = []
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=2)
    device_loader = DeviceLoader(loader, "cpu", after_batch=seen.append)
    assert len(list(device_loader)) == 5 and seen == [1, 2, 3, 4, 5]
    next(iter(device_loader))
    assert seen[-1] == 1


def test_running_workers_see_the_move_and_decode_as_positions_say(tmp_path):
    """The move set while a persistent DataLoader's workers (forkserver, as mgpu starts them)
    run: every batch from the place on comes with no JPEG left for the GPU, and every batch
    before it with the JPEGs the split's draw left (the reference: the same keys drawn in this
    process without a move)."""
    from mgpu.data.encoded import collate_encoded
    from mgpu.data.loader import worker_context

    dataset = gpu_mode_set(tmp_path / "train")
    reference = gpu_mode_over(tmp_path / "train")
    for d in (dataset, reference):
        decode_split.shared_split([d], (0.5, 0.5))
    batch, workers, prefetch = 4, 2, 2
    sampler = ShardedSampler(
        len(dataset), 0, 1, shuffle=True, seed=3, even=True, keyed=True, stream_batch=batch
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch, sampler=sampler, num_workers=workers, prefetch_factor=prefetch,
        persistent_workers=True, collate_fn=collate_encoded,
        multiprocessing_context=worker_context(dataset),
    )  # fmt: skip
    keys = stream_keys(len(dataset), 1, batch, 3, 0, 0, 40)[0]
    taken, moved_at = 5, 5 + prefetch * workers + 1  # past every batch asked for so far
    it = iter(loader)
    got = [next(it) for _ in range(taken)]
    dataset.workers_decode_from(stream_position(DataCursor(3, 0, 0, len(dataset)), moved_at,
                                                batch_size=batch, world_size=1))  # fmt: skip
    got += [next(it) for _ in range(len(keys) - taken)]
    left = [len(b.lengths) for b in got]  # JPEGs each batch left to the GPU
    drawn = [sum(reference[k].data is not None for k in ks) for ks in keys]
    assert left[:moved_at] == drawn[:moved_at] and sum(drawn[:moved_at]) > 0
    assert left[moved_at:] == [0] * (len(keys) - moved_at) and sum(drawn[moved_at:]) > 0


@pytest.mark.parametrize("rate,moves", [(0.9, False), (1.1, True)])
def test_the_pace_is_the_steps_own_with_an_evaluation_in_the_window(tmp_path, rate, moves):
    """A batch every 10 ms but one 5 s pause (an evaluation) within the window: the pace is a
    batch per 10 ms, so workers a tenth slower than that keep the split and a tenth faster
    move (a clock stands in for time: nothing here is timed)."""
    dataset = gpu_mode_set(tmp_path / "train")
    sampler = ShardedSampler(
        len(dataset), 0, 1, shuffle=True, seed=5, even=True, keyed=True, stream_batch=4
    )
    now = iter([0.01 * k + (5.0 if k > 30 else 0.0) for k in range(100)])
    switch = WorkerSwitch(
        dataset, sampler, ONE, batch_size=4, workers_rate=rate * 4 / 0.01, in_flight=3,
        clock=lambda: next(now),
    )  # fmt: skip
    for taken in range(1, WINDOW[1] + 1):
        switch.after_batch(taken)
    assert (dataset.workers_from() is not None) == moves


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_pace_is_the_training_streams_not_the_hosts(tmp_path):
    """The host hands batches over as fast as it can launch while the GPU takes over 10 ms a
    batch: workers at a batch in 5 ms are faster than that pace and move. The host's own
    hand-overs (its clock read at each, the reference) came faster than a batch in 5 ms: a
    pace by the host's clock would have kept the split. (With 2 ms a batch of small products
    and workers at 1 ms, this reference failed once in the whole GPU suite on one GPU, its
    other workers beside it: the margins are now wide.)"""
    from mgpu.runtime.dist import Runtime

    device = torch.device("cuda", 0)
    rt = Runtime(0, 0, 1, "nccl", device, has_process_group=False)
    # A large product (over a millisecond each), so that a batch's GPU time takes few launches:
    # the host's hand-overs stay fast, and 60 batches stay well inside CUDA's launch queue
    # (a full queue would hold the host to the GPU's pace).
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a @ a  # the kernel's first run, not timed
    start.record()
    a @ a
    end.record()
    end.synchronize()
    repeats = int(10.5 / start.elapsed_time(end)) + 1  # over 10 ms of GPU time a batch
    dataset = gpu_mode_set(tmp_path / "train")
    sampler = ShardedSampler(
        len(dataset), 0, 1, shuffle=True, seed=5, even=True, keyed=True, stream_batch=4
    )
    switch = WorkerSwitch(dataset, sampler, rt, batch_size=4, workers_rate=4 / 5e-3, in_flight=3)
    host = []
    for taken in range(1, WINDOW[1] + 1):
        for _ in range(repeats):
            a @ a
        if taken >= WINDOW[0]:
            host.append(time.perf_counter())
        switch.after_batch(taken)
    assert statistics.median(b - a for a, b in itertools.pairwise(host)) < 5e-3
    assert dataset.workers_from() is not None
