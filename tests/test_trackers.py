"""Weights & Biases (offline) and MLflow (a local file store) hold the same numbers as the
JSONL log, and a resumed run continues the same tracker run; throughput at the log
cadence, without a host read per update; the profiler's trace with leantrain's phases."""

import json
import struct

import pytest
import torch

import leantrain as lt
from models import class_batches, tiny_classifier
from leantrain import optim
from leantrain.training.loops.throughput import TIMING_FIELDS, Throughput


net, batches = tiny_classifier, class_batches


def config(**kw):
    return lt.LoaderTrainConfig(**{**dict(epochs=2, optimizer=optim.adam(0.01), log_every=2, eval_data=batches(2, 9),
                                          eval_every=3, clip_grad_norm=1.0), **kw})


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected(records):
    """What a tracker should hold, from the JSONL: {name: [(step, value)]}."""
    out = {}
    for r in records:
        if r["kind"] == "step":
            for k in ("loss", "lr", "grad_norm", *TIMING_FIELDS):
                if k in r:
                    out.setdefault(f"train/{k}", []).append((r["step"], r[k]))
        elif r["kind"] == "eval":
            for k, v in r.items():
                if k not in ("kind", "step"):
                    out.setdefault(f"eval/{k}", []).append((r["step"], v))
    return out


# ------------------------------------------------------------------- MLflow
def test_mlflow_on_a_file_store_holds_the_jsonl_numbers_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind a switch
    uri = (tmp_path / "mlruns").as_uri()
    r = lt.Runner.from_module(net(), "cross_entropy")

    class Stop(lt.Callback):
        def on_step(self, event):
            return event.step == 5

    cfg = config(checkpoint_path=tmp_path / "c.ckpt", checkpoint_every=1, resume_from="auto")
    first = lt.MLflowLogger(uri, experiment="t")
    lt.train_loader(r, cfg, batches(5, 1), log=None, callbacks=[first, lt.JSONLLogger(tmp_path / "m.jsonl"), Stop()])
    again = lt.MLflowLogger(uri, experiment="t")
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), cfg, batches(5, 1), log=None,
                    callbacks=[again, lt.JSONLLogger(tmp_path / "m.jsonl")])
    assert again.run_id == first.run_id  # the checkpoint carried the run's id
    client = again.client
    want = expected(jsonl(tmp_path / "m.jsonl"))
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "eval/loss"} <= set(want)
    for name, pairs in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(again.run_id, name))
        assert sorted(set(got)) == sorted(pairs) or name in {f"train/{k}" for k in TIMING_FIELDS}, name
        assert {s for s, _ in got} == {s for s, _ in pairs}, name
    run = client.get_run(again.run_id)
    assert run.data.params["optimizer"] == "adam" and run.data.params["optimizer.lr"] == "0.01"
    assert run.info.status == "FINISHED"


