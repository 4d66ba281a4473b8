"""One numbering: an update is numbered from 1 everywhere. The console's ``step N`` line,
the JSONL and CSV records, ``TrainReport`` (losses, gradient norms, evaluations), the
callbacks' events, the kept checkpoints' names and their progress all name update N
alike, and a resumed run continues the same numbers."""

from __future__ import annotations

import csv
import json

import torch

import leantrain as lt
from leantrain import optim


def _job(tmp_path, **overrides):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 4, generator=g)
    data = [(x[i], x[i].sum(0, keepdim=True)) for i in range(40)]
    cfg = dict(epochs=2, optimizer=optim.sgd(0.05), log_every=3, eval_data=data[:8], eval_every=4,
               clip_grad_norm=10.0, checkpoint_path=tmp_path / "ck" / "step{step}.ckpt", checkpoint_every=5,
               keep_last=100)
    cfg.update(overrides)
    loader = lt.DataLoader(lt.Dataset(data), batch_size=4, shuffle=True, seed=2)  # 10 updates an epoch
    return lt.Runner.from_module(model, "mse"), lt.LoaderTrainConfig(**cfg), loader


class Events(lt.Callback):
    def __init__(self):
        self.steps, self.logged, self.evals = [], [], []

    def on_step(self, event):
        self.steps.append(event.step)
        if event.loss is not None:
            self.logged.append((event.step, event.loss))

    def on_eval(self, step, results):
        self.evals.append(step)


def test_console_files_report_events_and_checkpoints_name_update_n_alike(tmp_path):
    runner, cfg, loader = _job(tmp_path)
    lines, events = [], Events()
    jsonl, table = lt.JSONLLogger(tmp_path / "m.jsonl"), lt.CSVLogger(tmp_path / "m.csv")
    report, _ = lt.train_loader(runner, cfg, loader, log=lines.append, callbacks=[events, jsonl, table])

    logged = [1, 4, 7, 10, 13, 16, 19]  # the first update, then every log_every-th
    assert [n for n, _ in report.losses] == logged == [n for n, _ in report.grad_norms]
    assert lines == [f"step {n}: loss={v:.6f}" for n, v in report.losses]
    assert events.steps == list(range(1, 21)) and events.logged == list(report.losses)
    assert events.evals == [n for n, _ in report.evals] == [4, 8, 12, 16, 20]

    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()][1:]
    assert [(r["step"], r["loss"]) for r in records if r["kind"] == "step"] == list(report.losses)
    assert [r["step"] for r in records if r["kind"] == "eval"] == events.evals
    rows = list(csv.reader((tmp_path / "m.csv").open()))[1:]
    assert sorted({int(r[1]) for r in rows if r[0] == "step"}) == logged

    kept = sorted(int(p.stem.removeprefix("step")) for p in (tmp_path / "ck").glob("step*.ckpt"))
    assert kept == [5, 10, 15, 20]
    for n in kept:
        progress = lt.read_checkpoint(tmp_path / "ck" / f"step{n}.ckpt")[0]["progress"]
        assert progress["step"] == n and progress["numbered_from"] == 1
        assert [k for k, _ in progress["losses"]] == [k for k in logged if k <= n]


def test_a_resumed_run_continues_the_same_numbers(tmp_path):
    runner, cfg, loader = _job(tmp_path)
    straight, _ = lt.train_loader(runner, cfg, loader, log=None)

    # max_steps ends that run: eval_at_end would evaluate its update 10, off the straight run's cadence
    runner, cfg, loader = _job(tmp_path / "b", max_steps=10, eval_at_end=False)
    lt.train_loader(runner, cfg, loader, log=None)
    runner, cfg, loader = _job(tmp_path / "b", resume_from="auto")
    lines = []
    resumed, _ = lt.train_loader(runner, cfg, loader, log=lines.append)
    assert lines[1:] == [f"step {n}: loss={v:.6f}" for n, v in resumed.losses if n > 10]
    assert resumed.losses == straight.losses and resumed.evals == straight.evals
    assert resumed.grad_norms == straight.grad_norms


def test_a_checkpoint_written_before_updates_were_numbered_from_1_reads_its_losses_shifted(tmp_path):
    """A progress record without ``numbered_from`` holds 0-based update indices."""
    from leantrain.training.loops.record import RunRecord

    record = RunRecord()
    record.resume({"before": 1.0, "losses": [[0, 2.0], [3, 1.5]], "grad_norms": [[0, 4.0]], "evals": [[4, {}]]})
    assert record.logged == [(1, 2.0), (4, 1.5)] and record.grad_norms == [(1, 4.0)] and record.evals == [(4, {})]
    record.resume({"before": 1.0, "losses": [[1, 2.0]], "numbered_from": 1})
    assert record.logged == [(1, 2.0)]
