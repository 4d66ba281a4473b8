"""Bad input to the command: one line on stderr and exit status 2, never a traceback, and
the user's files left alone: one table, then TOML shapes, seeds, folders, damaged run
files, plot inputs and outputs, inspect on folders and on forged names."""

import json
import shutil

import pytest
import torch

import leantrain as lt
from leantrain.cli import main
from inputs_table import CliError, check_row, cli, ids, truncated

COMMAND = [
    ("cli bad flag value", lambda c: cli("train", "--batch-size", "x"), CliError, "argument --batch-size: expected a natural number"),
    ("cli unknown preset", lambda c: cli("train", "--preset", "resnet"), CliError, "--preset: expected one of"),
    ("cli unknown flag", lambda c: cli("inspect", str(c.ckpt), "--all"), CliError, "unrecognized arguments: --all"),
    ("cli corrupt file", lambda c: cli("inspect", str(truncated(c))), CliError, "not a readable checkpoint"),
    ("cli optimizer args nested deep", lambda c: cli("train", "--optimizer-args", "momentum = " + "[" * 3000 + "1" + "]" * 3000,
                                                     "--out", str(c.folder / "deep")), CliError, "nested too deep to read"),
]


@pytest.mark.parametrize("name, call, error, pattern", COMMAND, ids=ids(COMMAND))
def test_command_rejects_and_changes_nothing(name, call, error, pattern, tmp_path):
    check_row(call, error, pattern, tmp_path)


PNG = b"\x89PNG\r\n\x1a\n"


def one_line_error(capsys, code, *needles):
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished one-epoch run with a mid-run checkpoint (copied by each test)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", "--epochs", "1", "--out", str(out), "--checkpoint-every", "20", "--log-every", "5"]) == 0
    return out


