"""leantrain.check: every check passes on zoo models, and each fails, with its own line,
on a case built to break exactly that guarantee. The speed check's limit is set out of
reach of noise in the passing runs (no test asserts a wall-clock time)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leantrain as lt
from leantrain.check import check
from leantrain.cli import main

sys.path.insert(0, str(Path(__file__).parent / "zoo"))
from zoo_models import BY_NAME  # noqa: E402
from optimizer_table import TABLE, HandLion  # noqa: E402

CFG = lt.TrainConfig(steps=4, batch_size=2, optimizer=lt.optim.adam(0.01))


def regression(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("name", ["gpt", "cnn_batchnorm"])
def test_every_check_passes_on_zoo_models(name):
    entry = BY_NAME[name]
    report = check(lambda: lt.Runner.from_module(entry.build(), entry.loss), entry.samples(8), CFG, max_ratio=100)
    assert report.passed, "\n".join(report.lines())
    assert [r.name for r in report.results] == ["gradients", "optimizer", "accumulation", "exact resume",
                                                "determinism", "module intact", "host syncs", "speed"]
    assert "bit-identical" in report["exact resume"].figure and "bit-identical" in report["determinism"].figure
    assert report["host syncs"].figure.startswith("0 device-to-host reads per step")


def test_an_optimizer_torch_lacks_skips_the_comparisons_and_passes_the_rest(tmp_path, capsys):
    """Lion has no torch.optim equivalent: the two checks that compare against one say so
    (SKIP, not a failure) and the other six run as for any optimizer."""
    entry = BY_NAME["gpt"]
    cfg = lt.TrainConfig(steps=4, batch_size=2, optimizer=lt.optim.lion(1e-3, weight_decay=0.1))
    report = check(lambda: lt.Runner.from_module(entry.build(), entry.loss), entry.samples(8), cfg, max_ratio=100)
    assert report.passed, "\n".join(report.lines())
    skipped = [r.name for r in report.results if r.skipped]
    assert skipped == ["optimizer", "speed"]
    assert report["optimizer"].line().startswith("SKIP  optimizer") and "no torch.optim equivalent" in \
        report["optimizer"].figure
    assert "bit-identical" in report["exact resume"].figure
    assert main(["check", "--optimizer", "lion", "--lr", "0.001", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "SKIP  optimizer" in out and "PASS  gradients" in out
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is True


def failing(report, name):
    result = report[name]
    assert not result.passed, result.line()
    assert result.line().startswith(f"FAIL  {name}")
    return result.figure


def test_a_stateful_loss_fails_the_gradient_check():
    calls = [0]

    def drifting(out, y):  # its value depends on how often it was called
        calls[0] += 1
        return F.mse_loss(out, y) * calls[0]

    report = check(lambda: lt.Runner.from_module(nn.Linear(4, 2), drifting), regression(), CFG, only=("gradients",))
    assert "max relative difference" in failing(report, "gradients")


def test_a_broken_update_rule_fails_the_optimizer_check(monkeypatch):
    from leantrain.optim import rules

    real = rules.SGDRule.update_many

    def doubled(h, lr, ss, ps, gs, **kw):  # an injected fault: twice the step
        return real(h, 2 * lr, ss, ps, gs, **kw)

    monkeypatch.setattr(rules.SGDRule, "update_many", staticmethod(doubled))
    cfg = lt.TrainConfig(steps=4, batch_size=2, optimizer=lt.optim.sgd(0.1))
    report = check(lambda: lt.Runner.from_module(nn.Linear(4, 2), "mse"), regression(), cfg, only=("optimizer",))
    assert "3 steps of sgd vs torch.optim" in failing(report, "optimizer")


class Counting(nn.Module):
    """Hidden Python state: every forward scales its output by a growing factor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (1 + 0.1 * self.calls)


def test_hidden_state_fails_the_accumulation_check():
    report = check(lambda: lt.Runner.from_module(Counting(), "mse"), regression(), CFG, only=("accumulation",))
    assert "list batch of 2 vs the mean of 2 single items" in failing(report, "accumulation")


