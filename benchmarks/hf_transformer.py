"""A real transformer on the CPU: a Hugging Face GPT-2 from its config (4 layers, width
256, 4 heads, sequences of 128, vocabulary 4096), batches of 8 padded sequences as
collators give them (``input_ids``, ``attention_mask``, ``labels``), the model's own
loss, AdamW. Per-update time of leantrain against, on the same batches, in one process,
interleaved (best of N and the median of the per-run ratios; < 1: leantrain faster):

* the plain loop with ``torch.optim.AdamW(fused=True)``;
* Lightning Fabric (``fabric.backward``), Accelerate (``accelerator.backward``) and
  transformers' ``Trainer`` (``optim="adamw_torch_fused"``; its ``train_runtime``
  over its updates), when installed;
* the whole run with leantrain's defaults (``train_loader``: the before/after losses over
  the first batch, a log line each update) against the plain loop's whole run;
* ``compile=True`` against the plain loop on ``torch.compile(model)`` (``--compile``).

Run: .venv/bin/python benchmarks/hf_transformer.py [--runs 5] [--updates 8] [--compile] [--whole-only]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings

import torch

import leantrain as lt

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

LR, WD = 3e-4, 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def make_batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 4096, (8, 128), generator=g)
        mask = torch.ones_like(ids)
        mask[4:, 100:] = 0  # some padding, as a collator leaves it
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def timed_loop(model, opt, batches, backward) -> float:
    """Seconds per update of the loop a user writes: zero, forward, ``backward(loss)``, step."""
    t0 = time.perf_counter()
    for b in batches:
        opt.zero_grad(set_to_none=True)
        backward(model(**b).loss)
        opt.step()
    return (time.perf_counter() - t0) / len(batches)


class Plain:
    name = "plain loop, AdamW(fused=True)"

    def __init__(self, model, compiled: bool = False) -> None:
        self.model = model
        self.call = torch.compile(model) if compiled else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)

    def run(self, batches) -> float:
        return timed_loop(self.call, self.opt, batches, lambda loss: loss.backward())


class Leantrain:
    name = "leantrain train_loader"

    def __init__(self, model, compiled: bool = False) -> None:
        self.runner = lt.Runner.from_module(model, "model")
        self.cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.adamw(LR, WD), log_every=0, measure_loss=False,
                                        compile=compiled)

    def run(self, batches) -> float:
        report, _ = lt.train_loader(self.runner, self.cfg, batches, log=None)
        return report.wall_time / report.steps


class Fabric:
    name = "Lightning Fabric"

    def __init__(self, model) -> None:
        from lightning.fabric import Fabric as F

        self.fabric = F(accelerator="cpu", devices=1)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        self.model, self.opt = self.fabric.setup(model, opt)

    def run(self, batches) -> float:
        return timed_loop(self.model, self.opt, batches, self.fabric.backward)


class Accelerate:
    name = "Accelerate"

    def __init__(self, model) -> None:
        from accelerate import Accelerator

        self.acc = Accelerator(cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        self.model, self.opt = self.acc.prepare(model, opt)

    def run(self, batches) -> float:
        return timed_loop(self.model, self.opt, batches, self.acc.backward)


class Trainer:
    name = "transformers Trainer"

    def __init__(self, model) -> None:
        self.model = model
        self.dir = tempfile.mkdtemp()

    def run(self, batches) -> float:
        rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(8)]
        args = transformers.TrainingArguments(
            self.dir, max_steps=len(batches), per_device_train_batch_size=8, learning_rate=LR, weight_decay=WD,
            optim="adamw_torch_fused", lr_scheduler_type="constant", report_to=[], save_strategy="no",
            logging_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
            remove_unused_columns=False)
        out = transformers.Trainer(model=self.model, args=args, train_dataset=rows,
                                   data_collator=lambda rs: {k: torch.stack([r[k] for r in rs]) for k in rs[0]},
                                   ).train()
        return out.metrics["train_runtime"] / len(batches)


def whole_runs(base, batches, runs: int, measure_loss: bool = True) -> tuple[float, float]:
    """leantrain with the defaults (before/after over the batches, logging each update;
    ``measure_loss=False``: without the before/after passes) against the plain loop's
    whole run, interleaved: (best, median) of the ratios."""
    ratios = []
    for r in range(runs):
        lt_runner = lt.Runner.from_module(copy.deepcopy(base), "model")
        cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.adamw(LR, WD), measure_loss=measure_loss)
        plain = Plain(copy.deepcopy(base))
        order = [0, 1] if r % 2 == 0 else [1, 0]
        times = {}
        for k in order:
            t0 = time.perf_counter()
            if k == 0:
                lt.train_loader(lt_runner, cfg, batches, log=lambda s: None)
            else:
                plain.run(batches)
            times[k] = time.perf_counter() - t0
        ratios.append(times[0] / times[1])
    return min(ratios), statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--whole-only", action="store_true", help="only the whole runs (defaults and measure_loss=False)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    base = make_model()
    batches = make_batches(a.updates)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)
    if a.whole_only:
        print(f"GPT-2 4x256, batch 8 x 128, {a.updates} updates x {a.runs} runs, {torch.get_num_threads()} threads")
        for label, measure in (("leantrain's defaults", True), ("measure_loss=False", False)):
            best, median = whole_runs(base, batches, a.runs, measure_loss=measure)
            print(f"  whole run with {label} / the plain loop's: best {best:.2f}, median {median:.2f}")
        return
    contenders = [Leantrain(copy.deepcopy(base)), Plain(copy.deepcopy(base))]
    for cls in (Fabric, Accelerate, Trainer):
        try:
            contenders.append(cls(copy.deepcopy(base)))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    for c in contenders:
        c.run(batches[:2])  # warm-up
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(a.runs):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for c in order:
            times[c.name].append(c.run(batches))
    ours = times[Leantrain.name]
    print(f"GPT-2 4x256, batch 8 x 128 ({tokens:.0f} tokens per update), {a.updates} updates x {a.runs} runs, "
          f"{torch.get_num_threads()} threads")
    for c in contenders:
        t = times[c.name]
        ratios = [o / x for o, x in zip(ours, t)]
        print(f"  {c.name:<32} {statistics.median(t) * 1e3:8.1f} ms/update  {tokens / statistics.median(t):8.0f} "
              f"tokens/s   leantrain/this: best {min(ratios):.2f}, median {statistics.median(ratios):.2f}")
    best, median = whole_runs(base, batches, a.runs)
    print(f"  whole run with leantrain's defaults / the plain loop's: best {best:.2f}, median {median:.2f}")
    best, median = whole_runs(base, batches, a.runs, measure_loss=False)
    print(f"  whole run with measure_loss=False / the plain loop's: best {best:.2f}, median {median:.2f}")
    if a.compile:
        lt_c, plain_c = Leantrain(copy.deepcopy(base), compiled=True), Plain(copy.deepcopy(base), compiled=True)
        lt_c.run(batches[:2]), plain_c.run(batches[:2])  # compilation
        ratios = []
        for r in range(a.runs):
            pair = (lt_c, plain_c) if r % 2 == 0 else (plain_c, lt_c)
            got = {id(c): c.run(batches) for c in pair}
            ratios.append(got[id(lt_c)] / got[id(plain_c)])
        print(f"  compile=True / torch.compile plain loop: best {min(ratios):.2f}, median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