@pytest.mark.parametrize("toml, needle", [
    ("train = 5\n", "'train' must be a table"),
    ('train = ["epochs"]\n', "'train' must be a table"),
    ('preset = ["digits-mlp"]\n', "--preset: expected one of"),
    ('[optimizer]\nkind = "adam"\n', "--optimizer: expected one of"),
    ('scheduler = {a = 1}\n', "--scheduler: expected one of"),
    ('device = ["cpu"]\n', "--device: expected one of"),
    ('loss = ["mse"]\n', "--loss: expected"),
    ('epochs = "3"\n', "--epochs: expected an integer"),
    ('lr = inf\n', "--lr: expected a finite number"),
    ('seed = -1\n', "--seed: expected an integer >= 0"),
    ('[train]\nepochs = 1\nnope = 2\n', "unknown key(s) nope"),
    ('epochs = \n', "not a valid TOML file"),
    ("x = " + "[" * 3000 + "1" + "]" * 3000 + "\n", "nested too deep"),
    ("a = {b = " + "[" * 3000 + "1" + "]" * 3000 + "}\n", "nested too deep"),
    ('compile = "yes"\n', "--compile: expected true or false"),
])
def test_toml_of_the_wrong_shape(tmp_path, capsys, toml, needle):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    one_line_error(capsys, main(["train", str(path), "--out", str(tmp_path / "o")]), needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("seed", ["18446744073709551616", "99999999999999999999999"])
def test_a_seed_past_64_bits(tmp_path, capsys, seed):
    one_line_error(capsys, main(["train", "--seed", seed, "--out", str(tmp_path / "o")]), "--seed", "2**64")


def test_out_that_cannot_be_a_folder(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    one_line_error(capsys, main(["train", "--epochs", "1", "--out", str(tmp_path / "afile")]), "is a file")
    one_line_error(capsys, main(["train", "--epochs", "1", "--out", str(tmp_path / "afile" / "x")]),
                   "--out", "cannot create the folder")
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("config, needle", [
    ("{broken", "config.json is not valid JSON"),
    ("[1, 2]", "not a JSON object of settings"),
    ('"digits"', "not a JSON object of settings"),
    ('{"epochs": 1, "colour": "red"}', "unknown key(s) 'colour'"),
    ('{"batch_size": [1]}', "--batch-size: expected an integer"),
    ("\xff\xfe", "config.json is not valid JSON"),
])
def test_resume_with_a_damaged_config(tmp_path, capsys, run, config, needle):
    folder = tmp_path / "r"
    shutil.copytree(run, folder)
    (folder / "config.json").write_text(config, errors="surrogateescape")
    metrics = (folder / "metrics.jsonl").read_bytes()
    one_line_error(capsys, main(["train", "--resume", str(folder), "--epochs", "2"]), needle)
    assert (folder / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize("torn", ['{"kind": "step", "st', '{"kind', "\x00\x00"])
def test_resume_over_a_torn_last_metrics_line(tmp_path, capsys, run, torn):
    folder = tmp_path / "r"
    shutil.copytree(run, folder)
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(torn)
    assert main(["train", "--resume", str(folder), "--epochs", "2"]) == 0
    records = [json.loads(ln) for ln in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]


def test_resume_over_a_damaged_middle_line_is_refused(tmp_path, capsys, run):
    folder = tmp_path / "r"
    shutil.copytree(run, folder)
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    lines[1] = "{not json"
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = (folder / "metrics.jsonl").read_bytes()
    one_line_error(capsys, main(["train", "--resume", str(folder), "--epochs", "2"]), "line 2 is not a JSON record")
    assert (folder / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("content, needle", [
    ('{"kind": "step"}\n', "line 1: a 'step' record without 'step', 'loss'"),
    ('{"kind": "meta", "format": 2, "step": 0}\n{"kind": "epoch"}\n', "line 2: a 'epoch' record without 'epoch'"),
    ('{"kind": "step", "step": 1, "loss": 2.0}\n{"kind": "epoch", "step": 1}\n', "line 2: a 'epoch' record without"),
    ('{"kind": "step", "step": 1}\n', "line 1: a 'step' record without 'loss'"),
    ('{"kind": "eval", "step": "x", "loss": 1}\n', "expected numbers"),
    ('{"kind": "step", "step": "a", "loss": "b"}\n', "expected numbers"),
    ('{"kind": "step", "step": 1, "loss": null}\n', "expected numbers"),
    ('{"kind": "epoch", "epoch": null, "test_accuracy": 1}\n', "expected numbers"),
    ('{"kind": "epoch", "epoch": 0, "test_accuracy": [1]}\n', "expected numbers"),
    ("[1, 2]\n", "line 1 is not a JSON object"),
    ("not json\n", "line 1 is not JSON"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "not a text file"),
    ('{"kind": "step", "step": 1%s, "loss": 1}\n' % ("0" * 400), "expected a count below 2**53"),
    ('{"kind": "epoch", "epoch": 1e308, "test_accuracy": 1}\n', "expected a count below 2**53"),
    ('{"kind": "step", "step": 2.5, "loss": 1}\n', "expected a count below 2**53"),
    ('{"kind": "step", "step": 1, "loss": 1%s}\n' % ("0" * 400), "expected a float"),
])
def test_plot_on_records_it_cannot_draw(tmp_path, capsys, content, needle):
    path = tmp_path / "m.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    one_line_error(capsys, main(["plot", str(path), "-o", str(tmp_path / "p.png")]), needle)
    assert not (tmp_path / "p.png").exists()


def test_plot_inputs_and_outputs(tmp_path, capsys, run):
    one_line_error(capsys, main(["plot", str(tmp_path), "-o", str(tmp_path / "p.png")]), "without metrics.jsonl")
    one_line_error(capsys, main(["plot", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "p.png")]),
                   "no such metrics file")
    one_line_error(capsys, main(["plot", str(run), "-o", str(tmp_path / "x.txt")]), "expected a .png, .svg, .pdf")
    (tmp_path / "d").mkdir()
    one_line_error(capsys, main(["plot", str(run), "-o", str(tmp_path / "d")]), "is a folder")
    assert main(["plot", str(run), "-o", str(tmp_path / "plain")]) == 0  # a run folder; no suffix: .png
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'plain.png'}"
    assert (tmp_path / "plain.png").read_bytes()[:8] == PNG
    assert main(["plot", str(run / "metrics.jsonl"), "-o", str(tmp_path / "p.svg")]) == 0
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


def test_inspect_a_run_folder_and_a_folder_without_one(tmp_path, capsys, run):
    assert main(["inspect", str(run)]) == 0
    assert "integrity: OK" in capsys.readouterr().out
    one_line_error(capsys, main(["inspect", str(tmp_path)]), "a folder without index.json: not a checkpoint")


@pytest.mark.parametrize("name", ["evil\n   9  forged.weight  (1,)  float32  yes  self",
                                  "\x1b[2J\x1b[31mred", "bell\x07tab\tcr\r", "nul\x00end"])
def test_inspect_escapes_names_from_the_file(tmp_path, capsys, name):
    params = lt.ParamList([lt.Param(torch.ones(1), name=name), lt.Param(torch.zeros(2), name="b")])
    path = tmp_path / "n.ckpt"
    lt.save_checkpoint(path, params, rng=False)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\r\x00\t")
    assert len(out.splitlines()) == 8  # file, integrity, titles, 2 slots, summary, optimizer, progress
    assert name.encode("unicode_escape").decode("ascii")[:4] in out


def test_the_everyday_features_from_the_command(tmp_path, capsys):
    out = tmp_path / "all"
    args = ["train", "--epochs", "1", "--accumulate", "2", "--clip-grad-norm", "0.5", "--ema", "0.9",
            "--precision", "bf16", "--optimizer", "adamw", "--weight-decay", "0.1", "--decay-matrices-only",
            "--checkpoint-every", "10", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "with the moving average (decay 0.9)" in text and "precision bf16" in text
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 23 and 0 <= report["test_accuracy_ema"] <= 1  # 45 batches, 2 per update
    steps = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("grad_norm" in r for r in steps if r["kind"] == "step")
    manifest = lt.read_checkpoint(out / "checkpoint.ckpt")[0]
    assert manifest["ema"]["decay"] == 0.9 and manifest["optimizer"]["per_slot"]
    assert manifest["progress"]["autocast"] == "bfloat16" and manifest["progress"]["accumulate"] == 2
    assert main(["train", "--resume", str(out), "--epochs", "2"]) == 0
    assert json.loads((out / "report.json").read_text())["steps"] == 46
    assert main(["export", str(out), "--weights", "--ema", "-o", str(tmp_path / "ema.safetensors")]) == 0
    one_line_error(capsys, main(["train", "--decay-matrices-only", "--out", str(tmp_path / "x")]),
                   "--decay-matrices-only: needs --weight-decay")


@pytest.mark.slow  # compiles the preset's model (seconds)
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="Inductor needs a C++ compiler")
def test_the_command_trains_with_a_compiled_step(tmp_path):
    out = tmp_path / "compiled"
    assert main(["train", "--epochs", "1", "--compile", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["compile"] is True
    assert 0.5 < json.loads((out / "report.json").read_text())["test_accuracy"] <= 1


USER_FILES = {
    "exits.py": "import sys\nsys.exit(3)\n",
    "frozen.py": ("import torch\n\ndef make():\n    m = torch.nn.Linear(64, 10)\n    m.requires_grad_(False)\n"
                  "    return m\n"),
    "ragged.py": ("import torch\n\ndef data():\n    g = torch.Generator().manual_seed(0)\n"
                  "    train = [(torch.randn(64 + (i == 3), generator=g), torch.tensor(i % 10)) for i in range(20)]\n"
                  "    return train, train[:4]\n"),
}


@pytest.mark.parametrize("args, needles", [
    (["--model", "exits:make"], ["--model exits:make", "called sys.exit(3)"]),
    (["--model", "frozen:make"], ["--model frozen:make", "no trainable parameter"]),
    (["--data", "ragged:data"], ["--data ragged:data", "train sample 3 has x (65,)", "need one shape"]),
])
def test_user_code_that_cannot_train_is_one_line(tmp_path, capsys, monkeypatch, args, needles):
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, main(["train", *args, "--epochs", "1", "--out", str(tmp_path / "o")]), *needles)
    assert not (tmp_path / "o").exists()


def test_quickstart_with_a_seed_past_64_bits(capsys):
    one_line_error(capsys, main(["quickstart-mlp", "--seed", str(10**23)]), "--seed", "below 2**64")
