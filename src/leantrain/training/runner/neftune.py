"""NEFTune (Jain et al. 2023; Trainer's ``neftune_noise_alpha``): while a loop trains, uniform
noise of magnitude ``alpha / sqrt(seq_len * dim)`` is added to the input embeddings'
output in training mode, by a forward hook on ``get_input_embeddings()`` computed as
transformers' ``neftune_post_forward_hook`` computes it (the same draws from the global
generator, so the same bits); the hook is removed when the loop ends, so the user's
module is as it was."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

from ...errors import ConfigError
from ...validate import is_number


def check_alpha(op: str, alpha: object) -> None:
    if alpha is not None and not (is_number(alpha) and math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"{op}: neftune_noise_alpha must be a finite number > 0 (or None), got {alpha!r}")


def _hook(alpha: float):
    def noisy(module: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        if module.training:
            # transformers' arithmetic, for its bits: a float32 scalar on the host (no device sync)
            dims = torch.tensor(output.size(1) * output.size(2))
            mag_norm = alpha / torch.sqrt(dims)
            output = output + torch.zeros_like(output).uniform_(-mag_norm, mag_norm)
        return output

    return noisy


@contextlib.contextmanager
def neftune(op: str, module: torch.nn.Module, alpha: Optional[float]) -> Iterator[None]:
    """The noise hook on ``module``'s input embeddings for the enclosed loop (nothing
    without ``alpha``)."""
    if alpha is None:
        yield
        return
    get = getattr(module, "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except NotImplementedError:  # transformers' base class on a model that does not say which module it is
        embeddings = None
    if not isinstance(embeddings, torch.nn.Module):
        raise ConfigError(f"{op}: neftune_noise_alpha needs a model with get_input_embeddings() (a Hugging Face "
                          f"model), got {type(module).__name__}")
    handle = embeddings.register_forward_hook(_hook(float(alpha)))
    try:
        yield
    finally:
        handle.remove()
