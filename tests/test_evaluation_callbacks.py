"""evaluate, the callback protocol and the ready callbacks, in both loops."""

import csv
import io
import json

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader, TensorDataset

import leantrain as lt
from leantrain import optim
from models import TiedNet, regression_batches


def classifier(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.2),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3))


def class_data(n, rows=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


# ------------------------------------------------------------------- evaluate
def test_evaluate_matches_a_plain_eval_loop_and_leaves_everything_as_found():
    model = classifier()
    r = lt.Runner.from_module(model, "cross_entropy")
    data = class_data(4)
    data[-1] = (data[-1][0][:2], data[-1][1][:2])  # a short last batch: accuracy weighs by examples
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    res = lt.evaluate(r, data, {"accuracy": lt.metrics.accuracy})
    assert r.mode == "train" and model.training  # the runner's mode is restored
    model.eval()
    with torch.no_grad():
        outs = [model(x) for x, _ in data]
    losses = [torch.nn.functional.cross_entropy(o, y) for o, (_, y) in zip(outs, data)]
    correct = sum(int((o.argmax(-1) == y).sum()) for o, (_, y) in zip(outs, data))
    rows = [len(y) for _, y in data]  # the loss weighs by examples too (#68 item 7), as Trainer and Lightning
    assert res["loss"] == pytest.approx(float(sum(loss * k for loss, k in zip(losses, rows)) / sum(rows)), rel=1e-6)
    assert res["accuracy"] == correct / 17 and res["items"] == 4
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("kind", ["list", "dataset", "loader", "torch_loader"])
def test_evaluate_takes_every_kind_of_data(kind):
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    data = class_data(3, rows=2)
    inputs = {
        "list": data,
        "dataset": lt.Dataset(data),
        "loader": lt.DataLoader(lt.Dataset(data), batch_size=1),
        "torch_loader": TorchLoader(TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])),
                                    batch_size=1),
    }[kind]
    res = lt.evaluate(r, inputs, {"accuracy": lt.metrics.accuracy})
    assert res["items"] == 3 or (kind == "torch_loader" and res["items"] == 6)
    assert 0.0 <= res["accuracy"] <= 1.0


def test_an_empty_evaluation_set_is_loss_zero_and_reported_as_empty():
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    assert lt.evaluate(r, [], {"accuracy": lt.metrics.accuracy}) == {"loss": 0.0, "accuracy": 0.0, "items": 0.0}


# ------------------------------------------------------------------ in the loops
class Recorder(lt.Callback):
    def __init__(self):
        self.calls = []

    def on_begin(self, total, start):
        self.calls.append(("begin", total, start))

    def on_step(self, event):
        self.calls.append(("step", event.step))

    def on_epoch_end(self, event):
        self.calls.append(("epoch", event.epoch))

    def on_eval(self, step, results):
        self.calls.append(("eval", step, sorted(results)))

    def on_end(self, report):
        self.calls.append(("end", report.steps))


def test_callbacks_and_evaluation_in_train_samples():
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    rec = Recorder()
    cfg = lt.TrainConfig(steps=4, batch_size=2, optimizer=optim.adam(0.01), log_every=0,
                         eval_data=class_data(2, seed=9), eval_every=2, eval_metrics={"accuracy": lt.metrics.accuracy})
    report = lt.train_samples(r, cfg, class_data(4), callbacks=[rec])
    assert rec.calls == [("begin", 4, 0), ("step", 1), ("step", 2), ("eval", 2, ["accuracy", "items", "loss"]),
                         ("step", 3), ("step", 4), ("eval", 4, ["accuracy", "items", "loss"]), ("end", 4)]
    assert [s for s, _ in report.evals] == [2, 4]


def test_callbacks_and_evaluation_per_epoch_in_train_loader():
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    rec = Recorder()
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(0.1), log_every=0, eval_data=class_data(2, seed=9))
    report, _ = lt.train_loader(r, cfg, lt.DataLoader(lt.Dataset(class_data(3)), batch_size=2), callbacks=[rec])
    assert rec.calls == [("begin", 4, 0), ("step", 1), ("step", 2), ("epoch", 0), ("eval", 2, ["items", "loss"]),
                         ("step", 3), ("step", 4), ("epoch", 1), ("eval", 4, ["items", "loss"]), ("end", 4)]
    assert [s for s, _ in report.evals] == [2, 4]


def test_early_stopping_stops_at_the_right_step_and_saves():
    stopper = lt.EarlyStopping("loss", patience=2, mode="min")
    seq = [3.0, 2.0, 2.5, 2.1, 1.0]
    assert [stopper.on_eval(i + 1, {"loss": v}) for i, v in enumerate(seq[:4])] == [False, False, False, True]
    assert stopper.stopped_step == 4 and stopper.best == 2.0
    maxer = lt.EarlyStopping("accuracy", patience=1, mode="max", min_delta=0.05)
    # 0.52 improves on 0.5 by less than min_delta: a bad evaluation; 0.6 is a real improvement
    assert [maxer.on_eval(k, {"accuracy": a}) for k, a in enumerate([0.5, 0.52, 0.6])] == [False, True, False]


