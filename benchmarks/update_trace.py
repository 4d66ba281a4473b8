"""How many of leantrain's files one steady update crosses, from the command and from
``train_loader`` (the structure measure of issues #24 and #35, not a timing).

Method: a profile hook records every call into a function of ``src/leantrain`` from the
4th call of the session's ``update`` to the 5th, that is one whole iteration of the
loop: the step, logging when due, the callbacks, fetching the next batch; and,
separately, the calls made under that ``update`` call alone. It prints the distinct files, the file-to-file transitions
(distinct pairs of caller file and callee file) and the parameter count of the step's
update function. ``train_loader`` runs twice: a plain Adam loop, and the full one-process
update of issue #35 (AdamW, clipping by norm, EMA and a step callback). Run:
``python benchmarks/update_trace.py`` (``--src DIR`` traces another checkout's
``src/leantrain``, for a before/after figure).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

_src = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
SRC = str(Path(_src).resolve() if _src else Path(__file__).resolve().parents[1] / "src" / "leantrain")
sys.path.insert(0, str(Path(SRC).parent))

import leantrain as lt  # noqa: E402
from leantrain.cli import main  # noqa: E402


class Trace:
    """Calls into ``src/leantrain`` from the 4th call of the session's ``update`` to the
    5th (one whole loop iteration: the update, its EMA and log line, the callbacks, the
    next batch fetched); ``inner``: those made under that ``update`` call, with the
    file-to-file transitions counted as they happen (a call whose caller is in another
    leantrain file)."""

    def __init__(self) -> None:
        self.updates, self.calls, self.edges = 0, [], set()
        self.depth, self.inner, self.transitions = 0, [], 0

    def __call__(self, frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(SRC):
            return
        root = frame.f_code.co_name == "update" and path.endswith("session.py")
        if event == "call" and root:
            self.updates += 1
        if event == "call" and self.updates == 4:
            self.calls.append(os.path.relpath(path, SRC))
            back = frame.f_back
            crossed = back is not None and back.f_code.co_filename.startswith(SRC) and back.f_code.co_filename != path
            if crossed:
                self.edges.add((os.path.relpath(back.f_code.co_filename, SRC), self.calls[-1]))
            self.depth += root
            if self.depth:
                self.inner.append(self.calls[-1])
                self.transitions += crossed and not root
        if event == "return" and root and self.depth:
            self.depth -= 1

    def summary(self, what: str) -> str:
        files = sorted(set(self.calls))
        return (f"{what}: {len(files)} files, {len(self.edges)} distinct file-to-file calls (caller file -> "
                f"callee file), {len(self.calls)} calls in all\n  " + ", ".join(files))

    def update_only(self, what: str) -> str:
        """The files of the update alone: the calls made under the session's ``update``
        (all of leantrain's, and those of ``training/``)."""
        files = sorted(set(self.inner))
        training = [f for f in files if f.startswith("training")]
        return (f"{what}, under Session.update: {len(files)} files ({len(training)} in training/), "
                f"{self.transitions} file-to-file transitions\n  " + ", ".join(files))


def traced(fn) -> Trace:
    t = Trace()
    sys.setprofile(t)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return t


def command() -> None:
    with tempfile.TemporaryDirectory() as d:
        assert main(["train", "--epochs", "1", "--log-every", "2", "--out", d]) == 0


def library() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    loader = lt.DataLoader(lt.Dataset(list(zip(x, y))), batch_size=32, shuffle=True, seed=0)
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.adam(1e-3), log_every=2)
    lt.train_loader(lt.Runner.from_module(model, "cross_entropy"), cfg, loader, log=lambda s: None)


def full_update(collated: bool = False) -> None:
    """One process, ``train_loader`` with AdamW, clipping by norm, EMA and a step callback,
    over leantrain's DataLoader (a batch is a list of 32 items) or (``collated``) a torch
    DataLoader (a batch is one collated item)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    if collated:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    else:
        loader = lt.DataLoader(lt.Dataset(list(zip(x, y))), batch_size=32, shuffle=True, seed=0)
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.adamw(1e-3), log_every=2, clip_grad_norm=1.0,
                               ema_decay=0.99)
    seen = []
    lt.train_loader(lt.Runner.from_module(model, "cross_entropy"), cfg, loader, log=lambda s: None,
                    callback=lambda event: seen.append(event.step) and False)


if __name__ == "__main__":
    print(f"source: {SRC}")
    print(traced(command).summary("the command"))
    plain, full, collated = traced(library), traced(full_update), traced(lambda: full_update(collated=True))
    print(plain.summary("train_loader"))
    print(full.summary("train_loader, AdamW + clipping + EMA + callback"))
    print(plain.update_only("train_loader, 32 items per update"))
    print(full.update_only("train_loader, AdamW + clipping + EMA + callback, 32 items per update"))
    print(collated.update_only("train_loader, AdamW + clipping + EMA + callback, one collated batch per update"))
