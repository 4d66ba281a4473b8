"""Time per optimizer step: leantrain loops vs a hand-written PyTorch loop.

(a) MLP 32-64-64-1, minibatch 64, SGD;  (b) MLP 784-256-256-10, minibatch 128, Adam.
Both sides do the same math (forward, backward, one optimizer step per minibatch)
in the same process, interleaved; the hand loop uses torch's fused optimizers
(``fused=True``, the fastest a user has); the ratios printed are the best of N (each
side's fastest run) and the median of per-run ratios (< 1 means leantrain is faster).
``train_samples`` and ``train_loader`` run with ``log_every=0`` and the default
``nonfinite="raise"`` check, and include their
before/after mean losses (8 extra forward passes per call, spread over 800 or 240 steps).
"floor (math)" is a loop with nothing but the math (forward, ``autograd.grad``, the
fused optimizer step): no loop can go below it. "step callback" is ``train_samples`` with a
step callback that changes nothing (the user's code runs after every update). Also: exact
vs vectorised accumulation of 32 single-sample items on (b)'s model.

Run: .venv/bin/python benchmarks/step_overhead.py [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_ratio, interleaved_ratios  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def case(name, sizes, batch, loss, make_opt, make_torch_opt, steps, kernel, n_batches=4, runs=9):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch, sizes[0], generator=gen) for _ in range(n_batches)]
    if loss == "mse":
        ys = [torch.randn(batch, sizes[-1], generator=gen) for _ in range(n_batches)]
        crit = nn.functional.mse_loss
    else:
        ys = [torch.randint(0, sizes[-1], (batch,), generator=gen) for _ in range(n_batches)]
        crit = nn.functional.cross_entropy
    samples = list(zip(xs, ys))
    torch.manual_seed(1)
    ours_model, ref_model = mlp(sizes), mlp(sizes)
    ref_model.load_state_dict(ours_model.state_dict())
    runner = lt.Runner.from_module(ours_model, loss)
    cfg = lt.TrainConfig(steps=steps, optimizer=make_opt(), log_every=0)
    lcfg = lt.LoaderTrainConfig(epochs=steps // n_batches, optimizer=make_opt(), log_every=0)
    topt = make_torch_opt(ref_model.parameters())

    def ours_samples():
        lt.train_samples(runner, cfg, samples, log=lambda s: None)

    def ours_loader():
        lt.train_loader(runner, lcfg, [[s] for s in samples], log=lambda s: None)

    def ours_callback():  # the user's code after every update: the loop confirms what it checked
        lt.train_samples(runner, cfg, samples, log=lambda s: None, callback=lambda event: None)

    def hand():
        for k in range(steps):
            x, y = samples[k % n_batches]
            topt.zero_grad()
            crit(ref_model(x), y).backward()
            topt.step()

    floor_model = mlp(sizes)
    floor_model.load_state_dict(ours_model.state_dict())
    floor_params = list(floor_model.parameters())
    ms = [torch.zeros_like(p) for p in floor_params]
    vs = [torch.zeros_like(p) for p in floor_params]
    ts = [torch.zeros(()) for _ in floor_params]

    def floor():
        # The math alone: forward, autograd's engine, the fused optimizer kernel called
        # directly; no checks, no bookkeeping, no torch.optim. What any loop costs at least.
        for k in range(steps):
            x, y = samples[k % n_batches]
            grads = list(torch.autograd.grad(crit(floor_model(x), y), floor_params))
            with torch.no_grad():
                if kernel == "sgd":
                    torch._fused_sgd_(floor_params, grads, [], weight_decay=0.0, momentum=0.0, lr=0.01,
                                      dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
                else:
                    torch._foreach_add_(ts, 1.0)
                    torch._fused_adam_(floor_params, grads, ms, vs, [], ts, lr=1e-3, beta1=0.9, beta2=0.999,
                                       weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

    for label, fn in [("train_samples", ours_samples), ("train_loader", ours_loader),
                      ("step callback", ours_callback), ("floor (math)", floor)]:
        med, best, a, b = interleaved_ratios(fn, hand, runs=runs, reps=1, warmup=1)
        print(
            f"{name:<34} {label:<14} {a / steps * 1e6:8.1f} us/step vs hand loop "
            f"{b / steps * 1e6:8.1f} us/step   ratio best {best:.3f}, median {med:.3f}"
        )


def vectorised(runs=9):
    torch.manual_seed(2)
    model = mlp([784, 256, 256, 10])
    runner = lt.Runner.from_module(model, "cross_entropy")
    gen = torch.Generator().manual_seed(3)
    batch = [(torch.randn(784, generator=gen), torch.randint(0, 10, (), generator=gen)) for _ in range(32)]

    def exact():
        lt.mean_gradients(runner, batch)

    def vec():
        lt.mean_gradients(runner, batch, accumulation="vectorized")

    ratio, a, b = interleaved_ratio(vec, exact, runs=runs, reps=3)
    print(
        f"{'accumulate 32 items, 784-256-256-10':<34} vectorised {a * 1e3:7.2f} ms vs exact "
        f"{b * 1e3:7.2f} ms   speed-up {1 / ratio:.1f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=11)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    case(
        "(a) MLP 32-64-64-1, batch 64, SGD", [32, 64, 64, 1], 64, "mse",
        lambda: optim.sgd(0.01), lambda ps: torch.optim.SGD(ps, lr=0.01, fused=True), steps=800, kernel="sgd", runs=args.runs,
    )
    case(
        "(b) MLP 784-256-256-10, b128, Adam", [784, 256, 256, 10], 128, "cross_entropy",
        lambda: optim.adam(1e-3), lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), steps=240, kernel="adam", runs=args.runs,
    )
    vectorised(args.runs)


if __name__ == "__main__":
    main()
