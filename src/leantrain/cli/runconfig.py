"""The settings of ``leantrain train`` and ``leantrain check``: one table of fields.

Each row of ``FIELDS`` is one setting: its TOML key (and ``RunConfig`` field), its flag
(``--key-with-dashes``), its default, its argparse type, its help text, its check, and
the subcommands that take it. The table generates the argparse flags (``add_flags``),
the TOML keys (``read_toml``) and the frozen ``RunConfig`` (each row's check in
``__post_init__``, with the library's own predicates). A new setting is one row here
and its use where the run is built (``cli/train.py``).

Sources, later wins: the defaults, a TOML file (same keys as the flags, with
underscores), then command-line flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .. import optim
from ..errors import ConfigError
from ..io.atomic import path_problem
from ..training.loops.config import SCHEDULE_PER
from ..training.parallel.engines import ENGINES
from ..training.parallel.sharding.plan import SHARD_BY, SHARDING_MODES
from ..validate import is_int, is_number
from .digits import PRESETS
from .run_schedules import SCHEDULERS, make_schedule, schedule_works
from .managed import TRACKERS, check_keep_best, check_log_to, check_profile
from .usage import natural, positive, seed as seed_arg

DEVICES = ("cpu", "cuda")
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}  # -> the loops' autocast
# The optimizers whose hyperparameters include a weight decay (read from their records).
DECAYING = tuple(kind for kind, h in optim.HYPERS.items() if "weight_decay" in {f.name for f in dataclasses.fields(h)})
SWITCH = "switch"  # a flag without a value (store_true); the TOML key takes true or false
Check = Callable[[Any], Optional[str]]  # the rule a value breaks, or None


def one_of(value: object, choices) -> bool:
    """``value`` is one of the string ``choices`` (a list or a table never is)."""
    return isinstance(value, str) and value in choices


def _choice(choices) -> Check:
    return lambda v: None if one_of(v, choices) else f"expected one of {', '.join(choices)}"


def _integer(low: int, optional: bool = False) -> Check:
    return lambda v: None if (optional and v is None) or (is_int(v) and v >= low) else f"expected an integer >= {low}"


def _seed(v) -> Optional[str]:
    if not is_int(v) or v < 0:
        return "expected an integer >= 0"
    return "expected an integer below 2**64 (torch's seed range)" if v >= 2**64 else None


def _finite(rule: str, ok: Callable[[float], bool], optional: bool = False) -> Check:
    return lambda v: None if (optional and v is None) or (is_number(v) and math.isfinite(v) and ok(v)) else rule


def _boolean(v) -> Optional[str]:
    return None if isinstance(v, bool) else "expected true or false"


def _reference(v) -> Optional[str]:
    return None if v is None or (isinstance(v, str) and ":" in v) else "expected 'package.module:name'"


def _loss(v) -> Optional[str]:
    ok = v is None or (isinstance(v, str) and (one_of(v, ("mse", "cross_entropy", "model", "model_mean")) or ":" in v))
    return None if ok else "expected mse, cross_entropy, model, model_mean or 'package.module:function'"


def _arguments(v) -> Optional[str]:
    ok = v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v))
    return None if ok else "expected a table of key = value (e.g. \"momentum = 0.9, nesterov = true\")"


def key_values(text: str) -> dict:
    """``--optimizer-args "momentum = 0.9, betas = [0.9, 0.95]"``: the keys of a TOML inline table."""
    try:
        return tomllib.loads(f"x = {{{text}}}")["x"]
    except tomllib.TOMLDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected key = value pairs separated by commas ({e})") from None
    except RecursionError:  # arrays or tables nested thousands deep: the parser's own recursion runs out
        raise argparse.ArgumentTypeError("nested too deep to read (arrays or tables within each other)") from None


def _optimizer_keys() -> str:
    """Each optimizer's keyword arguments, from the constructors (the table's rows)."""
    out = []
    for kind in optim.OPTIMIZERS:
        names = [n for n, p in inspect.signature(optim.CONSTRUCTORS[kind]).parameters.items()
                 if p.kind != p.VAR_KEYWORD and n not in ("lr", "numerics")]
        out.append(f"{kind}: {', '.join(names)}")
    return "; ".join(out)


def _optimizer_works(c) -> Optional[str]:
    if c.weight_decay is not None and c.optimizer not in DECAYING:
        return None  # --weight-decay's own rule says what is wrong
    try:
        c.make_optimizer()
    except ConfigError as e:
        return str(e)
    return None


def _folder(v) -> Optional[str]:
    if not (isinstance(v, str) and v):
        return "expected a folder path"
    problem = path_problem(v)
    return None if problem is None else f"expected a folder path the OS can make ({problem})"


@dataclass(frozen=True)
class Field:
    """One setting (see the module docstring). ``needs(cfg)``: a rule across settings,
    checked after every row's own check."""

    name: str
    default: Any
    help: str
    check: Check
    arg: Any = str
    commands: tuple = ("train",)
    metavar: Optional[str] = None
    needs: Optional[Callable[[Any], Optional[str]]] = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


