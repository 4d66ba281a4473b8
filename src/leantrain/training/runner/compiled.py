"""The opt-in compiled step: ``compile=True`` on the loops (``--compile`` on the command).

Each item's loss, ``loss_fn(module(x), y)``, runs as one ``torch.compile``d function
(TorchDynamo and Inductor, the default backend), so its forward and the backward
autograd derives from it are compiled kernels; everything else about a step (the
buffer pass, the left-to-right accumulation, ``sum*(1/n)``, the non-finite check, the
optimizer) is unchanged. The compiled function is made once per runner and kept: the
first step of the first compiled loop pays the compilation (seconds to a minute on
CPU; a C++ compiler is needed there), later loops on the same runner reuse it. Passes
without gradients (the ``before``/``after`` losses, evaluation, the buffer pass) stay
eager.

What it changes: compiled kernels fuse operations and may round differently from
eager PyTorch, so a compiled run is *not* bit-identical to an eager one (or to
``torch.optim`` on a copy): its exactness holds only against itself (the same compiled
run repeated gives the same bits, tested). Ties, frozen slots, buffers and the module
stay the user's as always. Measured in ``benchmarks/compiled_step.py``.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...errors import ConfigError


def make_compiled(module: torch.nn.Module, loss_fn: Callable) -> Callable:
    """``torch.compile`` of ``sample -> loss_fn(model(sample), target)`` (``samples.py``'s
    rule for reading a sample), compiled at its first call."""
    from ...samples import call_model, loss_target

    def forward_loss(sample):
        return loss_fn(call_model(module, sample), loss_target(sample))

    return torch.compile(forward_loss)


def is_compiler_error(e: BaseException) -> bool:
    """Whether ``e`` comes from torch.compile itself (TorchDynamo, Inductor), not the model."""
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def compiler_error(e: BaseException) -> ConfigError:
    return ConfigError(
        f"Runner.loss: torch.compile could not compile the model's loss "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); train with compile=False"
    )
