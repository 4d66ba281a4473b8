"""One table of bad inputs across the public API. Each row: the call, the exception type,
a message pattern; and afterwards parameter, optimizer-state and file bytes are unchanged."""

import io
import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import Param, ParamList, optim
from leantrain.cli import main as cli_main
from leantrain.torchlean_io import read_torchlean_f32, write_torchlean_f32
from leantrain.weights import import_state_dict
from conftest import same, snapshot


class CliError(Exception):
    pass


@dataclass
class Ctx:
    params: ParamList
    opt: object
    state: object
    runner: lt.Runner
    rstate: object
    ckpt: Path
    f32: Path
    folder: Path


def make_ctx(tmp: Path) -> Ctx:
    torch.manual_seed(0)
    p = Param(torch.randn(3), name="w")
    params = ParamList([p, Param(torch.randn(2), name="b"), Param(torch.randn(()), name="f", requires_grad=False), p])
    params.to_device("cpu")
    opt = optim.adam(0.1)
    state = opt.init(params, native=True)
    state = opt.step_native(state, params, [torch.ones(3), torch.ones(2), None, torch.ones(3)])
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    runner = lt.Runner.from_module(net, "mse")
    rstate = opt.init(runner.params)
    ckpt = tmp / "good.ckpt"
    lt.save_checkpoint(ckpt, params, state=state, rng=False)
    f32 = tmp / "p.bin"
    write_torchlean_f32(f32, params)
    return Ctx(params, opt, state, runner, rstate, ckpt, f32, tmp)


