"""``leantrain train``: a preset on the bundled digits data (or your own model and data),
with progress, metrics, checkpoints, a plot and a final report. Ctrl-C stops after the
current step, saves a checkpoint and exits; ``--resume DIR`` continues exactly where it
stopped.

The command is the library's first user: ``plan`` reads and checks the settings (nothing
written yet), ``build`` makes the runner, the loader and the ``LoaderTrainConfig``,
``run`` calls ``train_loader`` with the library's callbacks (``ProgressBar``,
``JSONLLogger``, the test split as ``eval_data`` and ``Interrupt`` for Ctrl-C, all
``reads_only``, so the loop checks the model once), ``report`` writes the results.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy
import torch
import torch.distributed as dist

from ..data import DataLoader, Dataset
from ..metrics import accuracy
from ..training.parallel import distributed
from ..training.loops.callbacks import Callback, EarlyStopping, ProgressBar
from ..training.loops.loggers import JSONLLogger
from ..training.loops.config import LoaderTrainConfig, TrainReport
from ..training.loops.events import StepEvent
from ..training.loops.evaluation import predict
from ..training.loops.loader_loop import train_loader
from ..samples import LossSum, TokenWeighted, loss_target
from ..training.runner.runner import Runner
from .managed import best_spec, checkpoint_path, keep_best, managed, profile_range, resumable, trackers
from .report import report_run
from .run_folder import check_folder, check_metrics, partial_start_of
from .runconfig import PRECISIONS, RunConfig, flag_values
from .usage import UserError
from .text import tokens_of
from .usermodel import build_task, collate_for

EXACT_PIECES = 8  # with --exact-reduction: items per minibatch whatever the world size (1 to 8 ranks alike)


def cmd_train(args) -> int:
    made = not (dist.is_available() and dist.is_initialized())  # a group the command makes is ended by it
    try:
        plan = plan_run(args)
        job = build_job(plan)
        prepare = check_folder(plan, args.overwrite)  # nothing written yet
        loggers = trackers(plan.out, plan.cfg.log_to, plan.main)  # a tracker that cannot run: refused here
        prepare()
        return report_run(plan, job, run_job(plan, job, loggers))
    finally:
        if made and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class Plan:
    """The settings of one command run and where it stands (nothing written yet)."""

    cfg: RunConfig
    resuming: bool
    world: int  # processes under torchrun (1 otherwise)
    main: bool  # rank 0: the one that prints and writes
    start_step: int  # the checkpoint's step when resuming

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def checkpoint(self) -> Path:
        """The checkpoint file, or with --keep-last/--keep-best the folder's name template."""
        return checkpoint_path(self.out, self.cfg)

    @property
    def metrics(self) -> Path:
        return self.out / "metrics.jsonl"


def plan_run(args) -> Plan:
    """The settings (defaults, TOML, flags, or the resumed run's), checked; the process
    group under torchrun; the step a resume starts from."""
    cfg, resuming = _config(args)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda requested but no CUDA device is available")
    # under torchrun: one process per rank; each minibatch is cut into pieces the ranks share (build_job)
    world = dist.get_world_size() if distributed.init_from_env(cfg.device, cfg.collective_timeout) else 1
    start = 0
    if resuming:
        from ..io.checkpoint import read_checkpoint

        start = int(read_checkpoint(resumable(Path(cfg.out)), f"--resume {cfg.out}")[0]["progress"]
                    .get("step", 0))
    plan = Plan(cfg, resuming, world, distributed.is_main(), start)
    if resuming and plan.main:
        check_metrics(plan.metrics)
    return plan


def _config(args) -> tuple[RunConfig, bool]:
    overrides = flag_values(args, "train")
    if args.resume == "auto":  # a restarted job: continue the --out folder's run if it has one
        cfg = RunConfig.build(args.config, overrides)
        if resumable(Path(cfg.out)) is None:
            if partial_start_of(Path(cfg.out), cfg):
                args.overwrite = True  # this same run, killed before its first checkpoint: start it again
            return cfg, False  # anything else there is refused unless --overwrite
        args.resume = cfg.out
    if args.resume is None:
        return RunConfig.build(args.config, overrides), False
    folder = Path(args.resume)
    saved = folder / "config.json"
    if not saved.is_file() or resumable(folder) is None:
        raise UserError(f"--resume {folder}: not a run folder (needs config.json and checkpoint.ckpt, or "
                        f"checkpoints/ with a whole checkpoint)")
    try:
        base = json.loads(saved.read_text())
    except (ValueError, RecursionError, OSError):
        raise UserError(f"--resume {folder}: config.json is not valid JSON") from None
    if not isinstance(base, dict):
        raise UserError(f"--resume {folder}: config.json is not a JSON object of settings")
    unknown = sorted(set(base) - RunConfig.known_keys())
    if unknown:
        raise UserError(f"--resume {folder}: config.json has unknown key(s) {', '.join(map(repr, unknown))}")
    if args.config:
        from .runconfig import read_toml

        base.update(read_toml(args.config))
    base.update({k: v for k, v in overrides.items() if v is not None})
    base["out"] = str(folder)
    return RunConfig(**base), True