def test_early_stopping_in_a_loop(tmp_path):
    """Evaluation of a model that cannot change (lr 0, no buffers): stop after `patience`."""
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    stopper = lt.EarlyStopping("loss", patience=2)
    cfg = lt.TrainConfig(steps=50, optimizer=optim.sgd(0.0), log_every=0, eval_data=regression_batches(2, 3, seed=9),
                         checkpoint_path=tmp_path / "c.ckpt")
    report = lt.train_samples(r, cfg, regression_batches(3, 2), callbacks=[stopper])
    assert report.steps == 3 and report.interrupted and stopper.stopped_step == 3
    progress = lt.read_checkpoint(tmp_path / "c.ckpt")[0]["progress"]
    assert progress["step"] == 3 and [e[0] for e in progress["evals"]] == [1, 2, 3]


def test_early_stopping_rejects_an_unknown_result():
    stopper = lt.EarlyStopping("acc")
    with pytest.raises(lt.ConfigError, match="no result named 'acc'"):
        stopper.on_eval(1, {"loss": 1.0, "items": 2.0})


def test_loggers_write_files_that_parse_back(tmp_path):
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    cfg = lt.TrainConfig(steps=4, optimizer=optim.adam(0.01), log_every=2, eval_data=class_data(2, seed=9),
                         eval_every=4, eval_metrics={"accuracy": lt.metrics.accuracy})
    report = lt.train_samples(r, cfg, class_data(3), log=lambda s: None,
                              callbacks=[lt.JSONLLogger(tmp_path / "m.jsonl"), lt.CSVLogger(tmp_path / "m.csv")])
    meta, *records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert meta == {"kind": "meta", "format": 2, "step": 0}
    # every record counts updates from 1: the loss logged before update 1, before update 3, the eval after 4
    assert [(x["kind"], x["step"]) for x in records] == [("step", 1), ("step", 3), ("eval", 4)]
    assert [x["loss"] for x in records[:2]] == [loss for _, loss in report.losses]
    assert [k for k, _ in report.losses] == [1, 3]  # the same update numbers as the records (from 1)
    assert records[2]["accuracy"] == report.evals[0][1]["accuracy"]
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert (rows[0]["kind"], rows[0]["name"], rows[0]["value"]) == ("meta", "format", "2")
    assert [(r["kind"], r["step"], r["name"]) for r in rows if r["name"] in ("loss", "accuracy")] == [
        ("step", "1", "loss"), ("step", "3", "loss"), ("eval", "4", "loss"), ("eval", "4", "accuracy")]
    assert float(rows[1]["value"]) == report.losses[0][1]


def test_the_progress_bar_shows_the_run(tmp_path):
    out = io.StringIO()
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    lt.train_samples(r, lt.TrainConfig(steps=5, log_every=1), class_data(2), log=lambda s: None,
                     callbacks=[lt.ProgressBar(file=out)])
    text = out.getvalue()
    assert "5/5" in text and "loss=" in text


def test_no_progress_bar_unless_asked_outside_a_terminal(capsys):
    r = lt.Runner.from_module(classifier(), "cross_entropy")
    lt.train_samples(r, lt.TrainConfig(steps=3, log_every=1), class_data(2), log=lambda s: None)
    err = capsys.readouterr().err
    assert "step/s" not in err and "3/3" not in err


def test_tensorboard_logger_needs_its_extra_or_says_so(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(lt.ConfigError, match=r"pip install 'leantrain\[tensorboard\]'"):
            lt.TensorBoardLogger(tmp_path)
    else:  # pragma: no cover - only where tensorboard is installed
        lt.TensorBoardLogger(tmp_path).on_end(None)


def test_bad_callbacks_are_refused_before_anything_changes(unchanged):
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")
    with unchanged(r.params), pytest.raises(lt.ConfigError, match=r"callbacks\[0\] is a function"):
        lt.train_samples(r, lt.TrainConfig(steps=1), regression_batches(1, 2), callbacks=[lambda e: None])
    with pytest.raises(lt.ConfigError, match="eval_metrics needs eval_data"):
        lt.TrainConfig(steps=1, eval_metrics={"a": lt.metrics.accuracy})
    with pytest.raises(lt.ConfigError, match="eval_every must be an integer >= 1"):
        lt.TrainConfig(steps=1, eval_every=0)


# --------------------------------------------------------------- small frictions
def test_measure_loss_false_skips_the_before_and_after_passes():
    model = TiedNet(bn=False)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    r = lt.Runner.from_module(model, "mse")
    report = lt.train_samples(r, lt.TrainConfig(steps=2, log_every=0, measure_loss=False), regression_batches(3, 2))
    assert report.before is None and report.after is None and len(calls) == 2


def test_a_compiled_models_names_have_no_orig_mod_prefix():
    model = TiedNet(bn=False)
    wrapped = torch.nn.Module()
    wrapped._orig_mod = model  # what torch.compile's OptimizedModule holds
    names = lt.Runner.from_module(wrapped, "mse").params.names
    assert names == [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert lt.weights.export_state_dict(lt.Runner.from_module(wrapped, "mse")).keys() == \
        lt.weights.export_state_dict(lt.Runner.from_module(model, "mse")).keys()
    compiled = torch.compile(model)  # no forward here: nothing is compiled
    assert lt.Runner.from_module(compiled, "mse").params.names == names
