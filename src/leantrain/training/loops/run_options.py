"""The run's own settings: its seed, torch's deterministic algorithms, the peak FLOP/s
behind the MFU estimate and the profiled updates.

``seed``: at the start of a fresh run (never on a resume, which restores the saved
generators instead) Python's ``random``, NumPy's global generator and torch's (CPU and
every CUDA device) are seeded with it, so dropout and a torch ``DataLoader``'s shuffle
repeat; it is recorded in every checkpoint, and a resume with another seed is refused.
A ``leantrain.DataLoader`` keeps its own ``seed``. The model's initialization happens
before the loop: seed it with ``leantrain.seed_everything(seed)`` before building it.

``deterministic``: ``True`` turns on ``torch.use_deterministic_algorithms`` for the
loop (``"warn"``: torch warns instead of raising); the previous setting is put back when
the loop returns. An operation without a deterministic implementation stops the run with
a ``ConfigError`` naming it. On CUDA, cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
in the environment before the process starts; the loop refuses to start without it.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from typing import Optional

import numpy
import torch

from ...errors import ConfigError
from ...validate import is_int, is_number

def check_run_options(op: str, cfg) -> None:
    if cfg.seed is not None and not (is_int(cfg.seed) and 0 <= cfg.seed < 2**32):
        raise ConfigError(f"{op}: seed must be an integer in [0, 2**32) (NumPy's range) or None, got {cfg.seed!r}")
    d = cfg.deterministic
    if not (d is True or d is False or (isinstance(d, str) and d == "warn")):
        raise ConfigError(f"{op}: deterministic must be True, False or 'warn', got {cfg.deterministic!r}")
    f = cfg.peak_flops
    if f is not None and not (is_number(f) and 0 < f < float("inf")):
        raise ConfigError(f"{op}: peak_flops must be a positive number of FLOP/s (e.g. 989e12) or None, got {f!r}")
    p = cfg.profile
    if p is not None:
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(is_int(x) for x in p) and 1 <= p[0] <= p[1]):
            raise ConfigError(f"{op}: profile must be (first, last) updates, counted from 1 with first <= last, "
                              f"got {p!r}")
        if cfg.profile_dir is None:
            raise ConfigError(f"{op}: profile={tuple(p)} writes a trace: set profile_dir")
    elif cfg.profile_dir is not None:
        raise ConfigError(f"{op}: profile_dir is set but profile is not: say which updates to profile, "
                          f"profile=(first, last)")


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's (CPU and CUDA)."""
    if not (is_int(seed) and 0 <= seed < 2**32):
        raise ConfigError(f"seed_everything: seed must be an integer in [0, 2**32), got {seed!r}")
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device's generator too


@contextlib.contextmanager
def deterministic_mode(op: str, setting, device: torch.device):
    """``torch.use_deterministic_algorithms`` as ``setting`` says for the block, the
    previous setting put back after it."""
    if setting is False:
        yield
        return
    if device.type == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        raise ConfigError(f"{op}: deterministic={setting!r} on CUDA needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (or "
                          f":16:8) in the environment before the process starts (cuBLAS reads it once)")
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=setting == "warn")
    try:
        yield
    except (RuntimeError, ValueError) as e:  # torch's refusal, or a DataError carrying it from the model
        refused = refused_operation(e)
        if refused is None:
            raise
        raise ConfigError(f"{op}: deterministic=True: torch has no deterministic implementation of {refused}; "
                          f"train with deterministic='warn' (torch warns and goes on) or False") from e
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


_REFUSED = re.compile(r"(\S+) does not have a deterministic implementation")


def refused_operation(e: BaseException) -> Optional[str]:
    """The operation torch's deterministic mode refused, when ``e`` is that refusal."""
    m = _REFUSED.search(str(e))
    return m.group(1) if m else None


@contextlib.contextmanager
def loop_context(op: str, cfg, runner):
    """What a loop installs around its run besides the runner's own state: the
    deterministic mode (``deterministic``) and NEFTune's noise hook (``neftune_noise_alpha``)."""
    from ..runner.neftune import neftune

    with deterministic_mode(op, cfg.deterministic, runner.device), \
            neftune(op, runner.module, cfg.neftune_noise_alpha):
        yield
