"""What a run has measured and logged: one typed record the session keeps and saves.

Every checkpoint's progress carries it (``before``, ``losses``, ``evals`` and, when
clipping by norm was logged, ``grad_norms``), so a resumed run's report and logs hold
the whole run: the resumed entries first. Every entry names its update by its number,
counted from 1 (``numbered_from: 1`` in the progress; a checkpoint written before
leantrain numbered losses and norms from 1 is read with its 0-based indices shifted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from .train_loss import TrainLoss


@dataclass
class RunRecord:
    """``before``: the loss measured before the first update (``None``: not measured);
    ``logged``: (update, pre-update loss) of the logged updates; ``grad_norms``: (update,
    norm before clipping) on logged updates; ``evals``: (update, the evaluation's
    results); ``last_norm``: the newest logged update's norm (``None``: not logged)."""

    before: Optional[float] = float("nan")
    logged: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    last_norm: Optional[float] = None
    last_rates: Optional[dict] = None  # the newest logged update's throughput (throughput.py)
    tokens_before: int = 0  # token data: the tokens the resumed run had seen
    count_tokens: Optional[Callable[[], Optional[int]]] = None  # this session's tokens (the job's; None: no tokens)
    train_loss: TrainLoss = field(default_factory=TrainLoss)  # the run's mean loss (train_loss.py)

    def tokens_seen(self) -> Optional[int]:
        """The run's tokens so far, resumed ones included (``None``: not token data); a device
        count is read (at a save, at the end)."""
        now = None if self.count_tokens is None else self.count_tokens()
        return None if now is None else self.tokens_before + now

    def resume(self, progress: dict) -> None:
        """Take the record a checkpoint's progress holds (in place: the run's components
        hold this record)."""
        shift = 0 if progress.get("numbered_from") == 1 else 1  # older files: 0-based update indices
        self.before = progress["before"]
        self.logged = [(int(k) + shift, v) for k, v in progress["losses"]]
        self.grad_norms = [(int(k) + shift, v) for k, v in progress.get("grad_norms", [])]
        self.evals = [(int(step), dict(results)) for step, results in progress.get("evals", [])]
        self.tokens_before = int(progress.get("tokens_seen", 0))
        self.train_loss.resume(progress)

    def progress(self) -> dict:
        """The fields a checkpoint's progress saves."""
        tokens = self.tokens_seen()
        return dict(before=self.before, losses=[list(x) for x in self.logged], **(self.train_loss.state() or {}),
                    evals=[[k, r] for k, r in self.evals], numbered_from=1,
                    **({"grad_norms": [list(x) for x in self.grad_norms]} if self.grad_norms else {}),
                    **({"tokens_seen": tokens} if tokens is not None else {}))

    def metric_at(self, step: int, name: str) -> Optional[float]:
        """``name`` from the evaluation made after update ``step`` (``None``: none made)."""
        if self.evals and self.evals[-1][0] == step:
            value = self.evals[-1][1].get(name)
            return None if value is None else float(value)
        return None
