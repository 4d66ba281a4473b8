"""``leantrain train``: a preset on the bundled digits data, with progress, metrics,
checkpoints, a plot and a final report. Ctrl-C stops after the current step, saves a
checkpoint and exits; ``--resume DIR`` continues exactly where it stopped."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..io.atomic import atomic_write_bytes
from ..training import distributed
from .usage import EXIT_INTERRUPTED, UserError
from ..training.config import LoaderTrainConfig
from ..data import DataLoader, Dataset
from ..metrics import accuracy
from ..training.evaluation import evaluate
from .digits import stack_minibatches
from .usermodel import build_task
from ..training.loader_loop import train_loader
from .plotting import plot_metrics
from .runconfig import PRECISIONS, RunConfig
from ..training.runner import Runner
from ..training.events import StepEvent

FLAGS = ("preset", "epochs", "batch_size", "accumulate", "optimizer", "lr", "scheduler", "seed",
         "device", "out", "log_every", "checkpoint_every", "model", "data", "loss", "weight_decay", "warmup",
         "exact_reduction", "collective_timeout", "clip_grad_norm", "ema", "precision", "decay_matrices_only",
         "compile", "schedule_per", "max_steps")


def _config(args) -> tuple[RunConfig, bool]:
    overrides = {k: getattr(args, k) for k in FLAGS}
    if args.resume == "auto":  # a restarted job: continue the --out folder's run if it has one
        cfg = RunConfig.build(args.config, overrides)
        if not (Path(cfg.out) / "checkpoint.ckpt").is_file():
            if _partial_start_of(Path(cfg.out), cfg):
                args.overwrite = True  # this same run, killed before its first checkpoint: start it again
            return cfg, False  # anything else there is refused unless --overwrite
        args.resume = cfg.out
    if args.resume is None:
        return RunConfig.build(args.config, overrides), False
    folder = Path(args.resume)
    saved = folder / "config.json"
    if not saved.is_file() or not (folder / "checkpoint.ckpt").is_file():
        raise UserError(f"--resume {folder}: not a run folder (needs config.json and checkpoint.ckpt)")
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


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.ckpt", "report.json", "loss.png")


def _partial_start_of(out: Path, cfg: RunConfig) -> bool:
    """Whether ``out`` holds only the start of this very run (its settings, some metrics,
    no checkpoint and no report): what a job killed before its first checkpoint leaves."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return saved == cfg.to_dict() and not (out / "report.json").exists()


def _refuse_an_earlier_run(out: Path, overwrite: bool) -> None:
    """A folder that holds an earlier run is continued (``--resume``) or replaced on
    request (``--overwrite``), never silently written over."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file, not a folder")
    if found and not overwrite:
        raise UserError(
            f"--out {out}: holds an earlier run ({', '.join(found)}); continue it with "
            f"--resume {out}, or replace it with --overwrite"
        )


class LazyFile:
    """A text file opened at its first write (so an earlier file survives until then)."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path, self.mode, self.file = path, mode, None

    def write(self, text: str) -> None:
        if self.file is None:
            try:
                self.file = self.path.open(self.mode)
            except OSError as e:
                raise UserError(f"{self.path}: cannot be written ({e.strerror or e})") from None
        self.file.write(text)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        elif self.mode == "w":
            self.path.write_text("")  # a finished run with no record still has its file


def _trim_metrics(path: Path, step: int) -> None:
    """On resume, drop records written after the checkpoint (they are replayed), and a
    last line torn by a crash mid-write. A damaged line before the last is an error."""
    if not path.exists():
        return
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--resume: {path}: cannot be read as text ({e})") from None
    kept = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            rec = None
        if not isinstance(rec, dict):
            if n == len(lines):
                break  # torn by a crash mid-write: the records after the checkpoint are replayed anyway
            raise UserError(f"--resume: {path}: line {n} is not a JSON record (the file is damaged)")
        at = rec.get("step", 0)
        if not isinstance(at, (int, float)) or at <= step:
            kept.append(line)
    atomic_write_bytes(path, "".join(ln + "\n" for ln in kept).encode(), "--resume")


def _make_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None


