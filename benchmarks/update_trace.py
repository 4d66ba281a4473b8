"""How many of leantrain's files one steady update crosses, from the command and from
``train_loader`` (the structure measure of issue #24, not a timing).

Method: a profile hook records every call into a function of ``src/leantrain`` between
the end of the optimizer's 3rd update (``Optimizer._run`` returning) and the end of the
4th, that is one whole iteration of the loop: fetching the batch, the step, the
callbacks, logging when due. It prints the distinct files, the file-to-file transitions
(distinct pairs of caller file and callee file) and the parameter count of the step's
update function. Run: ``python benchmarks/update_trace.py``.
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[1] / "src" / "leantrain")
sys.path.insert(0, str(Path(SRC).parent))

import leantrain as lt  # noqa: E402
from leantrain.cli import main  # noqa: E402


class Trace:
    def __init__(self) -> None:
        self.runs, self.calls, self.edges = 0, [], set()

    def __call__(self, frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(SRC):
            return
        if event == "call" and self.runs == 3:
            self.calls.append(os.path.relpath(path, SRC))
            back = frame.f_back
            if back is not None and back.f_code.co_filename.startswith(SRC) and back.f_code.co_filename != path:
                self.edges.add((os.path.relpath(back.f_code.co_filename, SRC), self.calls[-1]))
        if event == "return" and frame.f_code.co_name == "_run" and path.endswith("optimizer.py"):
            self.runs += 1

    def summary(self, what: str) -> str:
        files = sorted(set(self.calls))
        return (f"{what}: {len(files)} files, {len(self.edges)} distinct file-to-file calls (caller file -> "
                f"callee file), {len(self.calls)} calls in all\n  " + ", ".join(files))


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


if __name__ == "__main__":
    print(traced(command).summary("the command"))
    print(traced(library).summary("train_loader"))
    from leantrain.training.update import step

    fn = getattr(step, "update")
    print(f"step.update: {len(inspect.signature(fn).parameters)} parameters")
