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