def test_mlflow_on_its_default_store_works_and_a_store_it_refuses_is_one_clear_error(tmp_path, monkeypatch):
    """MLflow 3's default store (sqlite in the current folder, opened by the extra's
    SQLAlchemy) logs a run; a file store without MLflow's switch is refused when the logger
    is made, with MLflow's reason, before a run starts."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    logger = lt.MLflowLogger(experiment="t")
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), config(), batches(5, 1), log=None,
                    callbacks=[logger])
    assert [m.step for m in logger.client.get_metric_history(logger.run_id, "eval/loss")] == [3, 6, 9, 10]  # and the last
    import mlflow

    if mlflow.__version__.split(".")[0] >= "3":
        with pytest.raises(lt.ConfigError, match="MLflowLogger: the tracking store file:.* cannot be used: .*"
                                                 "MLFLOW_ALLOW_FILE_STORE"):
            lt.MLflowLogger((tmp_path / "mlruns").as_uri())


@pytest.mark.parametrize("name", ["a,b", "a\nb", "..", "a/../b", "x" * 260])
def test_a_metric_name_mlflow_refuses_is_refused_before_the_run_starts(tmp_path, monkeypatch, name):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    r = lt.Runner.from_module(net(), "cross_entropy")
    before = [t.clone() for t in r.module.parameters()]
    cfg = config(eval_metrics={name: lt.metrics.accuracy})
    with pytest.raises(lt.ConfigError, match="MLflowLogger: the metric .* breaks MLflow's naming rule"):
        lt.train_loader(r, cfg, batches(5, 1), log=None, callbacks=[lt.MLflowLogger(experiment="t")])
    assert all(torch.equal(a, b) for a, b in zip(before, r.module.parameters()))


# ------------------------------------------------------------------- files
def test_a_csv_metric_name_with_a_newline_and_a_quote_survives_a_resume(tmp_path):
    """The CSV's records are trimmed on resume as CSV records, so a quoted name holding a
    newline or a quote neither tears nor duplicates a row."""
    import csv

    odd = 'acc "top"\nline'
    metrics = {odd: lt.metrics.accuracy}

    class Stop(lt.Callback):
        def on_step(self, event):
            return event.step == 7

    cfg = config(eval_metrics=metrics, checkpoint_path=tmp_path / "c.ckpt", checkpoint_every=2, resume_from="auto")
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), cfg, batches(5, 1), log=None,
                    callbacks=[lt.CSVLogger(tmp_path / "m.csv"), Stop()])
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), cfg, batches(5, 1), log=None,
                    callbacks=[lt.CSVLogger(tmp_path / "m.csv")])
    straight = config(eval_metrics=metrics)
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), straight, batches(5, 1), log=None,
                    callbacks=[lt.CSVLogger(tmp_path / "s.csv")])
    rows = list(csv.reader((tmp_path / "m.csv").open(newline="")))
    keys = [(r[0], r[1], r[3]) for r in rows]
    assert keys == [(r[0], r[1], r[3]) for r in csv.reader((tmp_path / "s.csv").open(newline=""))]
    assert ("eval", "9", odd) in keys and len(keys) == len(set(keys))


@pytest.mark.parametrize("name", ["kind", "step", "epoch", "items"])
def test_a_metric_named_as_a_records_own_field_is_refused(name):
    with pytest.raises(lt.ConfigError, match=f"eval_metrics: '{name}' is not a metric name a loop can log"):
        config(eval_metrics={name: lt.metrics.accuracy})


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_log_file_that_cannot_be_written_is_refused_before_the_first_update(tmp_path, kind):
    (tmp_path / "blocker").write_text("a file where the folder would go")
    r = lt.Runner.from_module(net(), "cross_entropy")
    before = [t.clone() for t in r.module.parameters()]
    logger = (lt.JSONLLogger if kind == "jsonl" else lt.CSVLogger)(tmp_path / "blocker" / "m.log")
    with pytest.raises(lt.ConfigError, match="m.log: its folder cannot be made"):
        lt.train_loader(r, config(), batches(5, 1), log=None, callbacks=[logger])
    assert all(torch.equal(a, b) for a, b in zip(before, r.module.parameters()))
    (tmp_path / "dir.log").mkdir()
    with pytest.raises(lt.ConfigError, match="dir.log: is a folder"):
        lt.train_loader(r, config(), batches(5, 1), log=None, callbacks=[lt.JSONLLogger(tmp_path / "dir.log")])


# -------------------------------------------------------------------- W&B
def wandb_history(folder):
    """The history rows of every offline run file under ``folder`` (W&B's record log:
    LevelDB-style 32 KiB blocks of checksummed chunks holding protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(folder.rglob("*.wandb")):
        data, pos, buf = path.read_bytes(), 7, b""  # after the ":W&B" header
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if n == 0 and kind == 0:
                pos += left
                continue
            buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
            if kind in (1, 4):  # a whole record, or its last chunk
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
                elif record.WhichOneof("record_type") == "run":
                    rows.append({"_run": record.run.run_id})
    return rows


def test_wandb_offline_holds_the_jsonl_numbers_and_a_resume_continues_its_run(tmp_path):
    pytest.importorskip("wandb")
    r = lt.Runner.from_module(net(), "cross_entropy")

    class Stop(lt.Callback):
        def on_step(self, event):
            return event.step == 5

    cfg = config(checkpoint_path=tmp_path / "c.ckpt", checkpoint_every=1, resume_from="auto")
    first = lt.WandbLogger("leantrain-test", dir=tmp_path, mode="offline")
    lt.train_loader(r, cfg, batches(5, 1), log=None, callbacks=[first, lt.JSONLLogger(tmp_path / "m.jsonl"), Stop()])
    again = lt.WandbLogger("leantrain-test", dir=tmp_path, mode="offline")
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), cfg, batches(5, 1), log=None,
                    callbacks=[again, lt.JSONLLogger(tmp_path / "m.jsonl")])
    assert again.run_id == first.run_id
    rows = wandb_history(tmp_path / "wandb")
    assert [row["_run"] for row in rows if "_run" in row] == [first.run_id, first.run_id]
    got = {}
    for row in rows:
        for k, v in row.items():
            if not k.startswith("_"):
                got.setdefault(k, set()).add((row["_step"], v))
    for name, pairs in expected(jsonl(tmp_path / "m.jsonl")).items():
        if name.removeprefix("train/") in TIMING_FIELDS:
            assert {s for s, _ in got[name]} == {s for s, _ in pairs}, name
        else:
            assert set(pairs) <= got[name], name


