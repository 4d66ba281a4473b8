"""The run's evaluations as a component: ``EvalOptions``, evaluation's settings (declared
and checked here), and the ``Evaluator``, which owns their cadence (every ``every``
updates, every ``every_epochs`` epochs of a loader, the run's last update with
``at_end``; without a cadence after every update of an in-memory loop and after every
epoch of a loader loop), runs the named sets, keeps the results in the run's record and
hands them to the listeners, whose answer (``EarlyStopping``'s) is the job's on every
rank. Every rank evaluates; every rank takes rank 0's results (``Strategy.from_main``),
so what the ranks decide from them cannot differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Mapping, Optional, Union

from ...errors import ConfigError
from ...metrics import BUILTIN as BUILTIN_METRICS
from ...validate import check_bool, check_choice, check_count
from ..parallel.strategy import Strategy
from ..runner.runner import Runner
from .evaluation import check_eval_sets, check_limit, evaluate_sets
from .listeners import Listeners
from .record import RunRecord

# What an evaluation names itself, and what the metrics files' records name: no metric's name.
RESERVED = ("loss", "items", "kind", "step", "epoch")


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """The ``Evaluator``'s settings (a loop config's ``evaluation``; each also a keyword of
    the config, spelled ``eval_<field>``: ``eval_data``, ``eval_every``, ...): what a loop
    evaluates and when: ``data`` (a set, or a dict of named sets whose
    results are named ``val_loss``, ``test_loss``...), ``every`` N updates (loaders also
    ``every_epochs``; with neither, an in-memory loop evaluates after every update and a
    loader loop after every epoch), ``metrics`` (``{name: fn(output, target)}``), ``ema``
    (evaluate the moving average of the weights), ``draws``: ``"restore"`` (the default:
    an evaluation changes nothing, every generator it draws from is put back) or
    ``"advance"`` (as a hand-written loop, Lightning and Trainer: the evaluation loader's
    iterator draws its seed from the global generator, and the run's later shuffles and
    augmentations follow from there), ``at_end``: evaluate after the run's last update too
    when it falls off the ``every`` cadence (Trainer's rule; True by default),
    ``limit_batches`` (``limit_eval_batches=``): each evaluation reads at most that many of
    each set's batches, or that fraction of them (Lightning's ``limit_val_batches``)."""

    data: Optional[object] = field(default=None, metadata={"flat": "eval_data"})
    every: Optional[int] = field(default=None, metadata={"flat": "eval_every"})
    metrics: Optional[Mapping[str, Callable]] = field(default=None, metadata={"flat": "eval_metrics"})
    ema: bool = field(default=False, metadata={"flat": "eval_ema"})
    every_epochs: Optional[int] = field(default=None, metadata={"flat": "eval_every_epochs", "loader": True})
    draws: str = field(default="restore", metadata={"flat": "eval_draws"})
    at_end: bool = field(default=True, metadata={"flat": "eval_at_end"})
    limit_batches: Union[None, int, float] = field(default=None, metadata={"flat": "limit_eval_batches"})

    OP: ClassVar[str] = "EvalOptions"

    def __post_init__(self) -> None:
        op = self.OP
        for name in ("every", "every_epochs"):
            if getattr(self, name) is not None:
                check_count(op, f"eval_{name}", getattr(self, name), 1)
        check_bool(op, "eval_ema", self.ema)
        check_choice(op, "eval_draws", self.draws, EVAL_DRAWS)
        check_bool(op, "eval_at_end", self.at_end)
        check_limit(op, "limit_eval_batches", self.limit_batches)
        check_eval_sets(op, self.data)
        if self.metrics is not None and (
            not isinstance(self.metrics, Mapping) or not all(callable(f) for f in self.metrics.values())
        ):
            raise ConfigError(f"{op}: eval_metrics must map names to callables (output, target) -> tensor")
        for name in self.metrics or {}:
            if not isinstance(name, str) or name in RESERVED:
                raise ConfigError(f"{op}: eval_metrics: {name!r} is not a metric name a loop can log: an evaluation "
                                  f"gives 'loss' and 'items' itself, and the metrics files' records name their "
                                  f"'kind', 'step' and 'epoch' (choose another name)")
        if self.metrics and self.data is None:
            raise ConfigError(f"{op}: eval_metrics needs eval_data")

    def result_names(self) -> set[str]:
        """The names the evaluations give (what ``EarlyStopping``, ``keep_best`` and the
        plateau schedule may monitor; none without ``data``)."""
        if self.data is None:
            return set()
        base = {"loss", "items", *(self.metrics or {})}
        if isinstance(self.data, Mapping):
            return {f"{name}_{key}" for name in self.data for key in base}
        return base


EVAL_DRAWS = ("restore", "advance")


class Evaluator:
    """The evaluations of one run of a ``kind`` loop (``"samples"`` or ``"loader"``) with
    ``settings``; ``span(name)``: the profiler's range around one; ``failed(error, where)``:
    how a lost peer is reported (raises)."""

    def __init__(self, settings: EvalOptions, kind: str, runner: Runner, strategy: Strategy, listeners: Listeners,
                 record: RunRecord, span, failed) -> None:
        self.settings, self.kind, self.runner, self.strategy = settings, kind, runner, strategy
        self.listeners, self.record, self.span, self.failed = listeners, record, span, failed
        self.users = any(fn not in BUILTIN_METRICS for fn in (settings.metrics or {}).values())

    def due(self, step: int, total: Optional[int]) -> bool:
        """Whether an evaluation follows update ``step`` (from 1; ``total``: the run's last
        update when known): on the ``every`` cadence, and the last with ``at_end``
        (Trainer's rule); without a cadence after every update of an in-memory loop."""
        s = self.settings
        if s.data is None or (s.every is None and self.kind == "loader"):
            return False
        return step % (s.every or 1) == 0 or (s.at_end and step == total)

    def epoch_due(self, epoch: int, step: int) -> bool:
        """Whether an evaluation follows loader epoch ``epoch`` (from 0), whose last update
        is ``step``: every ``every_epochs``, or every epoch without any cadence; never a
        second one after one update."""
        s = self.settings
        if s.data is None or (s.every is not None and s.every_epochs is None):
            return False
        evals = self.record.evals
        return (epoch + 1) % (s.every_epochs or 1) == 0 and not (evals and evals[-1][0] == step)

    def run(self, step: int) -> bool:
        """Evaluate after update ``step``: rank 0's results on every rank, kept in the run's
        record, told to the callbacks. True: the job stops."""
        s = self.settings
        with self.span("leantrain.evaluate"):
            results = evaluate_sets(self.runner, s.data, s.metrics, ema=s.ema, draws=s.draws,
                                    limit_batches=s.limit_batches)
        try:
            results = self.strategy.from_main(results)
        except Exception as e:  # a peer lost: a CollectiveError naming where and the last checkpoint
            self.failed(e, f"after update {step} (sharing the evaluation's results)")
        self.record.evals.append((step, results))
        return self.listeners.evaluated(step, results, self.users)
