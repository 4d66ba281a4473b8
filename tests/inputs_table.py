"""What the bad-input tables share (``test_inputs_*.py``, one table per public operation):
a context of parameters, optimizer state, a runner and files, and the check every row
gets: the call raises the given leantrain error with a message matching the pattern,
and parameter, optimizer-state, buffer and file bytes are unchanged afterwards."""

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
from leantrain.torchlean_io import write_torchlean_f32
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


def overlapping():
    m = nn.Module()
    base = torch.zeros(6)
    m.a = nn.Parameter(base[:4])
    m.b = nn.Parameter(base[3:])
    return m


def files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name in ("good.ckpt", "p.bin")}




def native_params():
    """Parameters trained on the native path: the values live in the mirrors, the hosts are stale."""
    p = Param(torch.tensor([1.0, -2.0, 3.0]), name="w")
    params = ParamList([p, Param(torch.tensor([0.5, 0.25]), name="b")])
    params.to_device("cpu")
    opt = optim.adam(0.1)
    opt.step_native(opt.init(params, native=True), params, [torch.ones(3), torch.ones(2)])
    return params


def check_row(call, error, pattern, tmp_path) -> None:
    """One row: the call raises, and nothing it could reach changed."""
    c = make_ctx(tmp_path)
    before = (snapshot(c.params, c.state), snapshot(c.runner.params, c.rstate), files(tmp_path))
    with pytest.raises(error, match=pattern):
        call(c)
    after = (snapshot(c.params, c.state), snapshot(c.runner.params, c.rstate), files(tmp_path))
    assert same(before[0], after[0]), "parameter or optimizer bytes changed"
    assert same(before[1], after[1]), "runner parameter, buffer or optimizer bytes changed"
    assert before[2] == after[2], "file bytes changed"


def ids(table) -> list[str]:
    return [row[0] for row in table]
