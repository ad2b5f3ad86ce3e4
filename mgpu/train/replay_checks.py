"""What a CUDA graph replay of a training step (mgpu.train.graphs) assumes of each later call,
and the hooks it would not run: checked before the capture and at every step."""

import itertools

import torch
from torch import nn


def signature(model: nn.Module, *tensors: torch.Tensor) -> tuple:
    """What a replay assumes of a call: the batch's shapes, dtypes and devices; each module's
    train/eval mode; which parameters take gradients; where the parameters and buffers live
    (the graphs read and write those addresses: a tensor given new storage, as `p.data = ...`
    or load_state_dict(assign=True) do, would be left behind)."""
    return (
        tuple((t.shape, t.dtype, t.device) for t in tensors),
        tuple(m.training for m in model.modules()),
        tuple(p.requires_grad for p in model.parameters()),
        tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers())),
    )


def difference(captured: tuple, now: tuple) -> str:
    names = (
        "batch shapes",
        "a module's train/eval mode",
        "which parameters take gradients",
        "the storage of a parameter or buffer",
    )
    changed = [n for n, a, b in zip(names, captured, now, strict=True) if a != b]
    batch = f": {now[0]} against {captured[0]}" if captured[0] != now[0] else ""
    return ", ".join(changed) + batch


def unreplayed_hooks(model: nn.Module) -> list[str]:
    """Hooks a replay would not run as eager steps do: module hooks run while recording only, and
    a hook on a parameter's gradient is recorded into the backward graph and then run again when
    autograd accumulates the replayed gradient. torch lists neither publicly; these dicts are
    what torch's own make_graphed_callables checks. (Hooks run after accumulation are fine.)"""
    import torch.nn.modules.module as tm

    found = [
        f"global module {kind} hooks"
        for kind, hooks in (
            ("forward", tm._global_forward_hooks),
            ("forward pre", tm._global_forward_pre_hooks),
            ("backward", tm._global_backward_hooks),
            ("backward pre", tm._global_backward_pre_hooks),
        )
        if hooks
    ]
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            found.append(f"module hooks on {name or type(m).__name__}")
    for name, p in model.named_parameters():
        if p._backward_hooks:
            found.append(f"a gradient hook on {name}")
    return found