def test_a_missing_tracker_package_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *a, **k):
        if name in ("wandb", "mlflow"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(lt.ConfigError, match=r"pip install 'leantrain\[wandb\]'"):
        lt.WandbLogger()
    with pytest.raises(lt.ConfigError, match=r"pip install 'leantrain\[mlflow\]'"):
        lt.MLflowLogger()


# -------------------------------------------------------------- throughput
def test_throughput_is_logged_on_logged_updates_only_and_counts_examples_and_tokens(tmp_path):
    events = []

    class Hear(lt.Callback):
        reads_only = True

        def on_step(self, event):
            events.append(event)

    r = lt.Runner.from_module(net(), "cross_entropy")
    lt.train_loader(r, config(eval_data=None, clip_grad_norm=None), batches(5, 1), log=None,
                    callbacks=[Hear(), lt.JSONLLogger(tmp_path / "m.jsonl")])
    assert [e.throughput is not None for e in events] == [e.loss is not None for e in events]
    steps = [rec for rec in jsonl(tmp_path / "m.jsonl") if rec["kind"] == "step"]
    assert all(rec["samples_per_s"] > 0 and "tokens_per_s" not in rec for rec in steps)

    # token data: tokens are the attention mask's ones; MFU from the given peak
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 3)

        def forward(self, input_ids, attention_mask, labels):
            return self.emb(input_ids).sum(-1) * attention_mask

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    data = [{"input_ids": torch.randint(0, 11, (2, 4)), "attention_mask": mask, "labels": torch.zeros(2, 4)}] * 3
    events.clear()
    r = lt.Runner.from_module(Tokens(), "mse")
    lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), log_every=1, peak_flops=1e12),
                    data, log=None, callbacks=[Hear()])
    for e in events:
        t = e.throughput
        assert t["tokens_per_s"] / t["samples_per_s"] == pytest.approx(5 / 2)  # 5 tokens in 2 examples
        assert t["mfu"] == pytest.approx(6 * 33 * t["tokens_per_s"] / 1e12)


def test_throughput_adds_no_host_read_per_update(monkeypatch):
    from test_loops import HostReads

    r = lt.Runner.from_module(net(), "cross_entropy").to("cpu")  # parameters on device mirrors
    reads = HostReads(monkeypatch)
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=optim.adam(0.01), log_every=0, nonfinite="skip",
                               measure_loss=False)
    before = reads.count
    lt.train_loader(r, cfg, batches(6, 1), log=None)
    quiet = reads.count - before
    before = reads.count
    lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, optimizer=optim.adam(0.01), log_every=3, nonfinite="skip",
                                            measure_loss=False), batches(6, 1), log=None)
    assert reads.count - before == quiet + 2  # the two logged updates' loss, nothing for the rates


def test_a_device_mask_is_summed_on_the_device_and_read_at_the_log_point_only():
    meter = Throughput(lt.Runner.from_module(net(), "mse"), None)
    meta = {"input_ids": torch.zeros(2, 4, dtype=torch.long, device="meta"),
            "attention_mask": torch.ones(2, 4, dtype=torch.long, device="meta")}
    meter.count([(meta, None)] * 3)  # a device tensor (meta stands in): no host read could happen
    assert meter.device_tokens is not None and meter.device_tokens.device.type == "meta" and meter.tokens == 0


# ---------------------------------------------------------------- profiler
def test_the_profiler_traces_the_asked_updates_with_leantrains_phases(tmp_path):
    r = lt.Runner.from_module(net(), "cross_entropy")
    cfg = config(profile=(3, 4), profile_dir=tmp_path / "prof", checkpoint_path=tmp_path / "c.ckpt",
                 checkpoint_every=3)
    lt.train_loader(r, cfg, batches(5, 1), log=None)
    traces = list((tmp_path / "prof").glob("*.updates3-4.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    assert names.count("leantrain.update") == 2 and names.count("leantrain.after_update") == 2
    assert "leantrain.evaluate" in names and "leantrain.checkpoint" in names  # update 3's evaluation and save
    assert any(str(n).startswith("aten::") for n in names)


def test_a_run_that_ends_inside_the_profiled_updates_still_writes_its_trace(tmp_path):
    r = lt.Runner.from_module(net(), "cross_entropy")
    lt.train_loader(r, config(profile=(9, 50), profile_dir=tmp_path / "p", eval_data=None), batches(5, 1), log=None)
    assert len(list((tmp_path / "p").glob("*.updates9-50.pt.trace.json"))) == 1