BOTH = ("train", "check")
FIELDS = (
    Field("preset", "digits-mlp", "digits-mlp (tied weights), digits-cnn (BatchNorm) or text-gpt (a character "
          "GPT with a tied head on the bundled Python docs)", _choice(PRESETS), commands=BOTH),
    Field("epochs", 20, "passes over the training split", _integer(1), positive),
    Field("batch_size", 32, "items stacked into one forward pass", _integer(1), positive, BOTH),
    Field("accumulate", 1, "minibatches averaged into one update", _integer(1), positive),
    Field("optimizer", "adam", ", ".join(optim.OPTIMIZERS), _choice(optim.OPTIMIZERS), commands=BOTH),
    Field("lr", 0.002, "the (peak) learning rate", _finite("expected a finite number > 0", lambda v: v > 0), float,
          BOTH),
    Field("optimizer_args", None, "the optimizer's other keyword arguments, torch's names, as key = value pairs "
          "(e.g. \"betas = [0.9, 0.95], amsgrad = true\"); in the TOML file an inline table. Keys: "
          + _optimizer_keys(), _arguments, key_values, BOTH, metavar="KEYS", needs=_optimizer_works),
    Field("scheduler", "none", ", ".join(SCHEDULERS) + ". Trainer's lr_scheduler_type names mean what they mean "
          "there (linear, cosine... as transformers' get_scheduler); warmup_cosine is upstream's warm-up cosine "
          "down to lr/20; wsd and plateau name warmup_stable_decay and reduce_lr_on_plateau. Per epoch; per update "
          "with --schedule-per step; reduce_lr_on_plateau and greedy read the test split's loss each epoch",
          _choice(SCHEDULERS), needs=lambda c: None if c.scheduler_args else schedule_works(c)),
    Field("scheduler_args", None, "the schedule's other keyword arguments, Trainer's lr_scheduler_kwargs (e.g. "
          "\"num_cycles = 2\" for cosine, \"min_lr = 1e-5\" for cosine_with_min_lr, \"gamma = 0.5, milestones = "
          "[10, 20]\" for multi_step, \"patience = 2\" for reduce_lr_on_plateau)", _arguments, key_values,
          metavar="KEYS", needs=lambda c: schedule_works(c) if c.scheduler_args else None),
    Field("seed", 0, "model initialisation and shuffling seed", _seed, seed_arg, BOTH),
    Field("device", "cpu", "cpu or cuda", _choice(DEVICES)),
    Field("out", "runs/latest", "output folder", _folder),
    Field("log_every", 5, "read the loss every N steps (0: never)", _integer(0), natural),
    Field("checkpoint_every", 100, "save every N steps (0: only at the end)", _integer(0), natural),
    Field("model", None, "your own model: package.module:factory (instead of a preset)", _reference, commands=BOTH),
    Field("data", None, "your own data: package.module:function returning (train, test)", _reference,
          commands=BOTH),
    Field("loss", None, "mse, cross_entropy, model (the output's own loss; token-weighted on a Hugging Face model, "
          "Trainer's objective), model_mean (each item's mean alike) or package.module:function "
          "(default: the preset's, cross_entropy for digits, model for text-gpt and dict samples)", _loss,
          commands=BOTH),
    Field("collate", None, "package.module:function making a loader item from a list of samples (default: stack "
          "(x, y) pairs; pad token dicts with leantrain.collate:pad_tokens)", _reference, commands=BOTH),
    Field("weight_decay", None, f"weight decay ({' or '.join(DECAYING)})",
          _finite("expected a finite number >= 0", lambda v: v >= 0, optional=True), float, BOTH,
          needs=lambda c: None if c.weight_decay is None or c.optimizer in DECAYING
          else f"only {', '.join(DECAYING)} take a weight decay"),
    Field("warmup", 0, "warm-up length of the schedule (epochs; updates with --schedule-per step): Trainer's "
          "warmup_steps", _integer(0), natural),
    Field("warmup_ratio", None, "warm-up as a share of the run, in [0, 1): ceil(ratio * indices), as Trainer",
          _finite("expected a number in [0, 1)", lambda v: 0 <= v < 1, optional=True), float,
          needs=lambda c: None if c.warmup_ratio is None else "give --warmup or --warmup-ratio, not both"
          if c.warmup else "--warmup-ratio needs a --scheduler (none has no warm-up to give a length)"
          if c.scheduler == "none" else None),
    Field("schedule_per", "epoch", "index the schedule by epoch (default) or by update (a warm-up over updates)",
          _choice(SCHEDULE_PER)),
    Field("max_steps", None, "stop after N updates (mid-epoch if need be)", _integer(1, optional=True), positive,
          metavar="N"),
    Field("exact_reduction", False, "under torchrun: fold every item's gradient in order, giving the bits of a "
          "one-process run with this same flag on any number of processes (it cuts each minibatch into --pieces "
          "items, so it is not the bits of a run without it: BatchNorm then sees smaller batches)",
          _boolean, SWITCH),
    Field("item_seeds", False, "each item's random draws (dropout) from a generator seeded for it (without: "
          "every item draws what it draws in one process, on any number of processes); the bits of a one-process "
          "run with this same flag", _boolean, SWITCH),
    Field("sharding", None, "under torchrun: optimizer (ZeRO-1: each rank keeps its share of the optimizer "
          "state), gradients (ZeRO-2: of the reduced gradients too) or parameters (ZeRO-3: of the parameters too, "
          "each module's gathered around its use); the checkpoint becomes a folder",
          lambda v: None if v is None or one_of(v, SHARDING_MODES) else f"expected one of {', '.join(SHARDING_MODES)}"),
    Field("engine", "leantrain", "under torchrun: leantrain (its own data parallel and --sharding; the bits of one "
          "process with --exact-reduction), ddp (torch's DistributedDataParallel reduces the gradients: the "
          "engine your cluster tunes) or fsdp2 (torch's fully_shard runs the forwards and backwards on sharded "
          "parameters; the checkpoint becomes a folder); ddp and fsdp2 take no --sharding or --exact-reduction",
          _choice(ENGINES),
          needs=lambda c: None if c.engine == "leantrain" or not (c.sharding or c.exact_reduction or c.compile)
          else f"--engine {c.engine} is torch's: it takes neither --sharding nor --exact-reduction "
               "(those are --engine leantrain's), nor --compile yet"),
    Field("shard_by", "range", "with --sharding: range (each slot cut at multiples of 64 elements) or slot (whole "
          "slots per rank: clipping by norm then has clip_grad_norm_'s bits)", _choice(SHARD_BY)),
    Field("pieces", None, "cut each minibatch into N items shared by the ranks (default: one per rank; 8 with "
          "--exact-reduction, so 1 to 8 processes give the same bits)", _integer(1, optional=True), positive,
          metavar="N"),
    Field("collective_timeout", 300.0, "under torchrun: how long a rank waits for the others before failing",
          _finite("expected seconds > 0", lambda v: 0 < v < 10**7), float, metavar="SECONDS"),
    Field("clip_grad_norm", None, "clip the global L2 norm of each update's gradient to X (norm logged in metrics)",
          _finite("expected a finite number > 0", lambda v: v > 0, optional=True), float, metavar="X"),
    Field("ema", None, "keep a moving average of the weights (e.g. 0.999), saved and evaluated at the end",
          _finite("expected a decay in [0, 1)", lambda v: 0 <= v < 1, optional=True), float, metavar="DECAY"),
    Field("precision", "fp32", "fp32, bf16 (autocast) or fp16 (autocast, loss scaling)", _choice(PRECISIONS)),
    Field("decay_matrices_only", False, "with --weight-decay: no decay on biases and norms (per-slot settings)",
          _boolean, SWITCH, needs=lambda c: None if not c.decay_matrices_only or c.weight_decay is not None
          else "needs --weight-decay"),
    Field("compile", False, "compile each item's loss and gradients with torch.compile (may round differently)",
          _boolean, SWITCH),
    Field("eval_every", None, "evaluate on the test split every N updates (default: after every epoch)",
          _integer(1, optional=True), positive, metavar="N"),
    Field("keep_last", None, "keep a folder of checkpoints (checkpoints/stepN.ckpt), the last K of them",
          _integer(1, optional=True), positive, metavar="K"),
    Field("keep_best", None, "keep the best checkpoint(s) by a test metric: METRIC (loss, accuracy), :min or :max "
          "(by default min for losses, max otherwise), :K to keep the best K (a bare K: the best K by the loss); "
          "each evaluation then saves a checkpoint", check_keep_best, metavar="METRIC"),
    Field("early_stopping", None, "stop when the test metric of --early-stopping-monitor has not improved for "
          "PATIENCE evaluations in a row (0: the first evaluation without improvement); a NaN or inf stops at once",
          _integer(0, optional=True), int, metavar="PATIENCE"),
    Field("early_stopping_monitor", "loss", "with --early-stopping: the test metric watched, METRIC[:min|max] (as "
          "--keep-best)", check_keep_best, metavar="METRIC", needs=lambda c: _with_early_stopping(c, "loss")),
    Field("early_stopping_threshold", None, "with --early-stopping: stop once the metric reaches X (good enough)",
          _finite("expected a finite number", lambda v: True, optional=True), float, metavar="X",
          needs=lambda c: _with_early_stopping(c, None, "early_stopping_threshold")),
    Field("divergence_threshold", None, "with --early-stopping: stop once the metric is worse than X (diverging)",
          _finite("expected a finite number", lambda v: True, optional=True), float, metavar="X",
          needs=lambda c: _with_early_stopping(c, None, "divergence_threshold")),
    Field("log_to", None, "also log to " + ", ".join(TRACKERS) + " (comma-separated; wandb and mlflow need "
          "pip install 'leantrain[wandb]' or 'leantrain[mlflow]')", check_log_to, metavar="LIST"),
    Field("profile", None, "profile updates A to B with torch.profiler, the trace in OUT/profile", check_profile,
          metavar="A:B"),
    Field("deterministic", False, "torch's deterministic algorithms only (an operation without one stops the run, "
          "named)", _boolean, SWITCH),
)
BY_NAME = {f.name: f for f in FIELDS}


