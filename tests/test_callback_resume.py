"""Callbacks across a resume: their state travels in the checkpoint, the loggers write each
record once, and misconfigured callbacks are refused before training."""

import json

import pytest
import torch
from torch import nn

import leantrain as lt
from logtools import records_without_timing
from callback_child import config as _cfg, data as _data, runner as _runner  # the run the fresh process resumes


class Crash(lt.Callback):
    """Stops the run (as a crash would, after the checkpoint at that step) at update ``at``."""

    reads_only = True

    def __init__(self, at):
        self.at = at

    def on_step(self, event):
        return event.step == self.at


def test_early_stopping_resumed_stops_where_the_uninterrupted_run_stops(tmp_path):
    straight = lt.EarlyStopping(patience=2)
    report = lt.train_samples(_runner(), _cfg(tmp_path / "a"), _data(), callbacks=[straight], log=lambda s: None)
    assert report.interrupted and straight.stopped_step is not None
    stop = straight.stopped_step
    first = lt.EarlyStopping(patience=2)
    lt.train_samples(_runner(), _cfg(tmp_path / "b"), _data(), callbacks=[first, Crash(stop - 1)], log=lambda s: None)
    resumed = lt.EarlyStopping(patience=2)
    again = lt.train_samples(_runner(), _cfg(tmp_path / "b", resume_from=tmp_path / "b" / "c.ckpt"), _data(),
                             callbacks=[resumed], log=lambda s: None)
    assert resumed.stopped_step == stop and again.steps == report.steps


def test_loggers_hold_each_record_once_after_a_resume(tmp_path):
    path, csv_path = tmp_path / "m.jsonl", tmp_path / "m.csv"
    lt.train_samples(_runner(), _cfg(tmp_path), _data(),
                     callbacks=[lt.JSONLLogger(path), lt.CSVLogger(csv_path), Crash(4)], log=lambda s: None)
    with path.open("a") as f:  # written after the last checkpoint, before the interruption, and torn
        f.write(json.dumps({"kind": "step", "step": 5, "loss": 1.0}) + "\n" + '{"kind": "st')
    lt.train_samples(_runner(), _cfg(tmp_path, resume_from=tmp_path / "c.ckpt"), _data(),
                     callbacks=[lt.JSONLLogger(path), lt.CSVLogger(csv_path), Crash(6)], log=lambda s: None)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "step"]
    evals = [r["step"] for r in records if r["kind"] == "eval"]
    assert steps == list(range(1, 7)) and evals == list(range(1, 7))  # updates counted from 1
    assert records[0]["kind"] == "meta" and [r["kind"] for r in records].count("meta") == 1
    rows = csv_path.read_text().splitlines()
    assert rows[0] == "kind,step,epoch,name,value" and rows[1] == "meta,0,,format,2"
    assert [r.split(",")[1] for r in rows[1:] if r.startswith("step,") and ",loss," in r] == [
        str(k) for k in range(1, 7)]


def test_an_older_metrics_file_resumes_and_plots_with_its_steps_from_0(tmp_path):
    """A file written before step records counted from 1 (no meta record): a resume trims
    it by its own numbering, and plot reads its step k as update k + 1."""
    from leantrain.cli.plotting import _points, read_metrics
    from leantrain.training.loops.loggers import step_offset

    path = tmp_path / "m.jsonl"
    lt.train_samples(_runner(), _cfg(tmp_path), _data(), callbacks=[lt.JSONLLogger(path), Crash(4)],
                     log=lambda s: None)
    lines = path.read_text().splitlines()
    older = [json.loads(x) for x in lines[1:]]
    for r in older:
        if r["kind"] == "step":
            r["step"] -= 1  # as the older leantrain wrote it
    older.append({"kind": "step", "step": 4, "loss": 1.0})  # after the checkpoint at update 4: dropped
    path.write_text("".join(json.dumps(r) + "\n" for r in older))
    lt.train_samples(_runner(), _cfg(tmp_path, resume_from=tmp_path / "c.ckpt"), _data(),
                     callbacks=[lt.JSONLLogger(path), Crash(6)], log=lambda s: None)
    records = read_metrics(path)
    assert step_offset(records) == 1 and not any(r["kind"] == "meta" for r in records)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == [0, 1, 2, 3, 5, 6]  # the older file's own numbering up to the checkpoint, then the new run's
    fresh = tmp_path / "new.jsonl"
    lt.train_samples(_runner(), _cfg(tmp_path / "f"), _data(), callbacks=[lt.JSONLLogger(fresh), Crash(4)],
                     log=lambda s: None)
    assert step_offset(read_metrics(fresh)) == 0
    assert [x for x, _ in _points(fresh, read_metrics(fresh), "step", "step", "loss")] == [1, 2, 3, 4]