def cmd_train(args) -> int:
    try:
        return _train(args)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _train(args) -> int:
    cfg, resuming = _config(args)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda requested but no CUDA device is available")
    out = Path(cfg.out)
    ckpt, metrics_path = out / "checkpoint.ckpt", out / "metrics.jsonl"
    # under torchrun: one process per rank; each minibatch is cut into one piece per rank
    world = dist.get_world_size() if distributed.init_from_env(cfg.device, cfg.collective_timeout) else 1
    main = distributed.is_main()
    say = print if main else (lambda *a, **k: None)
    torch.manual_seed(cfg.seed)
    factory, loss, train, test = build_task(cfg)
    runner = Runner.from_module(factory(), loss)
    if not any(runner.params.requires_grad_array()):
        raise UserError(f"--model {cfg.model or cfg.preset}: the model has no trainable parameter (every one is "
                        f"frozen, or it has none): there is nothing to train")
    classify = loss == "cross_entropy"
    test_batches = stack_minibatches(512)(test)
    if cfg.device == "cuda":
        runner.to(f"cuda:{torch.cuda.current_device()}")
    piece = -(-cfg.batch_size // world)
    loader = DataLoader(Dataset(train), batch_size=cfg.batch_size, shuffle=True,
                        seed=cfg.seed, collate=stack_minibatches(piece))
    batches_per_epoch = len(loader)
    steps_per_epoch = -(-batches_per_epoch // cfg.accumulate)  # --accumulate loader batches per update
    tcfg = LoaderTrainConfig(
        epochs=cfg.epochs, optimizer=cfg.make_optimizer(), scheduler=cfg.make_schedule(steps_per_epoch),
        log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every, checkpoint_path=ckpt,
        resume_from=ckpt if resuming else None, exact_reduction=cfg.exact_reduction,
        collective_timeout=None,  # the process group itself was made with --collective-timeout
        clip_grad_norm=cfg.clip_grad_norm, accumulate=cfg.accumulate, ema_decay=cfg.ema,
        autocast=PRECISIONS[cfg.precision], compile=cfg.compile, schedule_per=cfg.schedule_per,
        max_steps=cfg.max_steps,
    )
    start_step = 0
    if resuming:
        from ..io.checkpoint import read_checkpoint

        start_step = int(read_checkpoint(ckpt, f"--resume {out}")[0]["progress"].get("step", 0))
    if main:
        if not resuming:
            _refuse_an_earlier_run(out, args.overwrite)  # before anything is written
        _make_folder(out)
        if resuming:
            _trim_metrics(metrics_path, start_step)
        else:
            atomic_write_bytes(out / "config.json", (json.dumps(cfg.to_dict(), indent=2) + "\n").encode(), "--out")
    params = runner.params
    reps = params.canonical_slot_indices()
    aliases = sum(1 for i, c in enumerate(reps) if c is not None and c != i)
    frozen = sum(1 for c in reps if c is None)
    say(f"leantrain train: {cfg.model or cfg.preset}, {len(train)} train / {len(test)} test samples, "
          f"{cfg.epochs} epochs x {steps_per_epoch} steps, {cfg.optimizer} lr={cfg.lr}, "
          f"batch {cfg.batch_size} x accumulate {cfg.accumulate}, device {cfg.device}"
          + (f", {world} processes" if world > 1 else "")
          + (f", precision {cfg.precision}" if cfg.precision != "fp32" else ""))
    say(f"slots: {len(params)} ({aliases} aliased, {frozen} frozen), "
          f"{sum(s.host.numel() for s in params.storages()):,} values in {len(params.storages())} storages"
          + (f"; resuming at step {start_step}" if resuming else ""))

    stop = {"requested": False}
    total_steps = cfg.epochs * steps_per_epoch if cfg.max_steps is None else min(cfg.max_steps, cfg.epochs * steps_per_epoch)
    bar = tqdm(total=total_steps, initial=start_step, unit="step",
               desc=f"{world} ranks" if world > 1 else None,
               disable=None if main else True, dynamic_ncols=True, leave=False)
    # A fresh run replaces an earlier metrics file only once it has a record to write.
    metrics = LazyFile(metrics_path, "a" if resuming else "w") if main else open(os.devnull, "w")

    def callback(ev: StepEvent) -> bool:
        if world > 1 and ev.batch == batches_per_epoch:
            # the ranks agree on stopping at epoch ends (one tiny all-reduce, a sync)
            flag = torch.tensor([float(stop["requested"])], device=runner.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop["requested"] = bool(flag.item())
        if not main:
            return stop["requested"] and ev.batch == batches_per_epoch
        bar.update(1)
        epoch = ev.epoch or 0
        if ev.loss is not None:
            bar.set_postfix(epoch=epoch + 1, loss=f"{ev.loss:.4f}", lr=f"{ev.state.lr:.3g}")
            record = {"kind": "step", "step": ev.step - 1, "epoch": epoch, "loss": ev.loss, "lr": ev.state.lr}
            if ev.grad_norm is not None:
                record["grad_norm"] = ev.grad_norm  # before clipping
            metrics.write(json.dumps(record) + "\n")
        if ev.batch == batches_per_epoch:  # end of an epoch: evaluate on the test split
            res = evaluate(runner, test_batches, {"accuracy": accuracy} if classify else None)
            record = {"kind": "epoch", "step": ev.step, "epoch": epoch, "test_loss": res["loss"]}
            if classify:
                record["test_accuracy"] = res["accuracy"]
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            shown = f"test accuracy {res['accuracy']:.4f}" if classify else f"test loss {res['loss']:.6f}"
            line = f"epoch {epoch + 1:>3}/{cfg.epochs}: step {ev.step:>5}  {shown}"
            bar.write(line) if not bar.disable else print(line, flush=True)
        return stop["requested"] if world == 1 or ev.batch == batches_per_epoch else False

    def on_sigint(signum, frame):
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True  # finish this step, save, exit

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        report, _ = train_loader(runner, tcfg, loader, log=lambda s: None, callback=callback)
    finally:
        signal.signal(signal.SIGINT, previous)
        bar.close()
        metrics.close()
    if not main:
        return 0
    if report.interrupted:
        print(f"interrupted at step {report.steps}; checkpoint saved to {ckpt}\n"
              f"continue with: leantrain train --resume {out}")
        return EXIT_INTERRUPTED
    res = evaluate(runner, test_batches, {"accuracy": accuracy} if classify else None)
    res_ema = evaluate(runner, test_batches, {"accuracy": accuracy} if classify else None, ema=True) \
        if cfg.ema is not None else None
    result = {
        "preset": cfg.preset if cfg.model is None else None, "model": cfg.model,
        "loss_before": report.before, "loss_after": report.after, "test_loss": res["loss"],
        "test_accuracy": res["accuracy"] if classify else None,
        "steps": report.steps, "images_seen": cfg.epochs * len(train),
        "wall_time_s": round(report.wall_time, 3), "aliased_slots": aliases, "frozen_slots": frozen,
    }
    if res_ema is not None:
        result["test_loss_ema"] = res_ema["loss"]
        result["test_accuracy_ema"] = res_ema["accuracy"] if classify else None
    atomic_write_bytes(out / "report.json", (json.dumps(result, indent=2) + "\n").encode(), "--out")
    plot_metrics(metrics_path, out / "loss.png")
    print(f"mean training loss: {report.before:.4f} -> {report.after:.4f}")
    if classify:
        print(f"test accuracy: {res['accuracy']:.4f} ({round(res['accuracy'] * len(test))}/{len(test)})")
    else:
        print(f"test loss: {res['loss']:.6f}")
    if res_ema is not None:
        shown = f"accuracy {res_ema['accuracy']:.4f}" if classify else f"loss {res_ema['loss']:.6f}"
        print(f"test {shown} with the moving average (decay {cfg.ema})")
    print(f"steps: {report.steps}, images: {cfg.epochs * len(train)}, wall time: {report.wall_time:.1f} s"
          + (" (this session)" if resuming else ""))
    print(f"wrote {ckpt}, {metrics_path}, {out / 'loss.png'}, {out / 'report.json'}")
    return 0
