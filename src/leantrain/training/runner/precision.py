"""Mixed precision: ``autocast="bfloat16"`` or ``"float16"`` (loop option).

The forward passes and the loss run under ``torch.autocast`` on the runner's device;
parameters, gradients and optimizer state keep their own dtype. ``"float16"`` adds
``torch.amp.GradScaler``'s dynamic loss scaling, on the device with no host read: each
item's loss is multiplied by the scale before differentiation; the mean gradient is
unscaled by the float32 reciprocal of the scale in the same fused kernel that looks for
non-finite values; a step with an overflow is skipped (counted in ``skipped_steps``)
and the scale halves; after ``growth_interval`` clean steps it doubles
(``torch._amp_update_scale_``). The scale and its counter are saved in checkpoints.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...errors import ConfigError

AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def check_autocast(op: str, value: object) -> None:
    if value is not None and not (isinstance(value, str) and value in AUTOCAST):
        raise ConfigError(f"{op}: autocast must be one of {sorted(AUTOCAST)} or None, got {value!r}")


class LossScaler:
    """GradScaler's dynamic loss scale: ``scale`` and ``tracker`` are device tensors."""

    def __init__(self, device: torch.device, scale: float = 2.0**16, tracker: int = 0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = torch.full((1,), scale, dtype=torch.float32, device=device)
        self.tracker = torch.full((1,), tracker, dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def inverse(self) -> torch.Tensor:
        """GradScaler's unscale factor: the float32 reciprocal, computed in float64."""
        return self.scale.double().reciprocal().float()

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps (device only)."""
        torch._amp_update_scale_(self.scale, self.tracker, found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state(self) -> dict:
        """For a checkpoint: reads the scale to the host (saving asks for it)."""
        return {"loss_scale": float(self.scale.item()), "scale_tracker": int(self.tracker.item())}


def scaler_state_problems(p: dict) -> list[str]:
    """Why a progress record's loss-scale entries cannot resume a float16 run."""
    s, t = p.get("loss_scale"), p.get("scale_tracker")
    # Checked as they will be used: the scale is a float32 tensor, the tracker an int32 one.
    scale32 = float(torch.tensor(s, dtype=torch.float64).to(torch.float32)) if isinstance(s, float) else None
    if not (scale32 is not None and 0 < scale32 < float("inf")) or not (
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31):
        return [f"progress.loss_scale/scale_tracker: expected a scale that is positive and finite in float32 and a "
                f"count below 2**31, got {s!r}, {t!r}"]
    return []
