"""``leantrain.check``: the library's guarantees, verified on the user's own model.

``check(runner_factory, samples, cfg)`` runs a few seconds of work and reports one line
per guarantee, PASS or FAIL with the measured figure: gradients against autograd,
three optimizer steps against ``torch.optim``, accumulation against single items, exact
resume, determinism, the module left intact, device-to-host reads per step, and the
step time against a hand-written loop. ``leantrain check`` is the same from the command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from ..training.loops.config import TrainConfig
from ..training.runner.runner import Runner, check_sample
from ..training.loops.calls import mean_gradients
from .checks import CHECKS, Probe


@dataclass(frozen=True)
class CheckResult:
    """One guarantee: PASS, FAIL, or SKIP (``skipped``: it does not apply; not a failure)."""

    name: str
    passed: bool
    figure: str
    skipped: bool = False

    def line(self) -> str:
        """The result as the command prints it: ``PASS  name  detail``."""
        verdict = "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"
        return f"{verdict}  {self.name:<14} {self.figure}"


@dataclass(frozen=True)
class CheckReport:
    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        """Whether every check passed (skipped checks count as passed)."""
        return all(r.passed for r in self.results)

    def __getitem__(self, name: str) -> CheckResult:
        return next(r for r in self.results if r.name == name)

    def lines(self) -> list[str]:
        """The report as printed: a heading, then one line per check."""
        return [r.line() for r in self.results]

    def to_json(self) -> str:
        """The report as a JSON document (the command's ``--json``)."""
        return json.dumps({"passed": self.passed, "checks": [r.__dict__ for r in self.results]}, indent=2)

    def write_json(self, path) -> None:
        """Write ``to_json()`` to ``path``."""
        Path(path).write_text(self.to_json() + "\n")


def check(
    runner_factory: Callable[[], Runner], samples: list, cfg: TrainConfig, *, steps: int = 4,
    seed: int = 0, max_ratio: float = 2.0, speed_runs: int = 5, only: tuple = (),
) -> CheckReport:
    """Run every check (or those named in ``only``). ``runner_factory`` builds the same
    model each call (it is called after ``torch.manual_seed(seed)``); ``samples`` are
    ``(x, y)`` items, ``cfg.batch_size`` of them form one update; ``max_ratio`` is the
    slowest step time accepted against the hand-written loop. A check that raises is a
    FAIL whose figure is the error."""
    op = "check"
    if not callable(runner_factory):
        raise ConfigError(f"{op}: runner_factory must be a callable returning a Runner")
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"{op}: expected a TrainConfig, got {type(cfg).__name__}")
    samples = [check_sample(op, s, i) for i, s in enumerate(samples)]
    if len(samples) < cfg.batch_size:
        raise ConfigError(f"{op}: needs at least batch_size={cfg.batch_size} samples, got {len(samples)}")
    names = [n for n, _ in CHECKS]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ConfigError(f"{op}: unknown check(s) {unknown}; the checks are {names}")
    _preflight(op, runner_factory, samples[: cfg.batch_size])  # a user error is raised, not a FAIL
    probe = Probe(runner_factory, samples, cfg, seed, steps, max_ratio, speed_runs)
    results = []
    for name, fn in CHECKS:
        if only and name not in only:
            continue
        try:
            passed, figure = fn(probe)
        except Exception as e:  # a check that cannot run has failed; say why
            passed, figure = False, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        results.append(CheckResult(name, passed is not False, figure, skipped=passed is None))
    return CheckReport(tuple(results))


def _preflight(op: str, runner_factory: Callable[[], Runner], batch: list) -> None:
    """What makes every check meaningless is the user's to fix, so it is an error, not
    a FAIL: a factory that returns no Runner, a model with nothing to train, a loss the
    model cannot compute or autograd cannot differentiate."""
    runner = runner_factory()
    if not isinstance(runner, Runner):
        raise ConfigError(f"{op}: runner_factory returned a {type(runner).__name__}, expected a Runner")
    if not any(runner.params.requires_grad_array()):
        raise ConfigError(f"{op}: the model has no trainable parameter (every one is frozen, or it has none): "
                          f"there is nothing to check")
    mean_gradients(runner, batch)  # ConfigError / DataError with the reason


__all__ = ["check", "CheckReport", "CheckResult"]
