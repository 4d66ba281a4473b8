"""One Adam step over ~100 tensors (~10M parameters): leantrain (torch's fused kernel)
vs torch.optim.Adam(fused=True), the fastest a PyTorch user has, and vs foreach=True.

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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
