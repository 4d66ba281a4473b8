"""Checkpoints: round trips, strict loading, atomic writes, exact resume in a fresh process."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import leantrain as lt
from leantrain import Param, ParamList, optim
from leantrain.io.atomic import atomic_write
from leantrain.io.checkfile import seal, unseal
import resume_cases as rc

HERE = Path(__file__).parent


def tensors_of(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(unseal(f.metadata()["leantrain"]))


# ------------------------------------------------------------------ round trip
def test_round_trip_tied_frozen_buffers(tmp_path):
    runner, run, cfg = rc.make("samples-adam-none")
    run(replace(cfg, steps=4))
    opt = cfg.optimizer
    # a state for the record: train 4 steps by hand to have one
    state = opt.init(runner.params)
    batch = rc.data()[:2]
    for _ in range(3):
        state = lt.step_batch(runner, opt, state, False, batch)
    path = tmp_path / "a.ckpt"
    lt.save_checkpoint(path, runner, state=state, progress={"step": 3})
    tensors, manifest = tensors_of(path)
    # each storage once: the tied weight is stored a single time
    assert len([k for k in tensors if k.startswith("storage.")]) == len(runner.params.storages())
    assert manifest["representatives"] == runner.params.canonical_slot_indices()
    assert sorted(manifest["optimizer"]["records"]) == sorted(
        str(i) for i, c in enumerate(runner.params.canonical_slot_indices()) if c == i
    )
    other, _, _ = rc.make("samples-adam-none")
    ck = lt.load_checkpoint(path, other, optimizer=opt)
    for a, b in zip(runner.params.values(), other.params.values()):
        assert torch.equal(a, b)
    for i, rec in ck.state.records().items():
        for k, t in rec.tensors().items():
            assert torch.equal(t, state.slots[i].tensors()[k])
        assert rec.step == state.slots[i].step
    assert ck.progress == {"step": 3}
    reps = runner.params.canonical_slot_indices()
    alias = next(i for i, c in enumerate(reps) if c is not None and c != i)
    assert ck.state.slots[alias] is ck.state.slots[reps[alias]]  # the alias shares its record
    # the next update is identical (the same dropout draws for both)
    rng = torch.get_rng_state()
    lt.step_batch(runner, opt, state, False, batch)
    torch.set_rng_state(rng)
    lt.step_batch(other, opt, ck.state, False, batch)
    for a, b in zip(runner.params.values(), other.params.values()):
        assert torch.equal(a, b)


def test_native_state_round_trip_on_cpu_mirrors(tmp_path):
    p, q = Param(torch.randn(3)), Param(torch.randn(2))
    params = ParamList([p, q, p]).to_device("cpu")
    opt = optim.adamw(0.1)
    state = opt.init(params, native=True)
    for k in range(4):
        state = opt.step_native(state, params, [torch.ones(3) * k, torch.ones(2), torch.ones(3)])
    lt.save_checkpoint(tmp_path / "n.ckpt", params, state=state)
    p2, q2 = Param(torch.zeros(3)), Param(torch.zeros(2))
    dest = ParamList([p2, q2, p2]).to_device("cpu")
    ck = lt.load_checkpoint(tmp_path / "n.ckpt", dest, optimizer=opt)
    assert ck.state.path == "native" and ck.state.slots[2] is None
    assert [ck.state.slots[i].step for i in (0, 1)] == [4, 4]
    assert torch.equal(dest.values_synced()[0], params.values_synced()[0])
    assert dest[0].storage.mirror is not None  # mirrors are rebuilt on load
    next_a = opt.step_native(state, params, [torch.ones(3)] * 1 + [torch.ones(2), torch.ones(3)])
    next_b = opt.step_native(ck.state, dest, [torch.ones(3)] * 1 + [torch.ones(2), torch.ones(3)])
    assert torch.equal(params.values_synced()[0], dest.values_synced()[0])
    lt.save_checkpoint(tmp_path / "n2.ckpt", params, state=next_a, rng=False)
    lt.save_checkpoint(tmp_path / "n3.ckpt", dest, state=next_b, rng=False)
    assert (tmp_path / "n2.ckpt").read_bytes() == (tmp_path / "n3.ckpt").read_bytes()


# ------------------------------------------------------------------ rejections
@pytest.fixture
def saved(tmp_path):
    p, q = Param(torch.randn(2), name="p"), Param(torch.randn(3), name="q")
    params = ParamList([p, q, p])
    opt = optim.adam(0.1)
    state = opt.step(opt.init(params), params, [torch.ones(2), torch.ones(3), torch.ones(2)])
    path = tmp_path / "s.ckpt"
    lt.save_checkpoint(path, params, state=state, rng=False)
    return path, opt


def fresh(layout="pqp", shapes=(2, 3), frozen=(), dtype=torch.float32):
    p = Param(torch.zeros(shapes[0], dtype=dtype), name="p")
    q = Param(torch.zeros(shapes[1], dtype=dtype), name="q")
    views = [{"p": p, "q": q}[c] for c in layout]
    views = [v.view(requires_grad=False) if i in frozen else v for i, v in enumerate(views)]
    return ParamList(views).to_device("cpu")


def corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[:-1]
    elif how == "flip":
        data[-3] ^= 0x40
    elif how in ("version", "format"):  # a consistent edit: the manifest checksum is redone
        n = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8 : 8 + n]))
        manifest = json.loads(header["__metadata__"]["leantrain"].split(" ", 1)[1])
        if how == "version":
            manifest["version"] = 3
        else:
            manifest["format"] = "leantrain.checkpoinX"
        header["__metadata__"] = {"leantrain": seal(json.dumps(manifest, sort_keys=True))}
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        data = bytearray(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    elif how == "header":
        data[10] ^= 0xFF
    elif how == "manifest":
        data = data.replace(b'\\"lr\\": 0.1', b'\\"lr\\": 0.7')
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how, pattern",
    [
        ("truncate", "not a readable checkpoint"),
        ("flip", "fails its checksum"),
        ("version", r"unsupported format version 3; expected one of \(1, 2\)"),
        ("format", "unsupported format 'leantrain.checkpoinX'"),
        ("header", "not a readable checkpoint|no leantrain manifest|manifest fails its checksum"),
        ("manifest", "the manifest fails its checksum"),
    ],
)
def test_corrupt_files_rejected_and_nothing_changes(saved, how, pattern, unchanged):
    path, opt = saved
    corrupt(path, how)
    dest = fresh()
    with unchanged(dest), pytest.raises(lt.CheckpointError, match=pattern):
        lt.load_checkpoint(path, dest, optimizer=opt)


@pytest.mark.parametrize(
    "make, opt, pattern",
    [
        (lambda: fresh("pqq"), None, r"storage alias map: checkpoint has \[0, 1, 0\]"),
        (lambda: fresh("pqp", frozen=(1,)), None, r"slot 1 \('q'\): frozen mask: checkpoint has True"),
        (lambda: fresh("pqp", shapes=(2, 4)), None, r"slot 1 \('q'\): shape: checkpoint has \[3\], destination has \[4\]"),
        (lambda: fresh("pqp", dtype=torch.float64), None, r"dtype: checkpoint has 'float32', destination has 'float64'"),
        (lambda: fresh("pq"), None, "slot count: checkpoint has 3 slots, destination has 2"),
        (lambda: fresh(), optim.sgd(0.1), r"optimizer: checkpoint has adam\(.*destination uses sgd"),
        (lambda: fresh(), optim.adam(0.1, beta2=0.99), "optimizer: checkpoint has adam"),
    ],
)
def test_mismatched_destinations_rejected(saved, make, opt, pattern, unchanged):
    path, saved_opt = saved
    dest = make()
    with unchanged(dest), pytest.raises(lt.CheckpointError, match=pattern):
        lt.load_checkpoint(path, dest, optimizer=opt or saved_opt)


def test_every_problem_is_reported_at_once(saved):
    path, opt = saved
    with pytest.raises(lt.CheckpointError) as err:
        lt.load_checkpoint(path, fresh("pqq", shapes=(2, 4), dtype=torch.float64), optimizer=optim.sgd(0.1))
    msg = str(err.value)
    for part in ("shape", "dtype", "storage alias map", "optimizer: checkpoint has adam", "nothing was loaded"):
        assert part in msg, part


def test_missing_and_extra_entries_rejected(saved, tmp_path):
    from safetensors.torch import save_file

    path, opt = saved
    tensors, manifest = tensors_of(path)
    meta = {"leantrain": seal(json.dumps(manifest))}
    missing = dict(tensors)
    del missing["state.0.m"]
    save_file(missing, str(tmp_path / "missing.ckpt"), metadata=meta)
    with pytest.raises(lt.CheckpointError, match="missing tensor 'state.0.m'"):
        lt.load_checkpoint(tmp_path / "missing.ckpt", fresh(), optimizer=opt)
    extra = dict(tensors, stray=torch.zeros(1))
    save_file(extra, str(tmp_path / "extra.ckpt"), metadata=meta)
    with pytest.raises(lt.CheckpointError, match="unexpected tensor 'stray'"):
        lt.load_checkpoint(tmp_path / "extra.ckpt", fresh(), optimizer=opt)
    with pytest.raises(lt.CheckpointError, match="no such checkpoint file"):
        lt.load_checkpoint(tmp_path / "nope.ckpt", fresh())


def test_failing_writer_leaves_the_old_file(tmp_path):
    path = tmp_path / "f.ckpt"
    params = ParamList.of_pack([torch.ones(2)])
    lt.save_checkpoint(path, params, rng=False)
    old = path.read_bytes()

    def boom(tmp):
        tmp.write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(lt.CheckpointError, match="f.ckpt: could not be written \\(disk full\\)"):
        atomic_write(path, boom)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["f.ckpt"]  # no temporary left


GOLDEN = HERE / "golden" / "tiny_v2.ckpt"  # the format written now (CRC-32C per tensor)
GOLDEN_V1 = HERE / "golden" / "tiny_v1.ckpt"  # written by version 1 (CRC-32): still read


def tiny_checkpoint(path):
    p = Param(torch.tensor([1.0, -2.5]), name="w")
    params = ParamList([p, Param(torch.tensor(0.5), name="b", requires_grad=False), p])
    opt = optim.adam(0.1)
    state = opt.step(opt.init(params), params, [torch.tensor([1.0, 2.0]), torch.tensor(0.0), torch.tensor([0.5, 0.5])])
    lt.save_checkpoint(path, params, state=state, progress={"step": 1}, rng=False)


def test_golden_file_pins_the_format(tmp_path):
    tiny_checkpoint(tmp_path / "tiny.ckpt")
    if os.environ.get("LEANTRAIN_REGOLD"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_bytes((tmp_path / "tiny.ckpt").read_bytes())
    assert (tmp_path / "tiny.ckpt").read_bytes() == GOLDEN.read_bytes(), (
        "the checkpoint bytes changed: bump the format version if this is intended"
    )
    params = ParamList([Param(torch.zeros(2), name="w"), Param(torch.tensor(0.0), name="b", requires_grad=False)])
    params = ParamList([params[0], params[1], params[0]])
    ck = lt.load_checkpoint(GOLDEN, params, optimizer=optim.adam(0.1))
    assert ck.state.slots[0].step == 1 and params.values()[1].item() == 0.5


# ---------------------------------------------------------------- exact resume
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Run every case k steps and stop (saving), then resume all in one fresh process."""
    work = tmp_path_factory.mktemp("resume")
    for case in rc.cases():
        runner, run, cfg = rc.make(case)
        stop_at = rc.K

        def stop(event, _k=stop_at):
            return event.step == _k

        cfg_b = replace(cfg, checkpoint_path=work / f"{case}.mid")
        if case.startswith("samples"):
            report = lt.train_samples(runner, cfg_b, rc.data(), log=lambda s: None, callback=stop)
        else:
            report, _ = lt.train_loader(runner, cfg_b, rc.make_loader(), log=lambda s: None, callback=stop)
        assert report.interrupted and report.steps == rc.K
    env = dict(
        os.environ,
        PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        LEANTRAIN_THREADS=str(torch.get_num_threads()),  # same reductions as this process
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "resume_cases.py"), str(work), *rc.cases()],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return work