class UnsavedScale(nn.Module):
    """A running scale kept in a Python float, not a buffer: no checkpoint can hold it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.scale = 1.0

    def forward(self, x):
        if self.training:
            self.scale *= 1.05
        return self.lin(x) * self.scale


def test_state_outside_buffers_fails_the_exact_resume_check():
    report = check(lambda: lt.Runner.from_module(UnsavedScale(), "mse"), regression(), CFG,
                   only=("exact resume", "determinism"))
    assert "first differing slot 0 ('lin.weight')" in failing(report, "exact resume")
    assert report["determinism"].passed  # the same run twice is still the same


OUTSIDE = torch.Generator().manual_seed(0)  # seeded once here; the check's seeding never reaches it


class OutsideRandom(nn.Module):
    """Draws from a generator the run does not own: the second run draws other numbers."""

    def __init__(self):
        super().__init__()
        self.noisy = nn.Linear(4, 2)

    def forward(self, x):
        return self.noisy(x) * (1 + torch.rand((), generator=OUTSIDE))


def test_unseeded_randomness_fails_the_determinism_check_and_names_the_module():
    report = check(lambda: lt.Runner.from_module(OutsideRandom(), "mse"), regression(), CFG, only=("determinism",))
    assert "module 'noisy'" in failing(report, "determinism")


class GrowsAParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        if not hasattr(self, "late"):
            self.late = nn.Parameter(torch.zeros(2))
        return self.lin(x) + self.late


def test_a_module_that_changes_itself_fails_the_intact_check():
    report = check(lambda: lt.Runner.from_module(GrowsAParameter(), "mse"), regression(), CFG, only=("module intact",))
    assert "parameter objects" in failing(report, "module intact")


def test_a_loss_that_reads_the_host_fails_the_sync_check():
    def chatty(out, y):
        loss = F.mse_loss(out, y)
        _ = loss.item()  # a hidden device-to-host read
        return loss

    report = check(lambda: lt.Runner.from_module(nn.Linear(4, 2), chatty), regression(), CFG, only=("host syncs",))
    assert failing(report, "host syncs").startswith("2 device-to-host reads per step")  # one per item, 2 per update


def test_the_speed_check_fails_beyond_its_limit():
    report = check(lambda: lt.Runner.from_module(nn.Linear(4, 2), "mse"), regression(), CFG, only=("speed",), max_ratio=0.0)
    assert "a hand-written torch.optim loop" in failing(report, "speed")


def test_a_factory_that_gives_no_runner_is_a_user_error_not_a_failed_check():
    with pytest.raises(lt.ConfigError, match="runner_factory returned a str, expected a Runner"):
        check(lambda: "not a runner", regression(), CFG, only=("gradients",))
    with pytest.raises(lt.ConfigError, match="unknown check"):
        check(lambda: None, regression(), CFG, only=("nope",))


def test_the_command_checks_a_preset_and_writes_json(tmp_path, capsys):
    assert main(["check", "--preset", "digits-cnn", "--max-ratio", "100", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("leantrain check: digits-cnn") and len(out) == 9
    assert all(line.startswith("PASS") for line in out[1:])
    assert "in a fresh process: bit-identical" in out[4]  # the command's factory travels to a spawned process
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["passed"] and len(doc["checks"]) == 8


def test_the_command_exits_1_on_a_failed_check_and_2_on_a_user_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkmodel.py").write_text(
        "import torch\nfrom torch import nn\nOUTSIDE = torch.Generator().manual_seed(0)\n"
        "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(64, 10)\n"
        "    def forward(self, x):\n        return self.lin(x.flatten(1)) * (1 + torch.rand((), generator=OUTSIDE))\n"
        "def make():\n    return M()\n")
    assert main(["check", "--model", "checkmodel:make", "--max-ratio", "100"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  determinism" in out and "module 'lin'" in out
    assert main(["check", "--model", "checkmodel:nothing"]) == 2
    assert "has no attribute 'nothing'" in capsys.readouterr().err


def test_a_per_slot_optimizer_is_checked_against_torch_parameter_groups():
    from leantrain import optim
    from leantrain.check import check as run_check
    from models import TiedNet, regression_batches

    opt = optim.adamw(0.01, 0.1).per_slot(lambda p: {"weight_decay": 0.0, "lr_scale": 0.5} if len(p.shape) < 2 else {})
    report = run_check(lambda: lt.Runner.from_module(TiedNet(bn=False), "mse"), regression_batches(8, 3),
                       lt.TrainConfig(steps=4, batch_size=2, optimizer=opt, log_every=0), only=("optimizer",))
    assert report.passed, report.lines()


@pytest.mark.parametrize("make, match", [
    (lambda: lt.Runner.from_module(torch.nn.Linear(4, 6).requires_grad_(False), "mse"), "no trainable parameter"),
    (lambda: lt.Runner.from_module(torch.nn.Linear(4, 6), lambda out, y: (out - y).detach().pow(2).mean()),
     "the loss carries no gradient"),
])
def test_user_errors_are_errors_not_failed_guarantees(make, match):
    from leantrain.check import check as run_check
    from models import regression_batches

    with pytest.raises(lt.ConfigError, match=match):
        run_check(make, regression_batches(8, 3), lt.TrainConfig(steps=4, batch_size=2, log_every=0))


def token_sum(out, y):
    """A token-weighted loss: the summed error over the item's valid positions (y != 0)."""
    mask = y != 0
    return lt.LossSum(((out - y) ** 2 * mask).sum(), mask.sum())


def test_a_token_weighted_loss_passes_the_accumulation_check_and_a_wrong_weighting_fails():
    g = torch.Generator().manual_seed(3)
    samples = []
    for k in range(8):
        y = torch.randn(4, generator=g)
        y[: k % 4] = 0.0  # items with 4, 3, 2 and 1 valid positions
        samples.append((torch.randn(3, generator=g), y))
    report = check(lambda: lt.Runner.from_module(nn.Linear(3, 4), token_sum), samples, CFG, only=("accumulation",))
    result = report["accumulation"]
    assert result.passed, result.line()
    assert "vs the token-weighted mean of 2 single items" in result.figure
    # the weighting matters here: the plain mean of the items' gradients is not the batch's
    torch.manual_seed(0)
    r = lt.Runner.from_module(nn.Linear(3, 4), token_sum)
    together = lt.mean_gradients(r, samples[:2])[0]
    plain = (lt.mean_gradients(r, samples[:1])[0] + lt.mean_gradients(r, samples[1:2])[0]) / 2
    assert (together - plain).abs().max() > 1e-3


@pytest.mark.parametrize("kind", sorted(TABLE))
def test_every_optimizer_of_the_table_passes_the_optimizer_and_host_sync_checks(kind):
    """check compares each optimizer with its torch counterpart (bit for bit here) and finds
    no hidden device read (torch's host step counters are not device reads; Adafactor's
    norms are its torch form's, declared and reported)."""
    report = check(lambda: lt.Runner.from_module(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)), "mse"),
                   regression(), lt.TrainConfig(steps=4, batch_size=2, optimizer=TABLE[kind].make()),
                   only=("optimizer", "host syncs"))
    assert report["host syncs"].passed, report["host syncs"].line()
    assert report["optimizer"].passed is not False, report["optimizer"].line()
    if TABLE[kind].torch()[0] is not HandLion:
        assert "bit-identical" in report["optimizer"].figure, report["optimizer"].line()
