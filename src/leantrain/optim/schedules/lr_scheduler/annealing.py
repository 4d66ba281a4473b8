"""torch's annealing and cycling schedulers: ``CosineAnnealingLR`` (its in-place recursion,
rise past ``T_max`` included), ``CosineAnnealingWarmRestarts``, ``CyclicLR`` and
``OneCycleLR`` (both cycling the momentum or first beta by default, as torch's do) and
``swa_utils.SWALR``, each in torch's order of operations (``replay.py``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from ....errors import ConfigError
from ....validate import check_count, is_number
from .replay import LRScheduler, Run, current, per_group, set_rate


def _rates(op: str, name: str, value, groups: int) -> list:
    values = per_group(op, name, value, groups)
    for v in values:
        if not (is_number(v) and 0 <= v < math.inf):
            raise ConfigError(f"{op}: {name} must be a finite rate >= 0 (or one per param group), got {value!r}")
    return values


def _anneal(strategy: str, start: float, end: float, pct: float) -> float:
    if strategy == "cos":
        return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
    return (end - start) * pct + start


def _check_strategy(op: str, strategy) -> str:
    if strategy not in ("cos", "linear"):
        raise ConfigError(f"{op}: anneal_strategy must be 'cos' or 'linear', got {strategy!r}")
    return strategy


class _Cycling(LRScheduler):
    """A scheduler that may cycle the optimizer's momentum (or first beta) against its rate.
    ``starts_momentum``: it cycles the momentum of an optimizer made with none (torch's SGD
    then keeps a buffer from the first step, the momentum written before it: the loop runs
    that SGD with a buffer, ``loops/loop_checks.run_optimizer``)."""

    cycle_momentum = False
    starts_momentum = False

    def _momentum_bounds(self, base_momentum, max_momentum) -> None:
        if not self.cycle_momentum:
            return
        if self.momentum_kind is None:
            raise ConfigError(
                f"{self.op}: cycle_momentum=True sets the optimizer's momentum (or first beta) at every step; "
                f"give the leantrain optimizer itself (SGD with momentum, RMSprop with momentum, Adam's family), "
                f"or set cycle_momentum=False")
        if self.momentum_kind == "momentum" and not all(m > 0 for m in self.momenta):
            if any(m > 0 for m in self.momenta):
                raise ConfigError(
                    f"{self.op}: cycle_momentum=True with param groups made with momentum=0 beside groups with "
                    f"momentum: give every group momentum, or none, or set cycle_momentum=False")
            self.starts_momentum = True  # torch writes the momentum before the first step: a buffer from there
        self.base_momentums = per_group(self.op, "base_momentum", base_momentum, self.groups)
        self.max_momentums = per_group(self.op, "max_momentum", max_momentum, self.groups)
        for name, values in (("base_momentum", self.base_momentums), ("max_momentum", self.max_momentums)):
            if not all(is_number(v) and 0 <= v < 1 for v in values):
                raise ConfigError(f"{self.op}: {name} must be in [0, 1) (or one per param group), got {values!r}")

    def _write_max_momentum(self, run: Run) -> None:
        if not self.cycle_momentum:
            return
        for g, top, low in zip(run.groups, self.max_momentums, self.base_momentums):
            _set_momentum(self, g, top)
            g["max_momentum"], g["base_momentum"] = top, low

    def cycles_momentum(self) -> bool:
        return self.cycle_momentum


def _set_momentum(plan: LRScheduler, group: dict, value: float) -> None:
    if plan.momentum_kind == "betas":
        group["betas"] = (value, *group["betas"][1:])
    else:
        group["momentum"] = value


class CosineAnnealingLR(LRScheduler):
    """``eta_min + (base - eta_min) * (1 + cos(pi * t / T_max)) / 2`` by torch's in-place
    recursion (past ``T_max`` the rate rises again, as torch's does)."""

    torch_name = "CosineAnnealingLR"

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.T_max = check_count(self.op, "T_max", T_max, 1)
        if not (is_number(eta_min) and math.isfinite(eta_min)):
            raise ConfigError(f"{self.op}: eta_min must be a finite number, got {eta_min!r}")
        self.eta_min = eta_min

    def get_lr(self, run: Run) -> list:
        t, n, low = run.last_epoch, self.T_max, self.eta_min
        if run.initial:
            return current(run)
        if run.step_count == 1 and t > 0:
            return [low + (base - low) * (1 + math.cos(t * math.pi / n)) / 2 for base in run.base_lrs]
        if (t - 1 - n) % (2 * n) == 0:
            return [g["lr"] + (base - low) * (1 - math.cos(math.pi / n)) / 2
                    for base, g in zip(run.base_lrs, run.groups)]
        return [(1 + math.cos(math.pi * t / n)) / (1 + math.cos(math.pi * (t - 1) / n)) * (g["lr"] - low) + low
                for g in run.groups]

    def closed_form(self, run: Run) -> list:
        return [self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * run.last_epoch / self.T_max)) / 2
                for base in run.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """A cosine from the base rate to ``eta_min`` over ``T_0`` steps, restarting, each
    period ``T_mult`` times the last (torch's counters ``T_cur``/``T_i``)."""

    torch_name = "CosineAnnealingWarmRestarts"

    def __init__(self, optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.T_0 = check_count(self.op, "T_0", T_0, 1)
        self.T_mult = check_count(self.op, "T_mult", T_mult, 1)
        if not (is_number(eta_min) and math.isfinite(eta_min)):
            raise ConfigError(f"{self.op}: eta_min must be a finite number, got {eta_min!r}")
        self.eta_min = eta_min

    def attach(self, run: Run) -> None:
        run.T_i, run.T_cur = self.T_0, self.last_epoch

    def max_rate(self) -> float:
        return max(max(self.bases), self.eta_min)

    def get_lr(self, run: Run) -> list:
        return [self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * run.T_cur / run.T_i)) / 2
                for base in run.base_lrs]

    def run_step(self, run: Run) -> None:
        if run.last_epoch < 0:  # the first step: epoch 0 (torch's explicit-epoch branch)
            run.T_i, run.T_cur, run.last_epoch = self.T_0, 0, 0
        else:
            run.last_epoch += 1
            run.T_cur += 1
            if run.T_cur >= run.T_i:
                run.T_cur = run.T_cur % run.T_i
                run.T_i = run.T_i * self.T_mult
        for g, lr in zip(run.groups, self.get_lr(run)):
            set_rate(g, lr)


