"""dist.shard_optimizer's optimizer (ZeRO-1): the user's optimizer stepping this rank's flat
shards of every bucket, whose state_dict and load_state_dict speak the user optimizer's unsharded
format (gathered and scattered through mgpu.comm.shard's Shards, whose stream rules it follows),
so that a run saved on N processes resumes on M, sharded or not."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from mgpu.comm.buckets import slice_of
from mgpu.comm.shard import BucketShard, Shards

# Optimizers whose update is elementwise given per-group hyperparameters: stepping any split of
# a parameter into pieces gives the same values as stepping it whole.
ELEMENTWISE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
# The one per-parameter state that is a scalar, not one value per element: shared by a
# parameter's pieces (torch's optimizers special-case it by this name too).
SCALARS = ("step",)


@dataclass
class _Segment:
    """A run of this rank's shard of one bucket whose parameters share an optimizer group."""

    shard: int  # index into the layout
    group: int
    start: int  # in the shard
    end: int


class ShardedOptimizer(torch.optim.Optimizer):
    """The user's optimizer stepping flat shards: one parameter per segment of this rank's
    shards, in the user's parameter groups (same hyperparameters, so the learning-rate schedule
    works on it as on the user's). Its state_dict and load_state_dict speak the user optimizer's
    unsharded format, over the user's parameters in the user's order; both are collectives."""

    def __init__(self, optimizer: torch.optim.Optimizer, shards: Shards):
        check_shardable(optimizer)
        self.kind, self.shards = type(optimizer), shards
        accepted = inspect.signature(self.kind.__init__).parameters
        self.kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        # The user's parameters by group: what the unsharded state is indexed by.
        self.full_groups = [list(g["params"]) for g in optimizer.param_groups]
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self._build(shards.layout)
        super().__init__(self.inner.param_groups, self.inner.defaults)
        # One set of groups and state: the schedule's lr changes reach the inner kernels.
        self.param_groups, self.state, self.defaults = (
            self.inner.param_groups,
            self.inner.state,
            self.inner.defaults,
        )
        if optimizer.state:  # e.g. momentum buffers made up front (mgpu.optim.optimizer)
            self.load_state_dict(optimizer.state_dict())

    def _build(self, layout: list[BucketShard]) -> None:
        """Segments of this layout and an inner optimizer of the user's kind over them, in the
        user's groups with their hyperparameters."""
        group_of = {id(p): g for g, params in enumerate(self.full_groups) for p in params}
        self.layout, self.segments = layout, []
        for i, s in enumerate(layout):
            for p, off in zip(s.params, s.offsets, strict=True):
                start, end = max(off - s.lo, 0), min(off + p.numel() - s.lo, s.size)
                group = group_of.get(id(p))
                if start >= end or group is None:
                    continue
                last = self.segments[-1] if self.segments else None
                if last is not None and (last.shard, last.group, last.end) == (i, group, start):
                    last.end = end
                else:
                    self.segments.append(_Segment(i, group, start, end))
        groups = [{**h, "params": []} for h in self.hyper]
        self.pieces = []
        for seg in self.segments:
            s = layout[seg.shard]
            piece = s.param[seg.start : seg.end]
            piece.grad = s.grad[seg.start : seg.end]
            groups[seg.group]["params"].append(piece)
            self.pieces.append(piece)
        self.inner = self.kind(groups, **self.kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("dist.shard_optimizer=true: optimizer.step takes no closure")
        self.shards.wait_params()  # rule 3: the all-gathers still read the parameter shards
        # The fused kernels' skip flag and clipping divisor (mgpu.train.guard sets them on this
        # object)
        self.inner.grad_scale = getattr(self, "grad_scale", None)
        self.inner.found_inf = getattr(self, "found_inf", None)
        try:
            self.inner.step()
        finally:
            del self.inner.grad_scale, self.inner.found_inf
        self.shards.gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The parameters' gradients (the buckets' slices); the shards keep theirs, which the
        next reduce-scatter overwrites."""
        for s in self.shards.layout:
            for p in s.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's averaged gradient shards, for the non-finite check and clipping."""
        return [s.grad for s in self.shards.layout]

    def grad_norm(
        self, overflow: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The global gradient norm, and `overflow` agreed across ranks (Shards.grad_norm)."""
        return self.shards.grad_norm(overflow)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state tensors (scalars such as Adam's step included)."""
        return sum(
            t.numel() * t.element_size()
            for per_piece in self.inner.state.values()
            for t in per_piece.values()
            if isinstance(t, torch.Tensor)
        )

    # ---- the unsharded format (checkpoints) ----

    def _keys(self) -> tuple[list[str], dict]:
        """The elementwise state keys and the scalar states (Adam's step), agreed across ranks
        from one rank that has any: a rank's shards can all be padding. A host sync."""
        mine = None
        for piece in self.pieces:
            state = self.inner.state.get(piece)
            if state:
                keys = sorted(k for k, v in state.items() if _per_element(k, v))
                scalars = {k: _copy(v, "cpu") for k, v in state.items() if k not in keys}
                mine = (keys, scalars)
                break
        everyone = self.shards.gather_object(mine)
        return next((x for x in everyone if x is not None), ([], {}))

    def state_dict(self) -> dict:
        """The user optimizer's unsharded state_dict: every rank gathers every state tensor (a
        collective, and a host sync). Values are copies, so the result stays valid."""
        keys, scalars = self._keys()
        params = [p for g in self.full_groups for p in g]
        index = {id(p): i for i, p in enumerate(params)}
        state: dict[int, dict] = {}
        if keys or scalars:
            # A copy each: a fused optimizer increments its step tensors in place.
            state = {i: {k: _copy(v) for k, v in scalars.items()} for i in range(len(params))}
        for key in keys:
            for i, s in enumerate(self.layout):
                local = torch.zeros_like(s.param)
                for seg, piece in zip(self.segments, self.pieces, strict=True):
                    if seg.shard == i:
                        local[seg.start : seg.end] = self.inner.state[piece][key]
                full = torch.empty_like(s.full)
                self.shards.gather_flat(full, local)
                for p, off in zip(s.params, s.offsets, strict=True):
                    if id(p) in index:
                        state[index[id(p)]][key] = slice_of(full, p, off).clone()
        groups, first = [], 0
        for g, own in zip(self.full_groups, self.inner.param_groups, strict=True):
            groups.append({**{k: v for k, v in own.items() if k != "params"}})
            groups[-1]["params"] = list(range(first, first + len(g)))
            first += len(g)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the user optimizer's unsharded state_dict (from a checkpoint saved with any
        number of processes, sharded or not): each rank keeps its shards' part."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g) for g in self.full_groups]:
            raise ValueError(
                "the optimizer state has parameter groups of "
                f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer "
                f"{[len(g) for g in self.full_groups]}"
            )
        params = [p for g in self.full_groups for p in g]
        saved = state_dict["state"]
        inner_state: dict[int, dict] = {}
        per_param = [saved.get(i) for i in range(len(params))]
        if any(per_param):
            # torch numbers the inner pieces group by group, not in segment order
            ordered = [p for g in self.inner.param_groups for p in g["params"]]
            position = {id(p): k for k, p in enumerate(ordered)}
            by_segment = self._shard_state(params, per_param)
            inner_state = {position[id(self.pieces[n])]: v for n, v in by_segment.items()}
        groups, first = [], 0
        for g, own in zip(saved_groups, self.inner.param_groups, strict=True):
            n = len(own["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}})
            groups[-1]["params"] = list(range(first, first + n))
            first += n
        self.inner.load_state_dict({"state": inner_state, "param_groups": groups})
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    def _shard_state(self, params: list, per_param: list) -> dict[int, dict]:
        """Each segment's slice of the saved per-parameter state, keyed by segment index."""
        where = {id(p): i for i, p in enumerate(params)}
        sample = next(s for s in per_param if s)
        keys = [k for k, v in sample.items() if _per_element(k, v)]
        scalars = {k: v for k, v in sample.items() if k not in keys}
        flats: dict[tuple[int, str], torch.Tensor] = {}
        for i, s in enumerate(self.layout):
            for key in keys:
                full = torch.zeros_like(s.full)
                for p, off in zip(s.params, s.offsets, strict=True):
                    if id(p) in where and per_param[where[id(p)]]:
                        slice_of(full, p, off).copy_(per_param[where[id(p)]][key])
                flats[i, key] = full[s.lo : s.lo + s.size]
        out = {}
        for n, seg in enumerate(self.segments):
            out[n] = {k: flats[seg.shard, k][seg.start : seg.end].clone() for k in keys}
            out[n].update({k: _copy(v) for k, v in scalars.items()})
        return out


def _per_element(key: str, value) -> bool:
    """A state with one value per parameter element (moments, momentum buffers)."""
    return key not in SCALARS and torch.is_tensor(value)


def _copy(value, device=None):
    """A state value of its own (a fused optimizer increments its step tensors in place)."""
    return value.to(device, copy=True) if torch.is_tensor(value) else value


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Only optimizers whose update is elementwise can step flat pieces of parameters."""
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(f"torch.optim.{k.__name__}" for k in ELEMENTWISE)
        raise ValueError(
            f"dist.shard_optimizer=true steps flat shards of the parameters, which needs an "
            f"optimizer with an elementwise update ({names}); got {type(optimizer).__name__}. "
            "Set dist.shard_optimizer=false to use it"
        )