def add_flags(parser, command: str) -> None:
    """The flags of ``command`` (``"train"`` or ``"check"``), one per row that it takes;
    each parses to ``None`` when absent, so a TOML file's value stands."""
    for f in FIELDS:
        if command not in f.commands:
            continue
        shown = f" (default {f.default})" if f.default not in (None, False) else ""
        if f.arg == SWITCH:
            parser.add_argument(f.flag, action="store_true", default=None, help=f.help)
        else:
            parser.add_argument(f.flag, type=f.arg, metavar=f.metavar, help=f.help + shown)


def flag_values(args, command: str) -> dict[str, Any]:
    """The settings given as flags (``None``: not given)."""
    return {f.name: getattr(args, f.name, None) for f in FIELDS if command in f.commands}


def _post_init(self) -> None:
    for f in FIELDS:
        rule = f.check(getattr(self, f.name))
        if rule is not None:
            raise ConfigError(f"{f.flag}: {rule}, got {getattr(self, f.name)!r}")
    for f in FIELDS:
        rule = f.needs(self) if f.needs is not None else None
        if rule is not None:
            raise ConfigError(f"{f.flag}: {rule}, got {getattr(self, f.name)!r}")


class _Methods:
    """What a ``RunConfig`` does besides holding its fields."""

    @classmethod
    def build(cls, toml_path: Optional[str], overrides: dict[str, Any]) -> "RunConfig":
        values: dict[str, Any] = {}
        if toml_path is not None:
            values.update(read_toml(toml_path))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def known_keys(cls) -> set[str]:
        return set(BY_NAME)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def make_optimizer(self) -> optim.Optimizer:
        make = optim.OPTIMIZERS[self.optimizer]
        extra = dict(self.optimizer_args or {})
        if "lr" in extra:
            raise ConfigError("--optimizer-args: give the rate with --lr, not in the arguments")
        if self.weight_decay is not None:
            opt = make(self.lr, weight_decay=self.weight_decay, **extra)
            return opt.per_slot(no_decay_on_vectors) if self.decay_matrices_only else opt
        return make(self.lr, **extra)

    def make_schedule(self, steps_per_epoch: int) -> Optional[optim.Schedule]:
        """The run's schedule (``run_schedules.make_schedule``)."""
        return make_schedule(self, steps_per_epoch)


