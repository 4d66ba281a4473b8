"""torch's averaged models driven by a loop (``averaging=Averaging(...)``): the user's own
``torch.optim.swa_utils.AveragedModel`` (its ``avg_fn`` or ``multi_avg_fn``, ``use_buffers``,
all of torch's semantics, run by torch's ``update_parameters``), updated after the updates
it is due at and kept in every checkpoint, so a resumed run averages as the straight one.

When: every ``every`` updates from update ``start`` (numbered from 1), or, with
``per_epoch=True``, at the updates whose index in their epoch (from 0) is a multiple of
``every`` (torchvision's reference: ``i % model_ema_steps == 0``). ``reset_until``: after
each averaging at an update up to this one, the count goes back to 0 so the next averaging
copies the weights (torchvision's warm-up: ``n_averaged.fill_(0)`` while ``epoch <
lr_warmup_epochs``). This covers torchvision's ``ExponentialMovingAverage``, SWA from an
epoch on, and timm's EMA with a warm-up decay (an ``avg_fn`` of ``num_averaged``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...errors import CheckpointError, ConfigError
from ...validate import check_bool, check_count


class Averaging:
    """Drive ``model``, a ``torch.optim.swa_utils.AveragedModel`` of the module the loop
    trains, as described in the module docstring."""

    def __init__(self, model, every: int = 1, start: int = 1, reset_until: int = 0, per_epoch: bool = False) -> None:
        op = "Averaging"
        from torch.optim.swa_utils import AveragedModel

        if not isinstance(model, AveragedModel):
            raise ConfigError(f"{op}: model must be a torch.optim.swa_utils.AveragedModel of the trained module, got "
                              f"{type(model).__name__}")
        self.model = model
        self.every = check_count(op, "every", every, 1)
        self.start = check_count(op, "start", start, 1)
        self.reset_until = check_count(op, "reset_until", reset_until, 0)
        check_bool(op, "per_epoch", per_epoch)
        self.per_epoch = per_epoch

    def check(self, op: str, module: torch.nn.Module, loader_loop: bool, one_process: bool) -> None:
        """Before training: one process, the averaged model averages this module (the
        same parameters and buffers, shape by shape), and ``per_epoch`` has epochs to count in."""
        if not one_process:
            raise ConfigError(f"{op}: averaging runs in one process (under torch.distributed use ema_decay)")
        if self.per_epoch and not loader_loop:
            raise ConfigError(f"{op}: averaging per_epoch=True counts updates within an epoch: a loader loop's")
        mine = list(self.model.module.parameters()) + list(self.model.module.buffers())
        theirs = list(module.parameters()) + list(module.buffers())
        if [tuple(p.shape) for p in mine] != [tuple(p.shape) for p in theirs]:
            raise ConfigError(f"{op}: averaging: the AveragedModel does not average the trained module (its "
                              f"parameters and buffers differ in number or shape): build it as "
                              f"AveragedModel(model, ...) of the module you train")

    def due(self, step: int, in_epoch: Optional[int]) -> bool:
        """Whether update ``step`` (``in_epoch``: its index in its epoch, from 0) averages."""
        if step < self.start:
            return False
        if self.per_epoch:
            return in_epoch is not None and in_epoch % self.every == 0
        return (step - self.start) % self.every == 0

    def after_update(self, runner, at, cfg) -> None:
        """After update ``at.step`` (``at``: a loop's ``Progress``, ``cfg`` its config):
        torch's ``update_parameters`` of the runner's module when due, the module showing
        the trained values (a no-op on the host path)."""
        step = at.step
        in_epoch = None if at.epoch is None else (at.batch - 1) // cfg.accumulate_at(at.epoch)
        if not self.due(step, in_epoch):
            return
        runner.sync()
        self.model.update_parameters(runner.module)
        if step <= self.reset_until:
            self.model.n_averaged.fill_(0)  # the next averaging copies (a warm-up)

    # ----------------------------------------------------------------- checkpoints
    def tensors(self) -> dict[str, torch.Tensor]:
        """The averaged model's state (its module's and ``n_averaged``), CPU copies for a
        checkpoint (a tied parameter written once per name, as ``state_dict`` names it)."""
        # Intentional device-to-host reads: saving asks for the averages.
        return {name: t.detach().to("cpu").clone().contiguous() for name, t in self.model.state_dict().items()}

    def fits(self, saved: dict) -> bool:
        """Whether a checkpoint's averaged tensors (by name) fit this AveragedModel."""
        want = self.model.state_dict()
        return set(saved) == set(want) and all(
            tuple(saved[k].shape) == tuple(v.shape) and saved[k].dtype == v.dtype for k, v in want.items())

    def load(self, op: str, saved: dict[str, torch.Tensor]) -> None:
        """Take back what ``tensors`` gave (a resumed run); the resume checked the fit
        (``fits``) before anything was installed, and this checks it again."""
        if not self.fits(saved):
            raise CheckpointError(f"{op}: the checkpoint's averaged model does not fit this run's AveragedModel "
                                  f"(names, shapes or dtypes differ)")
        self.model.load_state_dict(saved)
