"""fp16 loss scaling under dist.shard_optimizer: torch.amp.GradScaler's dynamics and checkpoint
format, with the overflow check done on this rank's gradient shards and the verdict left to the
caller to agree on across ranks (the Trainer folds it into the gradient norm's all-reduce).

Why not torch's GradScaler here: its unscale_ keeps the found-inf flag in its own per-optimizer
state, and its step and update act on that local flag. Under sharding each rank holds only its
1/N of the averaged gradients, so an overflowing element is seen by the one rank that owns it:
GradScaler would skip the step there, step on the other ranks, and the ranks' scales would part
ways. Its public API has no way to take an agreed flag. Without sharding, the averaged gradients
are whole on every rank, and the Trainer keeps using GradScaler.

Sync points: none; the scale stays a device tensor, and only state_dict (checkpoints) reads it.
"""

from __future__ import annotations

import torch


class LossScaler:
    """`scale(loss)` before backward; after it, `found = unscale_(grads)` divides this rank's
    gradients by the scale and returns a device flag (1.0 where any of them is inf/NaN);
    `update(skipped)` with the flag agreed across ranks halves the scale after a skipped step
    and doubles it after `growth_interval` clean ones in a row, as GradScaler does.

    state_dict/load_state_dict use GradScaler's format, so checkpoints move between sharded
    and unsharded runs. Disabled (`enabled=False`), it scales by nothing and saves {}."""

    def __init__(
        self,
        device: torch.device,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.scale_value = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.clean_steps = torch.zeros((), dtype=torch.int32, device=device)  # in a row

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` times the current scale (a device multiply: no sync)."""
        return tensor * self.scale_value if self.enabled else tensor

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide `grads` in place by the scale (inf and NaN stay what they are); a float32
        device flag, nonzero where any of them is not finite. One fused kernel per dtype."""
        found = torch.zeros((), dtype=torch.float32, device=self.scale_value.device)
        # GradScaler's reciprocal: in float64, then rounded, so the quotients are its own.
        inverse = self.scale_value.double().reciprocal().float()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inverse)
        return found

    def update(self, skipped: torch.Tensor) -> None:
        """After the optimizer step: back off if `skipped` (every rank must pass the same
        value), else count a clean step and grow the scale after growth_interval of them."""
        if not self.enabled:
            return
        torch._amp_update_scale_(
            self.scale_value,
            self.clean_steps,
            skipped.float(),
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict:
        """GradScaler's format; reads the scale on the host (a sync point: checkpoints only)."""
        if not self.enabled:
            return {}
        return {
            "scale": self.scale_value.item(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self.clean_steps.item()),
        }

    def load_state_dict(self, state: dict) -> None:
        """A state saved by GradScaler or by LossScaler; a no-op when disabled."""
        if not self.enabled:
            return
        if not state:
            raise RuntimeError("the loss scaler's saved state is empty (saved without fp16)")
        self.scale_value.fill_(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.clean_steps.fill_(state["_growth_tracker"])