# ----------------------------------------------------------------------- build
@dataclass
class Job:
    """What the run trains: the runner, the loader, the loop's config and the test split."""

    runner: Runner
    loader: DataLoader
    tcfg: LoaderTrainConfig
    classify: bool
    test_batches: list
    n_train: int
    n_test: int
    steps_per_epoch: int
    loss: object = None  # the loss setting as resolved ("model", "cross_entropy", a function)
    tokens_per_sample: Optional[float] = None  # dict samples of tokens: their mean length
    early_stop: Optional[str] = None  # why --early-stopping stopped the run (rank 0), after it ran

    @property
    def metrics(self) -> Optional[dict]:
        return {"accuracy": accuracy} if self.classify else None


def build_job(plan: Plan) -> Job:
    """The model (a preset or the user's factory), its data as a shuffled loader of
    stacked minibatches (cut into the pieces the ranks share under torchrun) and the loop's config."""
    cfg = plan.cfg
    torch.manual_seed(cfg.seed)
    # Python's and NumPy's generators too, as the API's seed= does: a data function or collate
    # drawing from random or numpy repeats between two identical runs
    random.seed(cfg.seed)
    numpy.random.seed(cfg.seed if cfg.seed < 2**32 else [cfg.seed & 0xFFFFFFFF, cfg.seed >> 32])
    factory, loss, train, test = build_task(cfg)
    runner = Runner.from_module(factory(), loss)
    if not any(runner.params.requires_grad_array()):
        raise UserError(f"--model {cfg.model or cfg.preset}: the model has no trainable parameter (every one is "
                        f"frozen, or it has none): there is nothing to train")
    if cfg.device == "cuda":
        runner.to(f"cuda:{torch.cuda.current_device()}")
    classify = loss == "cross_entropy"
    monitor, mode = keep_best(cfg.keep_best)
    gives = ("loss", "accuracy") if classify else ("loss",)
    for flag, value in (("--keep-best", cfg.keep_best), ("--early-stopping-monitor", cfg.early_stopping_monitor)):
        if value is not None and keep_best(value)[0] not in gives:
            raise UserError(f"{flag} {value}: the test split gives {', '.join(gives)}")
    collate = collate_for(cfg, train)
    test_batches = collate(512)(test)
    pieces = cfg.pieces or (EXACT_PIECES if cfg.exact_reduction else plan.world)  # items per minibatch
    piece = -(-cfg.batch_size // pieces)
    loader = DataLoader(Dataset(train), batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed, collate=collate(piece))
    steps_per_epoch = -(-len(loader) // cfg.accumulate)  # --accumulate loader batches per update
    tcfg = LoaderTrainConfig(
        epochs=cfg.epochs, optimizer=cfg.make_optimizer(), scheduler=cfg.make_schedule(steps_per_epoch),
        log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every, checkpoint_path=plan.checkpoint,
        resume_from=("auto" if managed(cfg) else plan.checkpoint) if plan.resuming else None,
        exact_reduction=cfg.exact_reduction, item_seeds=cfg.item_seeds,
        collective_timeout=None,  # the process group itself was made with --collective-timeout
        clip_grad_norm=cfg.clip_grad_norm, accumulate=cfg.accumulate, ema_decay=cfg.ema,
        autocast=PRECISIONS[cfg.precision], compile=cfg.compile, schedule_per=cfg.schedule_per,
        max_steps=cfg.max_steps, eval_data=test_batches, sharding=cfg.sharding, shard_by=cfg.shard_by,
        engine=cfg.engine,
        eval_metrics={"accuracy": accuracy} if classify else None, eval_every=cfg.eval_every,
        keep_last=cfg.keep_last, keep_best=best_spec(cfg.keep_best)[2] if cfg.keep_best else None,
        monitor=monitor or "loss", mode=mode,
        deterministic=cfg.deterministic, profile=profile_range(cfg.profile),
        profile_dir=plan.out / "profile" if cfg.profile else None,
        measure_batches=None,  # report.json's loss_before/loss_after: the mean over the training split
    )
    tokens = tokens_of(train) / len(train) if isinstance(train[0], dict) and "input_ids" in train[0] else None
    job = Job(runner, loader, tcfg, classify, test_batches, len(train), len(test), steps_per_epoch, loss, tokens)
    if plan.world > 1 and isinstance(train[0], dict) and loss == "model":
        check_pieces_agree(job, plan.world)
    return job


def check_pieces_agree(job: Job, world: int) -> None:
    """Under torchrun each rank pads and differentiates its own piece of a minibatch: a
    model loss that is the mean over its piece's tokens would train the mean of the pieces'
    means, another objective than one process's. Token-weighted losses (a ``LossSum``, as
    Hugging Face models' token losses are read) agree; a plain mean is refused here, before
    anything is written (one forward of one test piece, in eval mode, tells)."""
    runner = job.runner
    if isinstance(runner.loss_fn, TokenWeighted):
        return
    sample = job.test_batches[0]
    out = predict(runner, [sample], collect=True)[0]
    if isinstance(runner.loss_fn(out, loss_target(sample)), LossSum):
        return
    raise UserError(f"--loss model: the model's loss is a mean over each minibatch's tokens; under torchrun each of "
                    f"the {world} processes averages its own piece, so the run would train the mean of the pieces' "
                    f"means, not what one process trains. Return leantrain.LossSum(total, count) as the model's "
                    f"loss (the tokens' summed loss and their count), give --loss a function that does, or pass "
                    f"--loss model_mean to train the mean of the pieces' means")


# ------------------------------------------------------------------------- run
class Interrupt(Callback):
    """Ctrl-C asks the run to stop after the current update (it then saves and returns);
    a second Ctrl-C raises ``KeyboardInterrupt``. Under torch.distributed the ranks agree
    at epoch ends (one tiny all-reduce there, a sync), so all stop at the same update."""

    reads_only = True
    every_rank = True

    def __init__(self, device: torch.device, batches_per_epoch: int, world: int) -> None:
        self.device, self.batches_per_epoch, self.world = device, batches_per_epoch, world
        self.requested = False

    @contextlib.contextmanager
    def installed(self):
        def on_sigint(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True  # finish this step, save, exit

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)

    def on_step(self, event: StepEvent) -> bool:
        if self.world == 1:
            return self.requested
        if event.batch != self.batches_per_epoch:
            return False
        flag = torch.tensor([float(self.requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.requested = bool(flag.item())  # intentional sync: the ranks' agreement, once per epoch
        return self.requested


def run_job(plan: Plan, job: Job, loggers: list) -> TrainReport:
    """``train_loader`` with the library's callbacks: the bar and a line per epoch, the
    metrics file, Ctrl-C, and ``--log-to``'s ``loggers``."""
    cfg = plan.cfg

    def epoch_line(step: int, results: dict) -> str:
        shown = f"test accuracy {results['accuracy']:.4f}" if job.classify else f"test loss {results['loss']:.6f}"
        if cfg.eval_every is not None:
            return f"step {step:>5}  {shown}"
        # epochs numbered from 0, as StepEvent.epoch and the metrics files number them (Lightning's "Epoch 0")
        return f"epoch {step // job.steps_per_epoch - 1:>3} of {cfg.epochs}: step {step:>5}  {shown}"

    if plan.main:
        describe(plan, job)
    interrupt = Interrupt(job.runner.device, len(job.loader), plan.world)
    callbacks = [interrupt, ProgressBar(file=None, eval_line=epoch_line, disable=None),
                 JSONLLogger(plan.metrics, epoch_results="test_"), *loggers]
    if cfg.early_stopping is not None:  # rank 0's callback; the stop is the job's (every rank stops there)
        watched, direction = keep_best(cfg.early_stopping_monitor)
        callbacks.append(EarlyStopping(watched, cfg.early_stopping, direction,
                                       stopping_threshold=cfg.early_stopping_threshold,
                                       divergence_threshold=cfg.divergence_threshold))
    with interrupt.installed():
        report, _ = train_loader(job.runner, job.tcfg, job.loader, log=None, callbacks=callbacks)
    stopper = callbacks[-1] if isinstance(callbacks[-1], EarlyStopping) else None
    if stopper is not None and stopper.stopped_step is not None and not interrupt.requested:
        job.early_stop = stopper.reason
    return report


ENGINE_SAYS = {"ddp": "torch's all-reduce", "fsdp2": "torch's fully_shard"}


def describe(plan: Plan, job: Job) -> None:
    """The two lines a run starts with: the job, and the slots it trains."""
    cfg, params = plan.cfg, job.runner.params
    reps = params.canonical_slot_indices()
    aliases = sum(1 for i, c in enumerate(reps) if c is not None and c != i)
    frozen = sum(1 for c in reps if c is None)
    print(f"leantrain train: {cfg.model or cfg.preset}, {job.n_train} train / {job.n_test} test samples, "
          f"{cfg.epochs} epochs x {job.steps_per_epoch} steps, {cfg.optimizer} lr={cfg.lr}, "
          f"batch {cfg.batch_size} x accumulate {cfg.accumulate}, device {cfg.device}"
          + (f", {plan.world} processes" if plan.world > 1 else "")
          + (f", engine {cfg.engine} ({ENGINE_SAYS[cfg.engine]}: not the bits of one process)" if plan.world > 1
             and cfg.engine in ENGINE_SAYS else "")
          + (f", precision {cfg.precision}" if cfg.precision != "fp32" else ""))
    print(f"slots: {len(params)} ({aliases} aliased, {frozen} frozen), "
          f"{sum(s.host.numel() for s in params.storages()):,} values in {len(params.storages())} storages"
          + (f"; resuming at step {plan.start_step}" if plan.resuming else ""))
