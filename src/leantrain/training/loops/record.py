"""What a run has measured and logged: one typed record the session keeps and saves.

Every checkpoint's progress carries it (``before``, ``losses``, ``evals`` and, when
clipping by norm was logged, ``grad_norms``), so a resumed run's report and logs hold
the whole run: the resumed entries first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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

    @classmethod
    def resumed(cls, progress: dict) -> "RunRecord":
        """The record a checkpoint's progress holds."""
        return cls(progress["before"], [tuple(x) for x in progress["losses"]],
                   [tuple(x) for x in progress.get("grad_norms", [])],
                   [(int(step), dict(results)) for step, results in progress.get("evals", [])])

    def progress(self) -> dict:
        """The fields a checkpoint's progress saves."""
        return dict(before=self.before, losses=list(self.logged), evals=[[k, r] for k, r in self.evals],
                    **({"grad_norms": list(self.grad_norms)} if self.grad_norms else {}))

    def metric_at(self, step: int, name: str) -> Optional[float]:
        """``name`` from the evaluation made after update ``step`` (``None``: none made)."""
        if self.evals and self.evals[-1][0] == step:
            value = self.evals[-1][1].get(name)
            return None if value is None else float(value)
        return None
