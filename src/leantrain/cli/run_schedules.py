"""The command's schedules: the names ``--scheduler`` takes and the schedule a run's
settings make (``make_schedule``), checked before the data says how long an epoch is
(``schedule_works``)."""

from __future__ import annotations

from typing import Optional

from .. import optim
from ..errors import ConfigError

# Trainer's twelve lr_scheduler_type names, with Trainer's meaning (transformers' get_scheduler),
# then leantrain's own: upstream's warm-up cosine and torch's curves.
TRAINER_SCHEDULERS = tuple(optim.SCHEDULER_TYPES)
ALIASES = {"wsd": "warmup_stable_decay", "plateau": "reduce_lr_on_plateau"}  # the names of earlier releases
SCHEDULERS = ("none", *TRAINER_SCHEDULERS, "warmup_cosine", "step", "exponential", "one_cycle", "cosine_restarts",
              "multi_step", *ALIASES)
NO_ARGUMENTS = ("none", "constant", "constant_with_warmup", "warmup_cosine", "step", "exponential")


def make_schedule(c, steps_per_epoch: int) -> Optional[optim.Schedule]:
    """Indexed by epoch (upstream's rule), or by update with ``schedule_per="step"``:
    then the same curves over the run's updates (``warmup`` counts updates)."""
    per_step = c.schedule_per == "step"
    total = c.epochs * steps_per_epoch if per_step else c.epochs
    if per_step and c.max_steps is not None:
        total = min(total, c.max_steps)
    warm = optim.warmup_steps_for("--warmup-ratio", total, c.warmup, c.warmup_ratio)
    name = ALIASES.get(c.scheduler, c.scheduler)
    args = dict(c.scheduler_args or {})
    if name == "none":
        return None
    if name in TRAINER_SCHEDULERS:  # as Trainer's create_scheduler
        if name == "warmup_stable_decay":  # Trainer needs num_decay_steps; the command's default: a tenth
            args.setdefault("num_decay_steps", max(1, (total - warm) // 10))
        return optim.get_scheduler(name, c.lr, num_warmup_steps=warm, num_training_steps=total,
                                   scheduler_specific_kwargs=args)
    if name == "step":
        return optim.step(c.lr, max(1, total // 3), 0.3)
    if name == "exponential":
        return optim.exponential(c.lr, 0.9 ** (1.0 / steps_per_epoch) if per_step else 0.9)
    total = max(total, warm + 1)
    if name == "warmup_cosine":
        return optim.warmup_cosine(c.lr, c.lr / 20, warm, total)
    if name == "one_cycle":
        return optim.one_cycle(c.lr, total, **args)
    if name == "cosine_restarts":
        return optim.cosine_restarts(c.lr, args.pop("t_0", max(1, total // 4)), **args)
    return optim.multi_step(c.lr, args.pop("milestones", [total // 2, 3 * total // 4]), **args)


# What the settings check a per-update schedule with, before the data says how many updates an epoch has:
# an epoch as long as any, so only a horizon the run cannot reach (--max-steps, --warmup) is refused here.
ANY_EPOCH = 10**9


def schedule_works(c) -> Optional[str]:
    """Why the schedule cannot be made (``None``: it can): its arguments, and its horizon as
    the run will have it (epochs, or with ``--schedule-per step`` the run's updates, which
    ``--max-steps`` bounds); the run builds it again with the epoch's real length."""
    if c.scheduler_args and c.scheduler in NO_ARGUMENTS:
        return f"--scheduler {c.scheduler} takes no arguments"
    try:
        c.make_schedule(ANY_EPOCH)
    except (ConfigError, TypeError) as e:  # TypeError: a key the schedule does not take
        if c.schedule_per == "step":
            horizon = f"{c.max_steps} updates (--max-steps)" if c.max_steps is not None else "the run's updates"
        else:
            horizon = f"{c.epochs} epoch(s) (--epochs; indexed per epoch: --schedule-per step indexes updates)"
        return f"{e} (its horizon: {horizon}; warm-up --warmup {c.warmup})"
    return None