@pytest.mark.parametrize("case", rc.cases())
def test_resume_in_a_fresh_process_is_bit_identical(case, resumed, tmp_path):
    runner, run, cfg = rc.make(case)
    report = run(replace(cfg, checkpoint_path=tmp_path / "straight.ckpt"))
    a, ma = tensors_of(tmp_path / "straight.ckpt")
    b, mb = tensors_of(resumed / f"{case}.resumed")
    assert sorted(a) == sorted(b)
    for k in a:
        if k.startswith(("storage.", "state.", "loader.")):
            assert torch.equal(a[k], b[k]), k
    assert ma["optimizer"] == mb["optimizer"] and ma["progress"] == mb["progress"]
    child = json.loads((resumed / f"{case}.report").read_text())
    assert child["before"] == report.before and child["after"] == report.after
    assert [tuple(x) for x in child["losses"]] == list(report.losses) and child["steps"] == report.steps


def test_version_1_files_still_load_and_verify(tmp_path):
    params = ParamList([Param(torch.zeros(2), name="w"), Param(torch.tensor(0.0), name="b", requires_grad=False)])
    params = ParamList([params[0], params[1], params[0]])
    ck = lt.load_checkpoint(GOLDEN_V1, params, optimizer=optim.adam(0.1))
    assert ck.manifest["version"] == 1 and ck.state.slots[0].step == 1
    new = ParamList([Param(torch.zeros(2), name="w"), Param(torch.tensor(0.0), name="b", requires_grad=False)])
    new = ParamList([new[0], new[1], new[0]])
    lt.load_checkpoint(GOLDEN, new, optimizer=optim.adam(0.1))
    assert all(torch.equal(a, b) for a, b in zip(params.values(), new.values()))  # the same content
    damaged = bytearray(GOLDEN_V1.read_bytes())
    damaged[-1] ^= 1  # a flipped data bit: version 1's CRC-32 catches it
    (tmp_path / "d.ckpt").write_bytes(bytes(damaged))
    with pytest.raises(lt.CheckpointError, match="fails its checksum"):
        lt.load_checkpoint(tmp_path / "d.ckpt", new)


def test_one_wrong_shape_is_one_problem(tmp_path, unchanged):
    """A tied storage of another size: one line (its first slot, naming the alias), not one
    per slot, storage tensor and optimizer record that follow from it."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.emb.weight = nn.Parameter(torch.randn(10, width))
            self.head.weight = self.emb.weight
            self.norm = nn.LayerNorm(8)

    opt = optim.adam(1e-3)
    r = lt.Runner.from_module(Net(8), "mse")
    lt.save_checkpoint(tmp_path / "a.ckpt", r, state=opt.init(r.params))
    dest = lt.Runner.from_module(Net(6), "mse")
    with unchanged(dest.params), pytest.raises(lt.CheckpointError) as err:
        lt.load_checkpoint(tmp_path / "a.ckpt", dest, optimizer=opt)
    lines = [ln for ln in str(err.value).splitlines() if ln.startswith("  - ")]
    assert lines == ["  - slot 0 ('emb.weight') (and slot 1, sharing its storage): shape: checkpoint has [10, 8], "
                     "destination has [10, 6]"], lines
