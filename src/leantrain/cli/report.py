"""``leantrain train``'s last step: the final evaluation, ``report.json``, the plot and
the summary lines."""

from __future__ import annotations

import json

from ..errors import ConfigError
from ..io.atomic import atomic_write_bytes
from ..training.loops.config import TrainReport
from ..training.loops.evaluation import evaluate
from .managed import managed
from .plotting import plot_metrics
from .text import perplexity, samples_through
from .usage import EXIT_INTERRUPTED


def report_run(plan, job, report: TrainReport) -> int:
    """The final evaluation (and with the moving average), ``report.json``, the plot and
    the summary lines (rank 0). Exit status 130 when interrupted."""
    if not plan.main:
        return 0
    cfg, out = plan.cfg, plan.out
    if report.interrupted and job.early_stop is None:
        print(f"interrupted at step {report.steps}; checkpoint saved to {plan.checkpoint}\n"
              f"continue with: leantrain train --resume {out}")
        return EXIT_INTERRUPTED
    if job.early_stop is not None:  # a finished run: the job decided to stop (every rank stopped there)
        print(f"stopped early at step {report.steps} (--early-stopping: {job.early_stop})")
    res = evaluate(job.runner, job.test_batches, job.metrics)
    res_ema = evaluate(job.runner, job.test_batches, job.metrics, ema=True) if cfg.ema is not None else None
    reps = job.runner.params.canonical_slot_indices()
    total = samples_through(report.steps, job.n_train, cfg.batch_size, cfg.accumulate)  # --max-steps may stop early
    result = {  # a key is present when it has a value (no nulls): a preset run names its preset, else its model
        **({"preset": cfg.preset} if cfg.model is None else {"model": cfg.model}),
        "loss_before": report.before, "loss_after": report.after, "test_loss": res["loss"],
        "steps": report.steps, "samples_seen": total,
        "wall_time_s": round(report.wall_time, 3),
        "aliased_slots": sum(1 for i, c in enumerate(reps) if c is not None and c != i),
        "frozen_slots": sum(1 for c in reps if c is None),
    }
    if report.train_loss is not None:  # the mean over the run's updates of each update's loss (Trainer's train_loss)
        result["train_loss"] = report.train_loss
    if job.early_stop is not None:
        result["stopped_early"] = job.early_stop
    if job.classify:  # a run without accuracy has no key for it (not null)
        result["test_accuracy"] = res["accuracy"]
    if res_ema is not None:
        result["test_loss_ema"] = res_ema["loss"]
        if job.classify:
            result["test_accuracy_ema"] = res_ema["accuracy"]
    if job.tokens_per_sample is not None:  # token samples: a language model's figures
        seen = total - samples_through(plan.start_step, job.n_train, cfg.batch_size, cfg.accumulate)
        result["tokens_seen"] = round(total * job.tokens_per_sample)
        result["tokens_per_second"] = round(seen * job.tokens_per_sample / max(report.wall_time, 1e-9), 1)
        if job.loss == "model":
            result["test_perplexity"] = perplexity(res["loss"])
    atomic_write_bytes(out / "report.json", (json.dumps(result, indent=2) + "\n").encode(), "--out")
    try:
        plot_metrics(plan.metrics, out / "loss.png")
    except ConfigError as e:  # nothing logged to draw (--log-every 0, no evaluation yet): the run itself is fine
        print(f"no plot: {e}")
    print(f"mean training loss: {report.before:.4f} -> {report.after:.4f}")
    if job.classify:
        print(f"test accuracy: {res['accuracy']:.4f} ({round(res['accuracy'] * job.n_test)}/{job.n_test})")
    else:
        print(f"test loss: {res['loss']:.6f}")
    if res_ema is not None:
        shown = f"accuracy {res_ema['accuracy']:.4f}" if job.classify else f"loss {res_ema['loss']:.6f}"
        print(f"test {shown} with the moving average (decay {cfg.ema})")
    if "tokens_per_second" in result:
        ppl = result.get("test_perplexity")  # a model's own loss only (a LossSum of the user's has none)
        shown = f", perplexity {ppl:.2f}" if ppl is not None else ""
        print(f"tokens per second: {result['tokens_per_second']:,.0f}{shown}")
    print(f"steps: {report.steps}, samples: {total}, wall time: {report.wall_time:.1f} s"
          + (" (this session)" if plan.resuming else ""))
    if report.best_checkpoint is not None:
        result["best_checkpoint"] = report.best_checkpoint
        atomic_write_bytes(out / "report.json", (json.dumps(result, indent=2) + "\n").encode(), "--out")
        print(f"best checkpoint ({cfg.keep_best}): {report.best_checkpoint}")
    shown = plan.checkpoint.parent if managed(cfg) else plan.checkpoint
    print(f"wrote {shown}, {plan.metrics}, {out / 'loss.png'}, {out / 'report.json'}")
    return 0