def cli(*args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(list(args))
    if code == 2:
        raise CliError(err.getvalue().strip())


def sample(n=5, d=3, out=2, dtype=torch.float32):
    return (torch.randn(n, d, dtype=dtype), torch.randn(n, out, dtype=dtype))


def truncated(c: Ctx) -> Path:
    bad = c.folder / "truncated.ckpt"
    bad.write_bytes(c.ckpt.read_bytes()[:-7])
    return bad


def version_bumped(c: Ctx) -> Path:
    bad = c.folder / "v3.bin"
    data = bytearray(c.f32.read_bytes())
    data[7] += 1
    bad.write_bytes(bytes(data))
    return bad


g3, g2 = torch.ones(3), torch.ones(2)
CASES = [
    # ---- packs and parameter lists
    ("set_values short", lambda c: c.params.set_values([g3]), lt.PackError, "pack length mismatch: expected 4"),
    ("set_values shape", lambda c: c.params.set_values([g3, g3, torch.zeros(()), g3]), lt.PackError, r"slot 1 \('b'\): expected shape \(2,\), got \(3,\)"),
    ("set_values dtype", lambda c: c.params.set_values([g3, g2.double(), torch.zeros(()), g3]), lt.PackError, r"slot 1 \('b'\): expected dtype torch.float32"),
    ("set_values non-tensor", lambda c: c.params.set_values([g3, [1.0, 2.0], torch.zeros(()), g3]), lt.PackTypeError, r"slot 1 \('b'\): expected a torch.Tensor, got list"),
    ("set_values not a list", lambda c: c.params.set_values(g3), lt.PackTypeError, "expected a list of tensors"),
    ("of_pack non-tensor", lambda c: ParamList.of_pack([g3, 2.0]), lt.PackTypeError, "slot 1: expected a torch.Tensor, got float"),
    ("mask short", lambda c: ParamList.of_pack_with_requires_grad([g3, g2], [True]), lt.PackError, "shorter than the pack"),
    ("mask long", lambda c: ParamList.of_pack_with_requires_grad([g3], [True, False]), lt.PackError, "longer than the pack"),
    ("mask not bool", lambda c: ParamList.of_pack_with_requires_grad([g3], ["yes"]), lt.PackTypeError, "flag 0: expected a bool"),
    ("ParamList of tensors", lambda c: ParamList([g3]), lt.PackTypeError, "slot 0: expected a Param, got Tensor"),
    ("map c > i", lambda c: lt.canonical_gradients([1, 1], [g3, g3]), lt.PackError, "slot 0: invalid canonical slot 1"),
    ("map to an alias", lambda c: lt.canonical_gradients([0, 0, 1], [g3, g3, g3]), lt.PackError, "slot 2: invalid canonical slot 1"),
    ("map mixes shapes", lambda c: lt.canonical_gradients([0, 0], [torch.zeros(()), torch.zeros(1)]), lt.PackError, "does not match its representative"),
    ("map length", lambda c: lt.canonical_gradients([0], [g3, g3]), lt.PackError, "map has 1 slots, gradient pack has 2"),
    ("canonical gradient missing", lambda c: lt.canonical_gradient((3,), [g3, None], 1), lt.PackError, "slot 1: no canonical gradient"),
    ("add packs misaligned", lambda c: lt.add_gradient_packs([g3], [g2]), lt.PackError, r"slot 0: shape mismatch: \(3,\)"),
    ("mirror write shape", lambda c: c.params[0].storage.write_mirror(g2), lt.PackError, r"mirror shape mismatch: expected \(3,\), got \(2,\)"),
    ("module overlap", lambda c: ParamList.from_module(_overlapping()), lt.AliasError, "overlap in memory"),
    ("from_module non-module", lambda c: ParamList.from_module(3), lt.PackTypeError, "expected a torch.nn.Module"),
    # ---- optimizers and schedules
    ("step pack length", lambda c: c.opt.step_native(c.state, c.params, [g3]), lt.PackError, "pack length mismatch"),
    ("step grad shape", lambda c: c.opt.step_native(c.state, c.params, [g3, g3, None, g3]), lt.PackError, r"slot 1 \('b'\): expected shape"),
    ("step grad dtype", lambda c: c.opt.step_native(c.state, c.params, [g3, g2.double(), None, g3]), lt.PackError, "expected dtype"),
    ("step sparse grad", lambda c: c.opt.step_native(c.state, c.params, [g3, g2.to_sparse(), None, g3]), lt.PackError, r"slot 1 \('b'\): got a sparse gradient, which adam does not take"),
    ("step other config", lambda c: optim.adam(0.1, beta1=0.5).step_native(c.state, c.params, [g3, g2, None, g3]), lt.OptimizerStateError, "different optimizer configuration"),
    ("step other kind", lambda c: optim.sgd(0.1).step_native(c.state, c.params, [g3, g2, None, g3]), lt.OptimizerStateError, "different optimizer configuration"),
    ("mix paths", lambda c: c.opt.step(c.state, c.params, [g3, g2, None, g3]), lt.OptimizerStateError, "cannot mix generic and native"),
    ("state not a state", lambda c: c.opt.step({}, c.params, [g3, g2, None, g3]), lt.OptimizerStateError, "expected an OptState, got dict"),
    ("sgd lr < 0", lambda c: optim.sgd(-1.0), lt.ConfigError, "lr must be finite and >= 0, got -1.0"),
    ("adam beta1 = 1", lambda c: optim.adam(0.1, beta1=1.0), lt.ConfigError, r"beta1 must be in \[0, 1\)"),
    ("adam eps = 0", lambda c: optim.adam(0.1, eps=0.0), lt.ConfigError, "eps must be finite and > 0"),
    ("adamw wd nan", lambda c: optim.adamw(0.1, weight_decay=float("nan")), lt.ConfigError, "weight_decay must be finite"),
    ("eps rounds to 0", lambda c: optim.adam(0.1, eps=1e-50).init(c.params), lt.ConfigError, "after conversion to float32"),
    ("schedule step 0", lambda c: optim.step(0.1, 0), lt.ConfigError, "step_size must be an integer >= 1"),
    ("schedule min > peak", lambda c: optim.warmup_cosine(0.1, 0.2, 1, 10), lt.ConfigError, "min must be <= peak"),
    ("schedule gamma > 1", lambda c: optim.exponential(0.1, 1.5), lt.ConfigError, r"gamma must be in \[0, 1\]"),
    ("with_lr < 0", lambda c: c.state.with_lr(-0.5), lt.ConfigError, "lr must be finite and >= 0"),
    # ---- configs, samples, loops
    ("steps < 0", lambda c: lt.TrainConfig(steps=-1), lt.ConfigError, "steps must be an integer >= 0"),
    ("batch size 0", lambda c: lt.TrainConfig(steps=1, batch_size=0), lt.ConfigError, "batch_size must be an integer >= 1"),
    ("torch optimizer", lambda c: lt.TrainConfig(steps=1, optimizer=torch.optim.Adam), lt.ConfigError, "optimizer must be built with leantrain.optim"),
    ("checkpoint_every without path", lambda c: lt.TrainConfig(steps=1, checkpoint_every=5), lt.ConfigError, "needs a checkpoint_path"),
    ("nonfinite mode", lambda c: lt.TrainConfig(steps=1, nonfinite="ignore"), lt.ConfigError, "nonfinite must be one of"),
    ("epochs float", lambda c: lt.LoaderTrainConfig(epochs=2.0), lt.ConfigError, "epochs must be an integer >= 0"),
    ("empty samples", lambda c: lt.train_samples(c.runner, lt.TrainConfig(steps=2), []), lt.DataError, "empty sample list"),
    ("sample not a pair", lambda c: lt.train_samples(c.runner, lt.TrainConfig(steps=2), [sample(), (torch.zeros(3),)]), lt.ConfigError, r"item 1: expected an \(x, y\) pair"),
    ("sample wrong shape", lambda c: lt.step_batch(c.runner, c.opt, c.rstate, False, [sample(), sample(d=5)]), lt.DataError, r"rejected the sample \(x \(5, 5\)"),
    ("sample wrong dtype", lambda c: lt.step_batch(c.runner, c.opt, c.rstate, False, [sample(), sample(dtype=torch.float64)]), lt.DataError, "rejected the sample"),
    ("empty batch", lambda c: lt.step_batch(c.runner, c.opt, c.rstate, False, []), lt.DataError, "step_batch: empty batch"),
    ("vectorized with BatchNorm", lambda c: lt.step_batch(c.runner, c.opt, c.rstate, False, [sample(), sample()], accumulation="vectorized"), lt.ConfigError, "couples the items"),
    ("loader batch 0", lambda c: lt.DataLoader(lt.Dataset([sample()]), batch_size=0), lt.ConfigError, "batch_size must be an integer >= 1"),
    ("loader seed < 0", lambda c: lt.DataLoader(lt.Dataset([sample()]), batch_size=1, seed=-3), lt.ConfigError, "seed must be an integer >= 0"),
    ("loader empty", lambda c: lt.train_loader(c.runner, lt.LoaderTrainConfig(epochs=1), lt.DataLoader(lt.Dataset([]), batch_size=1)), lt.DataError, "empty dataset"),
    ("unknown loss", lambda c: lt.Runner.from_module(nn.Linear(1, 1), "hinge"), lt.ConfigError, "unknown loss 'hinge'"),
    # ---- files
    ("checkpoint truncated", lambda c: lt.load_checkpoint(truncated(c), c.params), lt.CheckpointError, "not a readable checkpoint"),
    ("checkpoint missing", lambda c: lt.load_checkpoint(c.folder / "none.ckpt", c.params), lt.CheckpointError, "no such checkpoint file"),
    ("checkpoint alias map", lambda c: lt.load_checkpoint(c.ckpt, ParamList([c.params[0], c.params[1], c.params[2], c.params[1]])), lt.CheckpointError, "storage alias map"),
    ("checkpoint other optimizer", lambda c: lt.load_checkpoint(c.ckpt, c.params, optimizer=optim.adamw(0.1)), lt.CheckpointError, "destination uses adamw"),
    ("checkpoint state misfit", lambda c: lt.save_checkpoint(c.ckpt, c.params, state=c.rstate), lt.CheckpointError, "does not fit the 4 slots"),
    ("torchlean version", lambda c: read_torchlean_f32(version_bumped(c), c.params), lt.CheckpointError, "unsupported format version 3; expected 2"),
    ("state dict shape", lambda c: import_state_dict(c.params, {"w": g2, "b": g2, "f": torch.zeros(())}), lt.CheckpointError, r"slot 0 \('w'\): expected \(3,\) float32, got \(2,\)"),
    # ---- the command line
    ("cli bad flag value", lambda c: cli("train", "--batch-size", "x"), CliError, "argument --batch-size: expected a natural number"),
    ("cli unknown preset", lambda c: cli("train", "--preset", "resnet"), CliError, "--preset: expected one of"),
    ("cli unknown flag", lambda c: cli("inspect", str(c.ckpt), "--all"), CliError, "unrecognized arguments: --all"),
    ("cli corrupt file", lambda c: cli("inspect", str(truncated(c))), CliError, "not a readable checkpoint"),
]


def _overlapping():
    m = nn.Module()
    base = torch.zeros(6)
    m.a = nn.Parameter(base[:4])
    m.b = nn.Parameter(base[3:])
    return m


def files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name in ("good.ckpt", "p.bin")}


def test_the_table_is_big_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name, call, error, pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, call, error, pattern, tmp_path):
    c = make_ctx(tmp_path)
    before = (snapshot(c.params, c.state), snapshot(c.runner.params, c.rstate), files(tmp_path))
    with pytest.raises(error, match=pattern):
        call(c)
    after = (snapshot(c.params, c.state), snapshot(c.runner.params, c.rstate), files(tmp_path))
    assert same(before[0], after[0]), "parameter or optimizer bytes changed"
    assert same(before[1], after[1]), "runner parameter, buffer or optimizer bytes changed"
    assert before[2] == after[2], "file bytes changed"
