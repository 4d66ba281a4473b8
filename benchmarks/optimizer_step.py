"""One Adam step over ~100 tensors (~10M parameters): leantrain (torch's fused kernel)
vs torch.optim.Adam(fused=True), the fastest a PyTorch user has, and vs foreach=True.
``--all``: one step of every optimizer of the table against torch's fastest implementation
of the same optimizer (its fused kernel where it has one, else foreach; Muon's loop), on
matrices (so Muon's own rule runs).

Same tensors, same process, interleaved; prints the best and the median of per-run
ratios (< 1 means leantrain is faster). Run: .venv/bin/python benchmarks/optimizer_step.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_ratios  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain import optim  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--numel", type=int, default=100_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--all", action="store_true", help="every optimizer of the table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.all:
        return every_optimizer(args)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(args.numel, generator=gen) for _ in range(args.tensors)]
    grads = [torch.randn(args.numel, generator=gen) for _ in range(args.tensors)]

    params = lt.ParamList.of_pack(init)
    opt = optim.adam(1e-3)
    state = [opt.init(params)]

    def ours() -> None:
        state[0] = opt.step(state[0], params, grads)

    total = args.tensors * args.numel
    print(f"adam step, {args.tensors} tensors, {total / 1e6:.1f}M params, {args.threads} thread(s), "
          f"{args.runs} interleaved runs")
    for mode in ("fused", "foreach"):
        tparams = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(tparams, grads):
            p.grad = g
        topt = torch.optim.Adam(tparams, lr=1e-3, **{mode: True})

        def theirs() -> None:
            topt.step()

        med, best, a, b = interleaved_ratios(ours, theirs, runs=args.runs, reps=3)
        print(f"  leantrain {a * 1e3:7.2f} ms/step vs torch.optim.Adam({mode}=True) {b * 1e3:7.2f} ms/step   "
              f"ratio best {best:.3f}, median {med:.3f}")


def every_optimizer(args) -> None:
    from leantrain.optim.rules import rule_for
    side = int(args.numel ** 0.5)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(side, side, generator=gen) for _ in range(args.tensors)]
    grads = [torch.randn(side, side, generator=gen) * 1e-2 for _ in range(args.tensors)]
    print(f"one step, {args.tensors} matrices {side}x{side}, {args.threads} thread(s), {args.runs} interleaved runs")
    for kind, make in optim.OPTIMIZERS.items():
        opt = make(1e-3)
        found = rule_for(opt.hyper).torch_equivalent(opt.hyper)
        if found is None:
            continue
        cls, kwargs = found
        params = lt.ParamList.of_pack(init)
        state = [opt.init(params)]

        def ours() -> None:
            state[0] = opt.step(state[0], params, grads)

        tparams = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(tparams, grads):
            p.grad = g
        topt = cls(tparams, **kwargs)

        def theirs() -> None:
            topt.step()

        impl = "fused" if kwargs.get("fused") else "foreach" if kwargs.get("foreach") else "loop"
        med, best, a, b = interleaved_ratios(ours, theirs, runs=args.runs, reps=3)
        print(f"  {kind:9s} leantrain {a * 1e3:8.2f} ms vs torch.optim.{cls.__name__}({impl}) {b * 1e3:8.2f} ms   "
              f"ratio best {best:.3f}, median {med:.3f}")


if __name__ == "__main__":
    main()