class CyclicLR(_Cycling):
    """The rate cycling between ``base_lr`` and ``max_lr`` (``triangular``, ``triangular2``,
    ``exp_range`` or the user's ``scale_fn``), the momentum against it between
    ``max_momentum`` and ``base_momentum`` (``cycle_momentum``)."""

    torch_name = "CyclicLR"

    def __init__(self, optimizer, base_lr, max_lr, step_size_up: int = 2000, step_size_down: Optional[int] = None,
                 mode: str = "triangular", gamma: float = 1.0, scale_fn: Optional[Callable[[float], float]] = None,
                 scale_mode: str = "cycle", cycle_momentum: bool = True, base_momentum=0.8, max_momentum=0.9,
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        op = self.op
        self.base_lr = _rates(op, "base_lr", base_lr, self.groups)
        self.max_lrs = _rates(op, "max_lr", max_lr, self.groups)
        up = check_count(op, "step_size_up", step_size_up, 1)
        down = up if step_size_down is None else check_count(op, "step_size_down", step_size_down, 1)
        self.total_size = float(up) + float(down)
        self.step_ratio = float(up) / self.total_size
        if scale_fn is None and mode not in ("triangular", "triangular2", "exp_range"):
            raise ConfigError(f"{op}: mode must be 'triangular', 'triangular2' or 'exp_range' (or give scale_fn), "
                              f"got {mode!r}")
        if scale_fn is not None and not callable(scale_fn):
            raise ConfigError(f"{op}: scale_fn must be a function, got {type(scale_fn).__name__}")
        if scale_mode not in ("cycle", "iterations"):
            raise ConfigError(f"{op}: scale_mode must be 'cycle' or 'iterations', got {scale_mode!r}")
        if not is_number(gamma):
            raise ConfigError(f"{op}: gamma must be a number, got {gamma!r}")
        self.mode, self.gamma, self.scale_fn_custom = mode, gamma, scale_fn
        self.scale_mode = scale_mode if scale_fn is not None else ("iterations" if mode == "exp_range" else "cycle")
        if not isinstance(cycle_momentum, bool):
            raise ConfigError(f"{op}: cycle_momentum must be True or False, got {cycle_momentum!r}")
        self.cycle_momentum = cycle_momentum
        self._momentum_bounds(base_momentum, max_momentum)

    def scale_fn(self, x: float) -> float:
        if self.scale_fn_custom is not None:
            return self.scale_fn_custom(x)
        if self.mode == "triangular":
            return 1.0
        if self.mode == "triangular2":
            return 1 / (2.0 ** (x - 1))
        return self.gamma ** x

    def attach(self, run: Run) -> None:
        if self.last_epoch == -1:
            for g, lr in zip(run.groups, self.base_lr):
                set_rate(g, lr)
            self._write_max_momentum(run)

    def after_bases(self, run: Run) -> None:
        run.base_lrs = list(self.base_lr)

    def get_lr(self, run: Run) -> list:
        t = run.last_epoch
        cycle = math.floor(1 + t / self.total_size)
        x = 1.0 + t / self.total_size - cycle
        factor = x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)
        at = cycle if self.scale_mode == "cycle" else t
        lrs = [base + (top - base) * factor * self.scale_fn(at) for base, top in zip(run.base_lrs, self.max_lrs)]
        if self.cycle_momentum:
            for g, low, top in zip(run.groups, self.base_momentums, self.max_momentums):
                _set_momentum(self, g, top - (top - low) * factor * self.scale_fn(at))
        return lrs


