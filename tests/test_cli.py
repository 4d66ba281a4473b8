"""The leantrain command: help, a short end-to-end run, inspect, plot, user errors, Ctrl-C."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import leantrain as lt
from leantrain.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "leantrain", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["quickstart-mlp"], ["train"], ["inspect"], ["plot"]])
def test_help_for_each_command(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    assert "usage: leantrain" in capsys.readouterr().out


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_quickstart(capsys):
    assert main(["quickstart-mlp", "--steps", "200", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "dataset size = 25" in out and "step 176: loss=" in out  # update 176 (numbered from 1)
    after = float(out.split("mean_loss(after training) = ")[1].split()[0])
    assert after < 0.01


def test_train_end_to_end_inspect_plot_and_resume(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--preset", "digits-mlp", "--epochs", "3", "--out", str(out), "--checkpoint-every", "50"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "test accuracy" in text
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2] and all(0 <= r["test_accuracy"] <= 1 for r in epochs)
    assert any(r["kind"] == "step" and "loss" in r for r in records)
    assert (out / "loss.png").read_bytes()[:8] == PNG
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 135 and report["aliased_slots"] == 1 and report["test_accuracy"] > 0.8
    assert main(["inspect", str(out / "checkpoint.ckpt")]) == 0
    shown = capsys.readouterr().out
    assert "integrity: OK" in shown and "slot 2 (alias)" in shown and '"step": 135' in shown
    assert main(["plot", str(out / "metrics.jsonl"), "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG
    # one more epoch from the saved run continues where it stopped
    assert main(["train", "--resume", str(out), "--epochs", "4"]) == 0
    assert json.loads((out / "report.json").read_text())["steps"] == 180


def test_toml_config_and_flag_override(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\npreset = "digits-cnn"\nepochs = 1\nbatch_size = 64\naccumulate = 2\noptimizer = "sgd"\nlr = 0.05\n')
    assert main(["train", str(cfg), "--out", str(tmp_path / "r"), "--lr", "0.1"]) == 0
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["preset"] == "digits-cnn" and saved["lr"] == 0.1 and saved["accumulate"] == 2
    assert "6 frozen" in capsys.readouterr().out  # BatchNorm buffers are frozen slots


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--preset", "nope"], "--preset: expected one of digits-mlp, digits-cnn, text-gpt, got 'nope'"),
        (["train", "--epochs", "two"], "argument --epochs: expected a natural number, got 'two'"),
        (["train", "--epochs", "0"], "argument --epochs: expected a number > 0, got 0"),
        (["train", "--optimizer", "lamb"], "--optimizer: expected one of"),
        (["train", "--lr", "-1"], "--lr: expected a finite number > 0, got -1.0"),
        (["train", "--bogus"], "unrecognized arguments: --bogus"),
        (["train", "missing.toml"], "missing.toml: no such config file"),
        (["train", "--resume", "nowhere"], "--resume nowhere: not a run folder"),
        (["inspect", "nope.ckpt"], "nope.ckpt: no such checkpoint file"),
        (["plot", "nope.jsonl", "-o", "x.png"], "nope.jsonl: no such metrics file"),
    ],
)
def test_user_errors_are_one_line_with_status_2(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_corrupt_checkpoint_and_resume_into_another_model(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--out", str(out)]) == 0
    assert main(["train", "--resume", str(out), "--preset", "digits-cnn"]) == 2
    err = capsys.readouterr().err
    assert "nothing was loaded" in err and len(err.strip().splitlines()) == 1
    data = bytearray((out / "checkpoint.ckpt").read_bytes())
    data[-5] ^= 0x10
    (out / "checkpoint.ckpt").write_bytes(bytes(data))
    assert main(["inspect", str(out / "checkpoint.ckpt")]) == 2
    assert "fails its checksum" in capsys.readouterr().err


def tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if not k.startswith("rng.")}


CTRL_C_AT = """
import os, signal, sys
from leantrain.training.loops import session

update = session.Session.update

def interrupted(self, state, batch, step):
    if step == {step}:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives just before update {step}
    return update(self, state, batch, step)

