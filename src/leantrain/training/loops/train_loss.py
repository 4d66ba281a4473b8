"""The run's mean training loss (``TrainReport.train_loss``, Trainer's ``train_loss``): the
mean over the run's updates of each update's mean loss before its step.

Nothing is read from the device per update, and little is computed: each update's loss
tensor joins a short list, summed into a float64 device total every ``FLUSH`` updates
(by the update's number, so a resumed run groups its additions as the straight run
does), a non-finite loss (a skipped update) left out there. A checkpoint keeps the total,
the count and the list's values (read then: the save reads the parameters anyway), so a
resumed run ends with the straight run's bits.
"""

from __future__ import annotations

from typing import Optional

import torch

FLUSH = 64  # updates per summation: one stack and sum instead of one addition per update


class TrainLoss:
    """The sum and count of the run's update losses (see the module docstring)."""

    def __init__(self) -> None:
        self.known = True  # False: resumed from a file that did not keep the sum
        self.total: Optional[torch.Tensor] = None  # float64, on the losses' device
        self.count: Optional[torch.Tensor] = None
        self.pending: list = []  # this group's losses (device tensors), summed at the group's end
        self.saved = (0.0, 0, [])  # a resumed file's (total, count, pending values)

    def add(self, loss: torch.Tensor, step: int) -> None:
        """Update ``step``'s mean loss (a device scalar, never read here)."""
        if self.total is None:
            total, count, values = self.saved
            self.total = torch.full((), total, dtype=torch.float64, device=loss.device)
            self.count = torch.full((), count, dtype=torch.float64, device=loss.device)
            self.pending = list(torch.tensor(values, dtype=torch.float64, device=loss.device).unbind())
        self.pending.append(loss.detach() if loss.requires_grad else loss)  # never a graph kept
        if step % FLUSH == 0:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            values = torch.stack(self.pending).to(torch.float64)
            finite = torch.isfinite(values)  # a skipped update's NaN or inf is left out
            self.total.add_(torch.where(finite, values, 0.0).sum())
            self.count.add_(finite.sum())
            self.pending = []

    def state(self) -> Optional[dict]:
        """What a checkpoint keeps (a device read); ``None``: the sum is not known."""
        if not self.known:
            return None
        if self.total is None:
            total, count, values = self.saved
            return {"train_loss_sum": total, "train_loss_updates": count, "train_loss_pending": list(values)}
        values = [float(v) for v in self.pending]  # intentional sync: at a save
        return {"train_loss_sum": float(self.total), "train_loss_updates": int(self.count),  # intentional sync
                "train_loss_pending": values}

    def resume(self, progress: dict) -> None:
        """Continue a checkpoint's sum (a file without one, past update 0: unknown)."""
        if "train_loss_sum" in progress:
            self.saved = (float(progress["train_loss_sum"]), int(progress["train_loss_updates"]),
                          [float(v) for v in progress.get("train_loss_pending", [])])
        else:
            self.known = not progress.get("step")

    def mean(self) -> Optional[float]:
        """The run's mean (a device read, at the end); ``None``: no update, or not known."""
        if not self.known:
            return None
        if self.total is not None:
            self._flush()
            total, count = float(self.total), int(self.count)  # intentional sync: the run's end
        else:
            total, count = self.saved[0], self.saved[1]
        return total / count if count else None