class OneCycleLR(_Cycling):
    """The 1cycle policy: up from ``max_lr / div_factor`` to ``max_lr`` over ``pct_start`` of
    ``total_steps`` (or ``epochs * steps_per_epoch``), then down to ``initial /
    final_div_factor`` (``three_phase``: back to the initial rate first); the momentum
    against it (``cycle_momentum``)."""

    torch_name = "OneCycleLR"

    def __init__(self, optimizer, max_lr, total_steps: Optional[int] = None, epochs: Optional[int] = None,
                 steps_per_epoch: Optional[int] = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum=0.85, max_momentum=0.95, div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        op = self.op
        if total_steps is not None:
            self.total_steps = check_count(op, "total_steps", total_steps, 1)
        elif epochs is not None and steps_per_epoch is not None:
            self.total_steps = (check_count(op, "epochs", epochs, 1)
                                * check_count(op, "steps_per_epoch", steps_per_epoch, 1))
        else:
            raise ConfigError(f"{op}: give total_steps, or epochs and steps_per_epoch")
        if not (is_number(pct_start) and 0 <= pct_start <= 1):
            raise ConfigError(f"{op}: pct_start must be in [0, 1], got {pct_start!r}")
        self.anneal_strategy = _check_strategy(op, anneal_strategy)
        for name, v in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
            if not (is_number(v) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{op}: {name} must be a finite number > 0, got {v!r}")
        self.max_lrs = _rates(op, "max_lr", max_lr, self.groups)
        self.div_factor, self.final_div_factor, self.three_phase = div_factor, final_div_factor, bool(three_phase)
        n, p = self.total_steps, pct_start
        if three_phase:
            self.phases = [(float(p * n) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                           (float(2 * p * n) - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"),
                           (n - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum")]
        else:
            self.phases = [(float(p * n) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                           (n - 1, "max_lr", "min_lr", "base_momentum", "max_momentum")]
        if not isinstance(cycle_momentum, bool):
            raise ConfigError(f"{op}: cycle_momentum must be True or False, got {cycle_momentum!r}")
        self.cycle_momentum = cycle_momentum
        self._momentum_bounds(base_momentum, max_momentum)

    group_values = None  # a port's groups as torch's constructor left them (``porting.py``)

    def attach(self, run: Run) -> None:
        if self.last_epoch == -1:
            for k, (g, top) in enumerate(zip(run.groups, self.max_lrs)):
                if self.group_values is not None:
                    g.update(self.group_values[k])
                    continue
                g["initial_lr"] = top / self.div_factor
                g["max_lr"] = top
                g["min_lr"] = g["initial_lr"] / self.final_div_factor
            self._write_max_momentum(run)

    def get_lr(self, run: Run) -> list:
        t = run.last_epoch
        if t > self.total_steps:
            raise ConfigError(f"{self.op}: index {t} is past total_steps={self.total_steps} (torch's OneCycleLR "
                              f"refuses to step past its end); make total_steps cover the run")
        lrs = []
        for g in run.groups:
            start = 0.0
            for i, (end, lr_from, lr_to, m_from, m_to) in enumerate(self.phases):
                if t <= end or i == len(self.phases) - 1:
                    pct = (t - start) / (end - start)
                    lr = _anneal(self.anneal_strategy, g[lr_from], g[lr_to], pct)
                    if self.cycle_momentum:
                        _set_momentum(self, g, _anneal(self.anneal_strategy, g[m_from], g[m_to], pct))
                    break
                start = end
            lrs.append(lr)
        return lrs

    def max_rate(self) -> float:
        return max(max(self.max_lrs), max(self.max_lrs) / self.div_factor)


class SWALR(LRScheduler):
    """``torch.optim.swa_utils.SWALR``: from the optimizer's rate to ``swa_lr`` over
    ``anneal_epochs`` steps (``cos`` or ``linear``), then ``swa_lr``."""

    torch_name = "SWALR"

    def __init__(self, optimizer, swa_lr, anneal_epochs: int = 10, anneal_strategy: str = "cos",
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)
        self.swa_lrs = _rates(self.op, "swa_lr", swa_lr, self.groups)
        self.anneal_strategy = _check_strategy(self.op, anneal_strategy)
        self.anneal_epochs = check_count(self.op, "anneal_epochs", anneal_epochs, 0)

    def attach(self, run: Run) -> None:
        for g, lr in zip(run.groups, self.swa_lrs):
            g["swa_lr"] = lr

    def _alpha(self, t: float) -> float:
        return t if self.anneal_strategy == "linear" else (1 - math.cos(math.pi * t)) / 2

    def get_lr(self, run: Run) -> list:
        step = run.step_count - 1
        if self.anneal_epochs == 0:
            step = max(1, step)
        prev_alpha = self._alpha(max(0, min(1, (step - 1) / max(1, self.anneal_epochs))))
        prev = [g["swa_lr"] if prev_alpha == 1 else (g["lr"] - prev_alpha * g["swa_lr"]) / (1 - prev_alpha)
                for g in run.groups]
        alpha = self._alpha(max(0, min(1, step / max(1, self.anneal_epochs))))
        return [g["swa_lr"] * alpha + lr * (1 - alpha) for g, lr in zip(run.groups, prev)]