session.Session.update = interrupted
from leantrain.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.slow
def test_ctrl_c_saves_and_resume_continues_exactly(tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    common = ["train", "--epochs", "3", "--checkpoint-every", "0"]
    code = CTRL_C_AT.format(step=51, argv=[*common, "--out", str(broken)])  # before update 51 (from 1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr
    out, err = proc.stdout, proc.stderr
    assert "Traceback" not in err
    assert "interrupted at step 51;" in out  # update 50 finishes, then the run stops and saves
    resumed = run_cli("train", "--resume", str(broken))
    assert resumed.returncode == 0, resumed.stderr
    done = run_cli(*common, "--out", str(straight))
    assert done.returncode == 0, done.stderr
    a, b = tensors(straight / "checkpoint.ckpt"), tensors(broken / "checkpoint.ckpt")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ra = json.loads((straight / "report.json").read_text())
    rb = json.loads((broken / "report.json").read_text())
    assert ra["test_accuracy"] == rb["test_accuracy"] and ra["loss_after"] == rb["loss_after"]


MODEL_FILE = '''
import torch
from torch import nn

def make():
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2))

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 3, generator=g)
    y = (x[:, 0] > 0).long()
    return [(a, b) for a, b in zip(x[:40], y[:40])], [(a, b) for a, b in zip(x[40:], y[40:])]

NOT_CALLABLE = 3

def not_a_module():
    return 42
'''


def _user_project(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(
        f'model = "{name}:make"\ndata = "{name}:data"\nloss = "cross_entropy"\nepochs = 2\n'
        f'batch_size = 8\noptimizer = "adamw"\nweight_decay = 0.05\nlr = 0.01\ncheckpoint_every = 3\n'
    )


def test_train_a_user_model_from_the_command_and_resume_exactly(tmp_path, monkeypatch, capsys):
    _user_project(tmp_path, monkeypatch, "usermodel_a")
    assert main(["train", "run.toml", "--out", "straight"]) == 0
    out = capsys.readouterr().out
    assert "usermodel_a:make" in out and "test accuracy" in out
    report = json.loads((tmp_path / "straight" / "report.json").read_text())
    assert report["model"] == "usermodel_a:make" and report["steps"] == 10
    assert main(["train", "run.toml", "--out", "half", "--epochs", "1"]) == 0
    assert main(["train", "--resume", "half", "--epochs", "2"]) == 0
    a, b = tensors(tmp_path / "straight" / "checkpoint.ckpt"), tensors(tmp_path / "half" / "checkpoint.ckpt")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    records = [json.loads(line) for line in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]


@pytest.mark.parametrize("flag, ref, message", [
    ("--model", "no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
    ("--model", "usermodel_b:missing", "has no attribute 'missing'"),
    ("--model", "usermodel_b:NOT_CALLABLE", "is a int, not a callable"),
    ("--model", "usermodel_b:not_a_module", "returned a int, expected a torch.nn.Module"),
    ("--model", "usermodel_b", "expected 'package.module:name'"),
    ("--data", "usermodel_b:make", "must return (train, test)"),
    ("--loss", "usermodel_b:gone", "has no attribute 'gone'"),
])
def test_bad_references_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, flag, ref, message):
    _user_project(tmp_path, monkeypatch, "usermodel_b")
    assert main(["train", "run.toml", flag, ref, "--out", "r"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_earlier_run_is_never_written_over_without_asking(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--out", str(out)]) == 0
    before = {name: (out / name).read_bytes() for name in ("config.json", "metrics.jsonl", "checkpoint.ckpt")}
    capsys.readouterr()
    assert main(["train", "--epochs", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert {name: (out / name).read_bytes() for name in before} == before  # nothing touched
    (tmp_path / "file").write_text("x")
    assert main(["train", "--epochs", "1", "--out", str(tmp_path / "file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["train", "--epochs", "2", "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["epochs"] == 2
    assert json.loads((out / "report.json").read_text())["steps"] == 90


@pytest.mark.parametrize("keep", [[], ["--keep-last", "2"]])
def test_overwrite_removes_the_replaced_runs_checkpoints_before_the_new_run_starts(tmp_path, capsys, monkeypatch,
                                                                                    keep):
    """A new run that fails before its first save must not leave the replaced run's
    checkpoint behind: ``--resume`` then has nothing to continue, instead of the old
    weights under the new settings."""
    from leantrain.cli import train as cli_train

    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--out", str(out), *keep]) == 0

    def fails(plan, job, loggers):
        raise KeyboardInterrupt  # the new run dies before its first checkpoint

    monkeypatch.setattr(cli_train, "run_job", fails)
    with pytest.raises(KeyboardInterrupt):
        main(["train", "--epochs", "3", "--lr", "0.5", "--out", str(out), "--overwrite", *keep])
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # the old run's files are gone
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_overwrite_through_a_linked_checkpoint_folder_is_refused_with_nothing_deleted(tmp_path, capsys):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    assert main(["train", "--epochs", "1", "--out", str(out), "--keep-last", "1"]) == 0
    (out / "checkpoints").rename(elsewhere)
    (out / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()} | {p.name: p.read_bytes() for p in out.iterdir()
                                                                      if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--epochs", "1", "--out", str(out), "--overwrite", "--keep-last", "1"]) == 2
    err = capsys.readouterr().err
    assert "is a link" in err and len(err.strip().splitlines()) == 1
    after = {p.name: p.read_bytes() for p in elsewhere.iterdir()} | {p.name: p.read_bytes() for p in out.iterdir()
                                                                     if p.is_file()}
    assert after == before and (out / "checkpoints").is_symlink()


def test_max_steps_and_a_warm_up_over_updates(tmp_path, capsys):
    """``--max-steps`` stops mid-epoch (45 updates an epoch); ``--schedule-per step``
    indexes upstream's warm-up cosine by update, so ``--warmup 4`` warms up over 4 updates."""
    out = tmp_path / "run"
    args = ["train", "--preset", "digits-mlp", "--epochs", "2", "--out", str(out), "--log-every", "1",
            "--max-steps", "10", "--scheduler", "warmup_cosine", "--schedule-per", "step", "--warmup", "4"]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 10
    rates = [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert len(rates) == 10 and rates[0] < rates[1] < rates[2] < rates[3] and rates[3] >= rates[4] > rates[9]
    assert json.loads((out / "config.json").read_text())["max_steps"] == 10
    assert main(["train", "--resume", str(out), "--max-steps", "12"]) == 0
    assert json.loads((out / "report.json").read_text())["steps"] == 12


def test_every_optimizer_of_the_table_trains_from_the_command(tmp_path, capsys):
    """The command's --optimizer choices and --weight-decay rule come from the rules' records."""
    from leantrain import optim
    from leantrain.cli.runconfig import DECAYING

    assert set(DECAYING) == {kind for kind, h in optim.HYPERS.items() if "weight_decay" in h.__dataclass_fields__}
    assert {"sgd", "adam", "adamw", "lion", "muon"} <= set(DECAYING) and "rprop" not in DECAYING
    for kind in optim.OPTIMIZERS:
        extra = ["--weight-decay", "0.1"] if kind in DECAYING else []
        out = tmp_path / kind
        assert main(["train", "--optimizer", kind, "--lr", "0.001", "--epochs", "1", "--out", str(out)] + extra) == 0
        assert json.loads((out / "report.json").read_text())["steps"] == 45
    assert main(["train", "--optimizer", "rprop", "--weight-decay", "0.1", "--out", str(tmp_path / "x")]) == 2
    assert "--weight-decay: only " in capsys.readouterr().err


def test_one_table_makes_the_flags_the_toml_keys_and_the_config():
    """Every setting is one row of runconfig.FIELDS: its flag on the subcommands that take
    it, its TOML key, its RunConfig field and default, its check."""
    import argparse

    from leantrain.cli.main import build_parser
    from leantrain.cli.runconfig import FIELDS, RunConfig
    from leantrain.errors import ConfigError

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, extra in (("train", {"--overwrite", "--resume"}), ("check", {"--max-ratio", "--json"})):
        flags = {s for a in sub.choices[command]._actions for s in a.option_strings if s.startswith("--")}
        assert flags - {"--help"} == {f.flag for f in FIELDS if command in f.commands} | extra, command
    assert [f.name for f in dataclasses.fields(RunConfig)] == [f.name for f in FIELDS]
    assert RunConfig().to_dict() == {f.name: f.default for f in FIELDS}
    assert RunConfig.known_keys() == {f.name for f in FIELDS}
    for f in FIELDS:  # each row's check refuses a value of the wrong kind, naming the flag
        with pytest.raises(ConfigError, match=f"^{f.flag}: "):
            RunConfig(**{f.name: [1]})


def test_the_command_checks_the_model_once_per_loop(tmp_path, monkeypatch):
    """The command's callbacks all read only, and its evaluations use the ready metrics:
    the optimizer's layout is built once in a whole run (three epochs, evaluated after each)."""
    from leantrain.cli import train as cli_train
    from leantrain.cli.main import build_parser

    jobs = []
    real = cli_train.build_job
    monkeypatch.setattr(cli_train, "build_job", lambda plan: jobs.append(real(plan)) or jobs[-1])
    args = build_parser().parse_args(["train", "--preset", "digits-cnn", "--epochs", "3", "--log-every", "2",
                                      "--checkpoint-every", "10", "--out", str(tmp_path / "r")])
    assert cli_train.cmd_train(args) == 0
    stats = jobs[0].runner.stats
    # one layout; bindings: the loss before, the loop (no tie in the CNN: reused by every step and
    # evaluation), the loss after, the report's evaluation
    assert stats.layouts == 1 and stats.bindings == 4, stats
    records = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1, 2]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [45, 90, 135]


def test_the_command_takes_every_optimizer_option_and_schedule(tmp_path, capsys):
    """--optimizer-args (torch's names) and --scheduler/--scheduler-args, from flags and
    from the TOML file; a key the optimizer does not take is a one-line error."""
    from leantrain.cli.runconfig import SCHEDULERS

    base = ["train", "--preset", "digits-mlp", "--epochs", "2", "--max-steps", "6"]
    out = tmp_path / "sgd"
    assert main(base + ["--optimizer", "sgd", "--optimizer-args", "momentum = 0.9, nesterov = true",
                        "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["optimizer_args"] == {"momentum": 0.9, "nesterov": True}
    for name in SCHEDULERS:
        extra = {"plateau": ["--scheduler-args", "patience = 0"],
                 "cosine_with_min_lr": ["--scheduler-args", "min_lr = 1e-5"],
                 "cosine_warmup_with_min_lr": ["--scheduler-args", "min_lr_rate = 0.1"]}.get(name, [])
        assert main(base + ["--scheduler", name, "--schedule-per", "step", "--out", str(tmp_path / name)] + extra) == 0
    toml = tmp_path / "run.toml"
    toml.write_text('optimizer = "radam"\noptimizer_args = {betas = [0.9, 0.95], decoupled_weight_decay = true}\n'
                    'scheduler = "multi_step"\nscheduler_args = {milestones = [2, 4], gamma = 0.5}\n'
                    'schedule_per = "step"\n')  # over one epoch a schedule by epoch would never move (refused)
    assert main(["train", str(toml), "--epochs", "1", "--max-steps", "5", "--out", str(tmp_path / "t")]) == 0
    capsys.readouterr()
    assert main(base + ["--optimizer", "adam", "--optimizer-args", "momentum = 0.9", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--optimizer-args: optim.adam: unknown argument 'momentum'" in err and err.count("\n") == 1


def test_export_of_a_hugging_face_run_is_a_folder_from_pretrained_loads(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from hf_export_model import tiny
    from leantrain.cli.runconfig import RunConfig

    run = tmp_path / "run"
    run.mkdir()
    model = tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # "trained": not the factory's values
    runner = lt.Runner.from_module(model, "model")
    lt.save_checkpoint(run / "checkpoint.ckpt", runner, rng=False)
    (run / "config.json").write_text(json.dumps(RunConfig.build(None, {"model": "hf_export_model:tiny"}).to_dict()))
    out = tmp_path / "exported"
    assert main(["export", str(run), "--weights", "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # the tie kept
    theirs = loaded.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in model.state_dict().items())
    (tmp_path / "file").write_text("x")
    assert main(["export", str(run), "--weights", "-o", str(tmp_path / "file")]) == 2
    assert "a Hugging Face run exports a folder" in capsys.readouterr().err


def test_export_imports_and_calls_nothing_a_file_names(tmp_path, monkeypatch, capsys):
    """A run folder's config.json naming ``pkg.mod:fn`` (with the current folder first on
    sys.path) is data to export: the module is never imported. The Hugging Face config
    comes from the checkpoint, or from --config."""
    import sys

    (tmp_path / "evilmod.py").write_text("import pathlib\npathlib.Path('IMPORTED').write_text('x')\n"
                                         "def fn():\n    pathlib.Path('CALLED').write_text('x')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    run.mkdir()
    lt.save_checkpoint(run / "checkpoint.ckpt", lt.Runner.from_module(torch.nn.Linear(2, 2)), rng=False)
    (run / "config.json").write_text(json.dumps({"model": "evilmod:fn"}))
    assert main(["export", str(run), "--weights", "-o", str(tmp_path / "w.safetensors")]) == 0
    assert not (tmp_path / "IMPORTED").exists() and not (tmp_path / "CALLED").exists()
    assert "evilmod" not in sys.modules
    assert set(lt.weights.export_state_dict(lt.Runner.from_module(torch.nn.Linear(2, 2)))) == set(
        __import__("safetensors.torch").torch.load_file(str(tmp_path / "w.safetensors")))
    # an explicit config.json: a folder from_pretrained loads (data copied, nothing called)
    (tmp_path / "hf.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 4}))
    assert main(["export", str(run), "--weights", "--config", str(tmp_path / "hf.json"), "-o", str(tmp_path / "f")]) == 0
    assert json.loads((tmp_path / "f" / "config.json").read_text()) == {"model_type": "gpt2", "n_embd": 4}
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["export", str(run), "--weights", "--config", str(tmp_path / "bad.json"), "-o", str(tmp_path / "g")]) == 2
    assert "not a JSON object" in capsys.readouterr().err and not (tmp_path / "g").exists()


def test_export_of_a_kept_run_takes_its_best_or_the_update_asked_and_a_hugging_face_folder(tmp_path, capsys):
    """A run keeping a folder of checkpoints exports its best (--keep-best), or --step N's;
    each kept file keeps the model's config, so the export is a from_pretrained folder."""
    transformers = pytest.importorskip("transformers")
    from hf_export_model import tiny

    run = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": t[None], "labels": t[None]} for t in torch.randint(0, 50, (12, 8), generator=g)]
    model = tiny()
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.adamw(0.05), log_every=0, eval_data=samples[:4],
                               eval_every=1, checkpoint_path=run / "checkpoints" / "step{step}.ckpt", keep_best=1,
                               keep_last=1, mode="max")  # the highest loss: an early update, not the newest
    report, _ = lt.train_loader(lt.Runner.from_module(model, "model"), cfg, lt.DataLoader(samples, batch_size=2))
    (run / "config.json").write_text(json.dumps({"keep_best": "loss:max", "model": "hf_export_model:tiny"}))
    best = report.best_checkpoint
    assert best != str(run / "checkpoints" / "step6.ckpt"), "the test wants a best that is not the newest"
    out = tmp_path / "best"
    assert main(["export", str(run), "--weights", "-o", str(out)]) == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    want = lt.Runner.from_module(tiny(), "model")
    lt.load_checkpoint(best, want)
    assert all(torch.equal(t, loaded.state_dict()[k]) for k, t in want.module.state_dict().items())
    assert main(["export", str(run), "--weights", "--step", "6", "-o", str(tmp_path / "last")]) == 0
    lt.load_checkpoint(run / "checkpoints" / "step6.ckpt", want)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "last")
    assert all(torch.equal(t, loaded.state_dict()[k]) for k, t in want.module.state_dict().items())
    capsys.readouterr()
    gone = next(n for n in range(1, 7) if not (run / "checkpoints" / f"step{n}.ckpt").exists())
    assert main(["export", str(run), "--weights", "--step", str(gone), "-o", str(tmp_path / "x")]) == 2
    assert f"--step {gone}:" in capsys.readouterr().err and not (tmp_path / "x").exists()


TOKEN_MODEL = '''
import torch

class Tiny(torch.nn.Module):
    def __init__(self, mean=True):
        super().__init__()
        self.emb, self.mean = torch.nn.Embedding(20, 8), mean
        self.head = torch.nn.Linear(8, 20)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1), ignore_index=-100,
                                                 reduction="mean" if self.mean else "sum")
        if not self.mean:
            import leantrain
            loss = leantrain.LossSum(loss, (labels != -100).sum())
        return {"logits": logits, "loss": loss}

def mean():
    return Tiny(True)

def summed():
    return Tiny(False)

def data():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 20, (int(n),), generator=g) for n in torch.randint(3, 9, (24,), generator=g)]
    samples = [{"input_ids": r, "labels": r} for r in rows]
    return samples[:16], samples[16:]
'''


@pytest.mark.parametrize("model, loss, refused", [("mean", None, True), ("mean", "model", True),
                                                  ("mean", "model_mean", False), ("summed", None, False)])
def test_a_token_mean_loss_that_would_train_another_objective_under_torchrun_is_refused(tmp_path, monkeypatch,
                                                                                          model, loss, refused):
    """Under torchrun each rank pads its own piece: a model loss that is its piece's token
    mean trains the mean of the pieces' means; the command refuses it (naming LossSum)
    unless the model's loss is a LossSum or --loss model_mean asks for that objective.
    Decided in build_job, before anything is written (world given as torchrun would)."""
    from leantrain.cli.runconfig import RunConfig
    from leantrain.cli.train import Plan, build_job
    from leantrain.cli.usage import UserError

    (tmp_path / "tokmodel.py").write_text(TOKEN_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RunConfig.build(None, {"model": f"tokmodel:{model}", "data": "tokmodel:data", "loss": loss,
                                 "out": str(tmp_path / "run"), "batch_size": 8})
    plan = Plan(cfg, False, 2, True, 0)
    if refused:
        with pytest.raises(UserError, match="LossSum.*--loss model_mean"):
            build_job(plan)
    else:
        build_job(plan)
    assert not (tmp_path / "run").exists()
    build_job(Plan(cfg, False, 1, True, 0))  # one process trains what it asks for


def test_a_per_update_schedule_is_checked_over_the_runs_updates(tmp_path, capsys):
    """#70: ``--scheduler polynomial --epochs 1 --max-steps 6 --warmup 2 --schedule-per step``
    was refused as if an epoch had one update, blaming ``--scheduler-args``; it trains
    with transformers' rates. Per epoch (1 epoch, 2 warm-up epochs) it is refused, naming
    ``--scheduler``, the horizon and ``--schedule-per step``."""
    transformers = pytest.importorskip("transformers")
    base = ["train", "--scheduler", "polynomial", "--epochs", "1", "--max-steps", "6", "--warmup", "2",
            "--log-every", "1"]
    assert main([*base, "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --scheduler: optim.polynomial: total_steps (1) must exceed warmup_steps (2)")
    assert "--schedule-per step indexes updates" in err and "--scheduler-args" not in err
    assert main([*base, "--schedule-per", "step", "--out", str(tmp_path / "s")]) == 0
    rates = [r["lr"] for r in map(json.loads, (tmp_path / "s" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.002)
    sched = transformers.get_polynomial_decay_schedule_with_warmup(opt, 2, 6)
    theirs = []
    for _ in range(6):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates == theirs