def test_the_callbacks_state_must_match_or_it_starts_afresh_with_a_warning(tmp_path):
    lt.train_samples(_runner(), _cfg(tmp_path), _data(), callbacks=[lt.EarlyStopping(patience=5), Crash(2)],
                     log=lambda s: None)
    with pytest.warns(UserWarning, match=r"carries the state of the callbacks \['EarlyStopping'\].*start afresh"):
        lt.train_samples(_runner(), _cfg(tmp_path, resume_from=tmp_path / "c.ckpt"), _data(), callbacks=[Crash(3)],
                         log=lambda s: None)


@pytest.mark.parametrize("kw, cbs, match", [
    ({}, [lt.EarlyStopping()], "EarlyStopping watches evaluations: set eval_data"),
    ({"eval_data": _data(2)}, [lt.EarlyStopping(monitor="accuracy")], "monitors 'accuracy'"),
])
def test_misconfigured_early_stopping_is_refused_before_training(kw, cbs, match):
    r = _runner()
    before = [p.clone() for p in r.module.parameters()]
    with pytest.raises(lt.ConfigError, match=match):
        lt.train_samples(r, lt.TrainConfig(steps=3, log_every=0, **kw), _data(), callbacks=cbs)
    assert all(torch.equal(a, b) for a, b in zip(before, r.module.parameters()))


def test_empty_eval_data_and_a_folder_checkpoint_path_are_refused_before_training(tmp_path):
    with pytest.raises(lt.ConfigError, match="eval_data is empty"):
        lt.TrainConfig(steps=3, eval_data=[])
    r = _runner()
    before = [p.clone() for p in r.module.parameters()]
    with pytest.raises(lt.CheckpointError, match="is a folder"):
        lt.train_samples(r, lt.TrainConfig(steps=3, log_every=0, checkpoint_path=tmp_path), _data())
    assert all(torch.equal(a, b) for a, b in zip(before, r.module.parameters()))


def test_a_refused_start_keeps_the_runners_mode_and_moving_average(tmp_path):
    r = _runner()
    lt.train_samples(r, lt.TrainConfig(steps=2, log_every=0, ema_decay=0.9, checkpoint_path=tmp_path / "c.ckpt"),
                     _data())
    ema = r.ema
    r.eval()
    with pytest.raises(lt.CheckpointError):  # the checkpoint was made with other settings
        lt.train_samples(r, lt.TrainConfig(steps=4, batch_size=2, log_every=0, ema_decay=0.9,
                                           resume_from=tmp_path / "c.ckpt"), _data())
    assert r.mode == "eval" and r.ema is ema


def test_float16_parameters_with_float16_loss_scaling_are_refused_with_the_reason():
    r = lt.Runner.from_module(nn.Linear(3, 2).half(), "mse")
    with pytest.raises(lt.ConfigError, match=r"slot 0 \('weight'\) in float16: loss scaling needs float32"):
        lt.train_samples(r, lt.TrainConfig(steps=1, log_every=0, autocast="float16"),
                         [(torch.randn(2, 3).half(), torch.randn(2, 2).half())])


@pytest.mark.parametrize("answer", [torch.tensor(True), "stop", 1])
def test_a_hook_must_answer_true_or_none(answer):
    class Odd(lt.Callback):
        def on_step(self, event):
            return answer

    with pytest.raises(lt.ConfigError, match=r"Odd.on_step returned .*; return True to stop the run"):
        lt.train_samples(_runner(), lt.TrainConfig(steps=2, log_every=0), _data(), callbacks=[Odd()])
    with pytest.raises(lt.ConfigError, match="the step callback returned"):
        lt.train_samples(_runner(), lt.TrainConfig(steps=2, log_every=0), _data(), callback=lambda e: answer)


def test_early_stopping_and_the_logger_resumed_in_a_fresh_process(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import callback_child as child

    straight = lt.EarlyStopping(patience=2)
    work_a = tmp_path / "a"
    work_a.mkdir()
    report = lt.train_samples(child.runner(), child.config(work_a), child.data(),
                              callbacks=[straight, lt.JSONLLogger(work_a / "m.jsonl")], log=lambda s: None)
    work_b = tmp_path / "b"
    work_b.mkdir()
    lt.train_samples(child.runner(), child.config(work_b), child.data(),
                     callbacks=[lt.EarlyStopping(patience=2), lt.JSONLLogger(work_b / "m.jsonl"),
                                Crash(straight.stopped_step - 1)], log=lambda s: None)
    here = Path(__file__).parent
    subprocess.run([sys.executable, str(here / "callback_child.py"), str(work_b)], check=True, timeout=300,
                   env={**__import__("os").environ, "PYTHONPATH": str(here)})
    resumed = json.loads((work_b / "resumed.json").read_text())
    assert resumed == {"stopped_step": straight.stopped_step, "steps": report.steps}
    # each record once, the same (the wall-clock throughput fields aside: they time this run)
    assert records_without_timing(work_b / "m.jsonl") == records_without_timing(work_a / "m.jsonl")
