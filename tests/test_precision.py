"""Mixed precision against plain PyTorch: ``autocast="bfloat16"`` is the loop a user
writes under ``torch.autocast``; ``"float16"`` is that loop with ``torch.amp.GradScaler``
(scale, unscale, skip on overflow, back off, grow), bit for bit, the scale saved and
resumed; the command's ``--precision``."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import leantrain as lt
from leantrain import optim
from leantrain.cli import main

sys.path.insert(0, str(Path(__file__).parent / "zoo"))
from zoo_models import ZOO  # noqa: E402


def torch_loop(model, entry, samples, dtype, scaler=None, lr=0.1):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for x, y in samples:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = entry.loss_fn()(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


ENTRIES = [e for e in ZOO if e.name in ("gpt", "cnn_batchnorm", "shared_twice", "frozen_backbone", "padded_embedding")]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_bfloat16_is_the_autocast_loop(entry):
    model = entry.model()
    ref = copy.deepcopy(model)
    samples = entry.samples(3)
    r = lt.Runner.from_module(model, entry.loss)
    torch.manual_seed(2)
    lt.train_samples(r, lt.TrainConfig(steps=3, batch_size=1, optimizer=optim.sgd(0.1), log_every=0,
                                       autocast="bfloat16"), samples)
    torch.manual_seed(2)
    torch_loop(ref, entry, samples, torch.bfloat16)
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        if entry.tied:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b), k
    assert r.loop.amp is None and r.loop.loss_scale is None  # only for the loop
    for p in model.parameters():
        assert p.dtype == torch.float32


class Big(torch.nn.Module):
    """Outputs large enough that the float16 scaled backward overflows at first."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) * 300.0


def big_samples(n):
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(n)]


class BigEntry:
    @staticmethod
    def loss_fn():
        return F.mse_loss


def test_float16_is_the_grad_scaler_loop_with_skips_and_backoff():
    torch.manual_seed(0)
    model = Big()
    ref = copy.deepcopy(model)
    samples = big_samples(6)
    r = lt.Runner.from_module(model, "mse")
    report = lt.train_samples(r, lt.TrainConfig(steps=6, batch_size=1, optimizer=optim.sgd(1e-4), log_every=0,
                                                autocast="float16"), samples)
    scaler = torch.amp.GradScaler("cpu")
    torch_loop(ref, BigEntry, samples, torch.float16, scaler, lr=1e-4)
    assert report.skipped_steps >= 1  # the first scale overflowed
    assert scaler.get_scale() < 2.0**16  # and backed off
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_the_scale_grows_after_the_interval():
    from leantrain.training.runner.precision import LossScaler

    s = LossScaler(torch.device("cpu"), scale=8.0, growth_interval=3)
    clean, overflow = torch.zeros(1), torch.ones(1)
    for _ in range(3):
        s.update(clean)
    assert s.state() == {"loss_scale": 16.0, "scale_tracker": 0}
    s.update(overflow)
    assert s.state() == {"loss_scale": 8.0, "scale_tracker": 0}


@pytest.mark.parametrize("stop_at", [1, 3])
def test_float16_resumes_with_its_scale(tmp_path, stop_at):
    samples = big_samples(6)
    cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=optim.adam(1e-3), log_every=1, autocast="float16",
                         checkpoint_path=tmp_path / "a.ckpt")
    torch.manual_seed(0)
    straight = lt.Runner.from_module(Big(), "mse")
    full = lt.train_samples(straight, cfg, samples, log=lambda s: None)
    torch.manual_seed(0)
    first = lt.Runner.from_module(Big(), "mse")
    lt.train_samples(first, lt.TrainConfig(**{**cfg.__dict__, "checkpoint_path": tmp_path / "b.ckpt"}), samples,
                     log=lambda s: None, callback=lambda ev: ev.step == stop_at)
    progress = lt.read_checkpoint(tmp_path / "b.ckpt")[0]["progress"]
    assert progress["autocast"] == "float16" and progress["loss_scale"] <= 2.0**16
    torch.manual_seed(9)
    again = lt.Runner.from_module(Big(), "mse")
    report = lt.train_samples(again, lt.TrainConfig(**{**cfg.__dict__, "resume_from": tmp_path / "b.ckpt",
                                                     "checkpoint_path": tmp_path / "c.ckpt"}), samples,
                              log=lambda s: None)
    assert report.losses == full.losses
    assert all(torch.equal(a, b) for a, b in zip(straight.params.values(), again.params.values()))
    with pytest.raises(lt.CheckpointError, match="autocast: checkpoint has 'float16', this run has 'bfloat16'"):
        lt.train_samples(lt.Runner.from_module(Big(), "mse"),
                         lt.TrainConfig(**{**cfg.__dict__, "autocast": "bfloat16", "resume_from": tmp_path / "b.ckpt",
                                           "checkpoint_path": None}), samples)


def test_autocast_is_validated():
    for bad in ("fp16", "half", torch.float16, 1):
        with pytest.raises(lt.ConfigError, match="autocast must be one of"):
            lt.TrainConfig(steps=1, autocast=bad)


@pytest.mark.slow
def test_the_command_in_bf16_reaches_the_fp32_accuracy(tmp_path, capsys):
    acc = {}
    for p in ("fp32", "bf16"):
        out = tmp_path / p
        assert main(["train", "--preset", "digits-cnn", "--epochs", "3", "--precision", p, "--out", str(out),
                     "--log-every", "0"]) == 0
        acc[p] = json.loads((out / "report.json").read_text())["test_accuracy"]
    assert acc["bf16"] >= acc["fp32"] - 0.01, acc
    assert main(["train", "--precision", "fp8", "--out", str(tmp_path / "x")]) == 2
    assert "--precision: expected one of fp32, bf16, fp16" in capsys.readouterr().err
