"""The opt-in compiled step (``compile=True``) against the eager step and the hand loop.

Three models, one thread, in the same process, interleaved: (a) MLP 32-64-64-1, batch
64, SGD; (b) MLP 784-256-256-10, batch 128, Adam; (c) the model-zoo GPT (tied head,
mask buffer; tests/zoo/zoo_models.py), 8 sequences per item, Adam. Per model: leantrain
``train_samples`` with ``compile=True`` against the same loop eager, and against a hand
loop (``torch.optim`` with ``fused=True``, eager). Compilation happens once, before
timing, and is reported. Best and median of per-run ratios (< 1: compiled is faster).
Compiled kernels round differently: the largest parameter difference from the eager
run after the timed steps is printed too.

Run: .venv/bin/python benchmarks/compiled_step.py [--runs 11]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "zoo"))
from _timing import interleaved_ratios  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402


def mlp(sizes):
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


def cases():
    g = torch.Generator().manual_seed(0)
    a = [(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)) for _ in range(4)]
    yield "(a) MLP 32-64-64-1, b64, SGD", lambda: mlp([32, 64, 64, 1]), "mse", a, lambda: optim.sgd(0.01), \
        lambda ps: torch.optim.SGD(ps, lr=0.01, fused=True), 400
    b = [(torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(4)]
    yield "(b) MLP 784-256-256-10, b128, Adam", lambda: mlp([784, 256, 256, 10]), "cross_entropy", b, \
        lambda: optim.adam(1e-3), lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), 60
    from zoo_models import BY_NAME, lm_loss
    gpt = BY_NAME["gpt"]
    yield "(c) zoo GPT (tied head, mask), Adam", lambda: gpt.model(), lm_loss, gpt.samples(4, rows=8), \
        lambda: optim.adam(1e-3), lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), 200


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=11)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.runs} interleaved runs per pair")
    for name, build, loss, samples, make_opt, make_torch_opt, steps in cases():
        torch.manual_seed(0)
        base = build()
        eager_model, compiled_model, hand_model = base, copy.deepcopy(base), copy.deepcopy(base)
        eager, compiled = lt.Runner.from_module(eager_model, loss), lt.Runner.from_module(compiled_model, loss)
        cfg = lt.TrainConfig(steps=steps, optimizer=make_opt(), log_every=0, measure_loss=False)
        ccfg = lt.TrainConfig(steps=steps, optimizer=make_opt(), log_every=0, measure_loss=False, compile=True)
        t = time.perf_counter()
        lt.train_samples(compiled, lt.TrainConfig(steps=1, optimizer=make_opt(), log_every=0, measure_loss=False,
                                                   compile=True), samples, log=lambda s: None)
        compile_s = time.perf_counter() - t
        crit = lt.training.runner.runner.LOSSES.get(loss, loss) if isinstance(loss, str) else loss
        topt = make_torch_opt(hand_model.parameters())

        def run_eager():
            lt.train_samples(eager, cfg, samples, log=lambda s: None)

        def run_compiled():
            lt.train_samples(compiled, ccfg, samples, log=lambda s: None)

        def hand():
            for k in range(steps):
                x, y = samples[k % len(samples)]
                topt.zero_grad()
                crit(hand_model(x), y).backward()
                topt.step()

        med, best, a, b = interleaved_ratios(run_compiled, run_eager, runs=args.runs, reps=1, warmup=1)
        med_h, best_h, _, h = interleaved_ratios(run_compiled, hand, runs=args.runs, reps=1, warmup=1)
        diff = max((p - q).abs().max().item() for p, q in zip(compiled_model.parameters(), eager_model.parameters()))
        print(f"{name:<38} compile {compile_s:5.1f} s; compiled {a / steps * 1e6:8.1f} us/step, eager "
              f"{b / steps * 1e6:8.1f}, hand {h / steps * 1e6:8.1f}; compiled/eager best {best:.3f} median "
              f"{med:.3f}; compiled/hand best {best_h:.3f} median {med_h:.3f}; max |compiled - eager| {diff:.2e}")


if __name__ == "__main__":
    main()
