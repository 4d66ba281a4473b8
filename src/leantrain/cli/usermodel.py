"""Your own model, data and loss in ``leantrain train``: ``package.module:name`` references.

``model`` names a callable returning an ``nn.Module``; ``data`` a callable returning
``(train, test)``, each a list of single ``(x, y)`` samples or a ``Dataset`` (the command
stacks them into minibatches); ``loss`` is ``"mse"``, ``"cross_entropy"`` or a callable
``(output, target) -> scalar``. The current folder is importable, so a model file beside
the config works. A bad reference is one line and exit status 2.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

import torch

from ..data import Dataset
from ..training.runner.runner import LOSSES
from ..collate import pad_tokens
from .digits import PRESETS, digits_split, stack_minibatches
from .text import text_split
from .usage import UserError


def resolve(ref: str, what: str) -> Callable:
    """The callable ``ref`` (``package.module:name``) names."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise UserError(f"--{what}: expected 'package.module:name', got {ref!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a model file beside the config is importable
    try:
        module = importlib.import_module(module_name)
    except SystemExit as e:  # a script's ``sys.exit`` at import time
        raise UserError(f"--{what} {ref}: importing {module_name!r} called sys.exit({e.code!r}); "
                        f"keep the module's top level to definitions (guard scripts with __main__)") from None
    except Exception as e:  # the user's module may fail in any way while importing
        raise UserError(f"--{what} {ref}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise UserError(f"--{what} {ref}: module {module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise UserError(f"--{what} {ref}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def call_user(fn: Callable, ref: str, what: str):
    try:
        return fn()
    except SystemExit as e:
        raise UserError(f"--{what} {ref}: calling it called sys.exit({e.code!r})") from None
    except Exception as e:  # the user's factory may fail in any way
        raise UserError(f"--{what} {ref}: calling it raised {type(e).__name__}: {e}") from None


def checked_samples(value: object, ref: str, which: str, stacked: bool) -> list:
    """A ``data`` part: a non-empty list (or Dataset) of ``(x, y)`` tensor pairs or of dicts
    of tensors (token sequences). Pairs the command stacks (no ``collate``) need one shape."""
    if isinstance(value, Dataset):
        value = value.to_list()
    pairs = isinstance(value, (list, tuple)) and value and all(
        isinstance(s, (list, tuple)) and len(s) == 2 and all(isinstance(t, torch.Tensor) for t in s) for s in value)
    dicts = isinstance(value, (list, tuple)) and value and all(
        isinstance(s, dict) and s and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in s.items())
        for s in value)
    if not (pairs or dicts):
        raise UserError(f"--data {ref}: the {which} part must be a non-empty list of (x, y) tensor pairs or of dicts "
                        f"of tensors (token ids...), or a Dataset of them")
    if dicts:
        return [dict(s) for s in value]
    x0, y0 = value[0]
    for i, (x, y) in enumerate(value if stacked else ()):  # the command stacks samples into minibatches
        if x.shape != x0.shape or y.shape != y0.shape:
            raise UserError(f"--data {ref}: {which} sample {i} has x {tuple(x.shape)}, y {tuple(y.shape)}, but sample 0 "
                            f"has x {tuple(x0.shape)}, y {tuple(y0.shape)}; the command stacks samples into "
                            f"minibatches, so they need one shape (pad them, pass --collate, or train with the library)")
    return [(s[0], s[1]) for s in value]


def collate_for(cfg, train: list) -> Callable[[int], Callable[[list], list]]:
    """``piece -> collate``: the loader's collate cutting a batch into minibatches of
    ``piece`` samples (one per rank under torchrun), each made by the ``collate`` setting,
    by ``leantrain.collate.pad_tokens`` for dict samples, else by stacking (x, y) pairs."""
    if cfg.collate is None and not isinstance(train[0], dict):
        return stack_minibatches
    make = resolve(cfg.collate, "collate") if cfg.collate is not None else pad_tokens

    def pieces(piece: int) -> Callable[[list], list]:
        def collate(samples: list) -> list:
            out = []
            for i in range(0, len(samples), piece):
                item = call_user(lambda: make(samples[i: i + piece]), cfg.collate or "pad_tokens", "collate")
                out.append(item)
            return out
        return collate
    return pieces


def build_model(ref: str) -> torch.nn.Module:
    """The module ``--model ref`` builds (the factory called once)."""
    model = call_user(resolve(ref, "model"), ref, "model")
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"--model {ref}: returned a {type(model).__name__}, expected a torch.nn.Module")
    return model


def build_task(cfg) -> tuple[Callable[[], torch.nn.Module], object, list, list]:
    """(model factory, loss, train samples, test samples) of a run configuration."""
    if cfg.model is None:
        factory = PRESETS[cfg.preset]
    else:
        resolve(cfg.model, "model")  # a bad reference is refused before any data is read

        def factory():
            return build_model(cfg.model)
    if cfg.data is None:
        train, test = text_split() if cfg.preset == "text-gpt" and cfg.model is None else digits_split()
    else:
        parts = call_user(resolve(cfg.data, "data"), cfg.data, "data")
        if not isinstance(parts, (list, tuple)) or len(parts) != 2:
            raise UserError(f"--data {cfg.data}: must return (train, test), got {type(parts).__name__}")
        stacked = cfg.collate is None
        train = checked_samples(parts[0], cfg.data, "train", stacked)
        test = checked_samples(parts[1], cfg.data, "test", stacked)
    loss = cfg.loss if cfg.loss is not None else default_loss(cfg, train)
    loss = loss if loss in LOSSES else resolve(loss, "loss")
    return factory, loss, train, test


def default_loss(cfg, train: list) -> str:
    """Without a ``loss`` setting: the model's own for the text preset and for dict samples
    (a Hugging Face model given its labels), else ``cross_entropy``."""
    if (cfg.model is None and cfg.preset == "text-gpt") or isinstance(train[0], dict):
        return "model"
    return "cross_entropy"
