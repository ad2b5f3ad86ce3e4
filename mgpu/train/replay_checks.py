"""What a CUDA graph replay of a training step (mgpu.train.graphs) assumes of each later call,
and the hooks it would not run: checked before the capture and at every step."""

import weakref

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)


class Signature:
    """What a replay assumes of a call, `Signature(model)(*batch)`: the batch's shapes, dtypes and
    devices; each module's train/eval mode; which parameters take gradients; where the
    parameters and buffers live (the graphs read and write those addresses: a tensor given new
    storage, as `p.data = ...` or load_state_dict(assign=True) do, would be left behind).

    Taken at every step, at the cost of reading what it names: the modules, parameters and
    buffers are listed once, and again only after a module, parameter or buffer was set on any
    module of the process (torch's global registration hooks say so: a submodule replaced, a
    parameter or buffer assigned, load_state_dict with assign=True). Walking ResNet-50's module
    tree at each step cost 2.4 ms of host time on a CPU core, against 0.13 ms for reading the
    listed tensors, and a replayed step's launching thread pays it every step."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.stale = True  # the lists below are to be made (again)
        self.modules: list[nn.Module] = []
        self.params: list[torch.Tensor] = []
        self.tensors: list[torch.Tensor] = []
        # The hooks hold this object weakly, and go when it does: a Trainer built and dropped
        # (tests build many in one process) leaves no hook behind.
        mark = _marker(weakref.ref(self))
        for register in (
            register_module_module_registration_hook,
            register_module_parameter_registration_hook,
            register_module_buffer_registration_hook,
        ):
            weakref.finalize(self, register(mark).remove)

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        if self.stale:
            self.stale = False  # before listing: a registration meanwhile marks it again
            model = self.model
            self.modules = list(model.modules())
            self.params = list(model.parameters())
            self.tensors = [*self.params, *model.buffers()]
        # difference() names these parts, in this order.
        return (
            tuple((t.shape, t.dtype, t.device) for t in tensors),
            tuple(m.training for m in self.modules),
            tuple(p.requires_grad for p in self.params),
            tuple(t.data_ptr() for t in self.tensors),
        )


def _marker(ref: weakref.ref):
    def mark(*_) -> None:  # (module, name, value): the registration goes on unchanged
        owner = ref()
        if owner is not None:
            owner.stale = True

    return mark


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
