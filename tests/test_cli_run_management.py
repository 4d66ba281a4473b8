"""The command's run-management flags: --eval-every, --keep-last, --keep-best, --log-to,
--profile, --deterministic, a resume from the folder of checkpoints, and find-lr."""

import json

import pytest

import leantrain as lt
from leantrain.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_evaluates_every_n_updates_keeps_the_last_and_the_best_and_logs_to_csv(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--epochs", "2", "--out", str(out), "--eval-every", "20", "--keep-last", "1", "--keep-best",
            "accuracy", "--checkpoint-every", "10", "--log-to", "csv", "--profile", "3:4", "--deterministic"]
    assert main(args) == 0
    text = capsys.readouterr().out
    evals = [r for r in records(out) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [20, 40, 60, 80, 90]  # every 20 of the 90 updates, and the last (Trainer's rule)
    report = json.loads((out / "report.json").read_text())
    assert "samples_seen" in report and "images_seen" not in report
    best = max(evals, key=lambda r: (r["accuracy"], -r["step"]))  # ties: the earlier update
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == sorted({f"step{best['step']}.ckpt", "step90.ckpt"})  # the best, and the last one
    assert report["best_checkpoint"] == str(out / "checkpoints" / f"step{best['step']}.ckpt")
    assert "best checkpoint (accuracy)" in text
    assert (out / "metrics.csv").read_text().startswith("kind,step,epoch,name,value")
    assert len(list((out / "profile").glob("*.updates3-4.pt.trace.json"))) == 1
    # inspect takes the run folder (#66): the kept files listed, the best shown in detail
    assert main(["inspect", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{out}: a run folder keeping {len(kept)} checkpoint(s) in {out / 'checkpoints'}"
    assert any(line.startswith("  step90.ckpt: ") and "(the newest" in line for line in lines)
    name = f"step{best['step']}.ckpt"
    assert f"showing {name}, the best:" in lines
    assert lines[lines.index(f"showing {name}, the best:") + 1].startswith(f"{out / 'checkpoints' / name}: leantrain")
    assert "integrity: OK" in "\n".join(lines)
    assert main(["inspect", str(out / "checkpoints")]) == 0  # the folder itself: the newest shown
    assert "showing step90.ckpt, the newest whole one:" in capsys.readouterr().out


def test_a_run_with_a_folder_of_checkpoints_resumes_from_its_newest(tmp_path, capsys):
    out, straight = tmp_path / "run", tmp_path / "straight"
    common = ["--epochs", "2", "--keep-last", "2", "--checkpoint-every", "15"]
    assert main(["train", *common, "--out", str(straight)]) == 0
    assert main(["train", *common, "--out", str(out), "--max-steps", "50"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step45.ckpt", "step50.ckpt"]
    assert main(["train", "--resume", str(out), "--max-steps", "90"]) == 0
    capsys.readouterr()
    a = lt.read_checkpoint(out / "checkpoints" / "step90.ckpt")[1]
    b = lt.read_checkpoint(straight / "checkpoints" / "step90.ckpt")[1]
    params = [k for k in a if k.startswith("storage")]
    assert params and all((a[k] == b[k]).all() for k in params)


@pytest.mark.parametrize("flag, value, message", [
    ("--keep-best", "accuracy:up", "--keep-best"),
    ("--log-to", "csv,slack", "--log-to: expected a comma-separated list"),
    ("--profile", "5:2", "--profile"),
    ("--eval-every", "0", "--eval-every"),
])
def test_bad_run_management_flags_are_one_line_errors(tmp_path, capsys, flag, value, message):
    assert main(["train", "--epochs", "1", "--out", str(tmp_path / "r"), flag, value]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_keep_best_names_a_metric_the_test_split_gives(tmp_path, capsys):
    assert main(["train", "--epochs", "1", "--out", str(tmp_path / "r"), "--keep-best", "bleu"]) == 2
    assert "the test split gives loss, accuracy" in capsys.readouterr().err


def test_find_lr_writes_the_curve_and_suggests_a_rate(tmp_path, capsys):
    out = tmp_path / "lr"
    assert main(["find-lr", "--epochs", "1", "--out", str(out), "--steps", "40"]) == 0
    text = capsys.readouterr().out
    assert "suggested learning rate:" in text or "no suggestion" in text
    assert (out / "lr_find.png").read_bytes()[:8] == PNG
    record = json.loads((out / "lr_find.json").read_text())
    assert 3 <= len(record["lrs"]) <= 40 and len(record["losses"]) == len(record["lrs"])
    assert not (out / "checkpoint.ckpt").exists() and not (out / "metrics.jsonl").exists()


def test_log_to_a_tracker_that_cannot_run_writes_nothing(tmp_path, capsys, monkeypatch):
    """The trackers are made before the run folder is touched: a missing package (or a
    store MLflow refuses) is one line, exit 2, and no config.json."""
    import builtins

    real = builtins.__import__

    def without_tensorboard(name, *a, **k):
        if name.startswith("torch.utils.tensorboard") or name == "tensorboard":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--out", str(out), "--log-to", "tensorboard"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'leantrain[tensorboard]'" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_log_to_mlflow_works_on_mlflow_s_default_store(tmp_path, capsys, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert main(["train", "--epochs", "1", "--max-steps", "4", "--out", "run", "--log-to", "mlflow"]) == 0
    client = mlflow.tracking.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("leantrain").experiment_id])
    assert [r.info.run_name for r in runs] == ["run"] and runs[0].info.status == "FINISHED"
    if mlflow.__version__.split(".")[0] >= "3":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a file store, refused by MLflow 3
        capsys.readouterr()
        assert main(["train", "--epochs", "1", "--out", "run2", "--log-to", "mlflow"]) == 2
        err = capsys.readouterr().err
        assert "cannot be used" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "run2").exists()


def test_the_command_keeps_the_best_k_and_stops_early(tmp_path, capsys):
    """#70: ``--keep-best accuracy:2`` keeps the best two (and the newest), ``--early-stopping
    0`` stops at the first evaluation without improvement, as a finished run (exit 0, the
    reason in the console and report.json); both from a TOML file too; a bad form is one
    line."""
    out = tmp_path / "run"
    assert main(["train", "--epochs", "6", "--keep-best", "accuracy:2", "--early-stopping", "0",
                 "--early-stopping-monitor", "accuracy", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    evals = [r for r in records(out) if r["kind"] == "eval"]
    accs = [r["accuracy"] for r in evals]
    stop = next(k for k in range(1, len(accs)) if accs[k] <= max(accs[:k]))  # the first without improvement
    assert len(evals) == stop + 1 and evals[-1]["step"] == 45 * (stop + 1)
    assert f"stopped early at step {45 * (stop + 1)} (--early-stopping: accuracy did not improve" in text
    report = json.loads((out / "report.json").read_text())
    assert report["stopped_early"].startswith("accuracy did not improve") and report["steps"] == 45 * (stop + 1)
    ranked = sorted(evals, key=lambda r: (-r["accuracy"], r["step"]))[:2]
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == sorted({f"step{r['step']}.ckpt" for r in ranked} | {f"step{evals[-1]['step']}.ckpt"})
    toml = tmp_path / "job.toml"
    toml.write_text('epochs = 2\nkeep_best = 3\nearly_stopping = 5\n')
    assert main(["train", str(toml), "--out", str(tmp_path / "t")]) == 0
    assert len(list((tmp_path / "t" / "checkpoints").iterdir())) == 2  # two evaluations: both within the best 3
    capsys.readouterr()
    assert main(["train", "--keep-best", "accuracy:best", "--out", str(tmp_path / "x")]) == 2
    assert "optionally :K" in capsys.readouterr().err
    assert main(["train", "--early-stopping-threshold", "0.5", "--out", str(tmp_path / "y")]) == 2
    assert "needs --early-stopping" in capsys.readouterr().err


def test_predict_writes_the_runs_outputs_with_its_best_checkpoint(tmp_path, capsys, monkeypatch):
    """#70: ``leantrain predict RUN -o preds.pt``: the run's model (its config.json), its best
    checkpoint, its test split (or ``--split train``, or ``--data``): one tensor, the
    outputs ``lt.predict`` gives with that checkpoint, in the data's order."""
    import torch

    from leantrain.cli.digits import digits_split
    from leantrain.cli.usermodel import PRESETS

    out = tmp_path / "run"
    assert main(["train", "--epochs", "2", "--eval-every", "20", "--keep-best", "accuracy", "--out", str(out)]) == 0
    best = json.loads((out / "report.json").read_text())["best_checkpoint"]
    capsys.readouterr()
    assert main(["predict", str(out), "-o", str(tmp_path / "p.pt")]) == 0
    assert f"with {best}" in capsys.readouterr().out
    preds = torch.load(tmp_path / "p.pt")
    _, test = digits_split()
    runner = lt.Runner.from_module(PRESETS["digits-mlp"](), "cross_entropy")
    lt.load_checkpoint(best, runner, restore_rng=False)
    ours = torch.cat(lt.predict(runner, [(torch.stack([x for x, _ in test]), torch.stack([y for _, y in test]))],
                                collect=True))
    assert preds.shape == (len(test), 10) and torch.equal(preds, ours)
    assert main(["predict", str(out), "--split", "train", "--step", "90", "-o", str(tmp_path / "t.pt")]) == 0
    assert torch.load(tmp_path / "t.pt").shape[0] == 1437
    (tmp_path / "few.py").write_text("import torch\ndef samples():\n    return [(torch.zeros(1, 8, 8), torch.tensor(1))] * 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["predict", str(out), "--data", "few:samples", "-o", str(tmp_path / "f.pt")]) == 0
    assert torch.load(tmp_path / "f.pt").shape == (3, 10)
    assert main(["predict", str(tmp_path), "-o", str(tmp_path / "n.pt")]) == 2
    assert "not a run folder" in capsys.readouterr().err