# The run's settings: a frozen dataclass with one field per row, checked when built.
RunConfig = dataclasses.make_dataclass(
    "RunConfig", [(f.name, Any, dataclasses.field(default=f.default)) for f in FIELDS], bases=(_Methods,),
    frozen=True, namespace={"__post_init__": _post_init, "__module__": __name__},
)


def _with_early_stopping(c, default, name: str = "early_stopping_monitor") -> Optional[str]:
    return "needs --early-stopping" if c.early_stopping is None and getattr(c, name) != default else None


def no_decay_on_vectors(p) -> dict:
    """The usual split: weight decay on matrices and kernels, none on biases and norms."""
    return {"weight_decay": 0.0} if len(p.shape) < 2 else {}


def read_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a valid TOML file ({e})") from None
    except RecursionError:  # arrays or tables nested thousands deep: the parser's own recursion runs out
        raise ConfigError(f"{path}: not a readable TOML file (arrays or tables nested too deep)") from None
    if "train" in data and len(data) > 1:  # both places: one of them would be dropped silently
        others = sorted(k for k in data if k != "train")
        raise ConfigError(f"{path}: settings both at the top level ({', '.join(others[:5])}) and in a [train] "
                          f"table; put them all in one place (the top level, or under [train])")
    data = data.get("train", data)  # keys at the top level or under [train]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: 'train' must be a table ([train] with key = value lines), got {data!r:.60}")
    unknown = sorted(set(data) - set(BY_NAME))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(BY_NAME))}")
    return data
