"""TorchLean's files (spec §9.3, §9.4): golden bytes made here by hand from the layouts
(struct-packed, never by leantrain's writers), read and written, with every check."""

import json
import math
import struct
import warnings

import pytest
import torch

import leantrain as lt
from leantrain import Param, ParamList, optim
from leantrain import torchlean_io as tio
from leantrain.cli import main

Q = struct.Struct("<Q")


def u64(*ns):
    return b"".join(Q.pack(n) for n in ns)


def f64bits(x):
    return Q.unpack(struct.pack("<d", x))[0]


def f32(*xs):
    return struct.pack(f"<{len(xs)}f", *xs)


def tied_params():
    """[p (2,), q (), p]: a tie, one frozen-free layout with aliases."""
    p, q = Param(torch.tensor([1.0, -2.5]), name="p"), Param(torch.tensor(0.5), name="q")
    return ParamList([p, q, p.view(name="p2")])


def adam_state(params, steps=7, kind="adam"):
    opt = optim.adam(0.1) if kind == "adam" else optim.adamw(0.1, 0.01)
    state = opt.init(params)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grads = [torch.randn(v.shape, generator=gen) for v in params]
        state = opt.step(state, params, grads)
    return opt, state


def golden_adam(params, state, version, counter=None, kind_tag=0, wd=0.0):
    """TLADAMF bytes, field by field as §9.3 lists them."""
    out = b"TLADAMF" + u64(version, kind_tag, f64bits(0.9), f64bits(0.999), f64bits(1e-8), f64bits(wd))
    if version == 4:
        out += u64(counter)
    out += u64(3) + u64(1, 2, 2, 1) + u64(0, 1, 1) + u64(1, 2, 2, 1)
    if version >= 3:
        out += u64(1, 2, 1)  # representative + 1 per slot: p, q, p
    out += u64(2)
    for i in (0, 1):
        rec = state.slots[i]
        n = rec.m.numel()
        out += u64(i, rec.step, n) + f32(*rec.m.reshape(-1).tolist()) + f32(*rec.v.reshape(-1).tolist())
    return out


# --------------------------------------------------------------------- TLADAMF
@pytest.mark.parametrize("version, counter", [(3, None), (4, 12345)])
def test_tladamf_writer_matches_the_golden_bytes(tmp_path, version, counter):
    params = tied_params()
    _, state = adam_state(params)
    tio.write_torchlean_adam(tmp_path / "a", params, state, rng_counter=counter)
    assert (tmp_path / "a").read_bytes() == golden_adam(params, state, version, counter)


def test_tladamf_v2_for_a_layout_without_aliases(tmp_path):
    p = Param(torch.tensor([1.0, 2.0]))
    params = ParamList([p])
    _, state = adam_state(params, 3, "adamw")
    tio.write_torchlean_adam(tmp_path / "a", params, state)
    rec = state.slots[0]
    want = (b"TLADAMF" + u64(2, 1, f64bits(0.9), f64bits(0.999), f64bits(1e-8), f64bits(0.01))
            + u64(1, 1, 2, 2, 1) + u64(1) + u64(0, 3, 2) + f32(*rec.m.tolist()) + f32(*rec.v.tolist()))
    assert (tmp_path / "a").read_bytes() == want


def test_tladamf_golden_file_reads_into_the_state(tmp_path):
    params = tied_params()
    opt, state = adam_state(params)
    (tmp_path / "g").write_bytes(golden_adam(params, state, 4, 99))
    got = tio.read_torchlean_adam(tmp_path / "g", tied_params(), opt)
    assert got.version == 4 and got.counter == 99 and got.state.path == "generic"
    for i in (0, 1):
        a, b = got.state.slots[i], state.slots[i]
        assert a.step == b.step == 7 and a.beta1_power == b.beta1_power
        assert torch.equal(a.m, b.m) and torch.equal(a.v, b.v)
    assert got.state.slots[2] is got.state.slots[0]  # the alias shares its representative's history
    # the state continues exactly like the original history
    grads = [torch.ones(2), torch.tensor(1.0), torch.ones(2)]
    p1, p2 = tied_params(), tied_params()
    opt.step(state, p1, grads)
    opt.step(got.state, p2, grads)
    assert all(torch.equal(a, b) for a, b in zip(p1.values(), p2.values()))


def test_tladamf_legacy_file_warns_and_a_counter_needs_a_destination_that_keeps_one(tmp_path):
    params = tied_params()
    opt, state = adam_state(params)
    (tmp_path / "v3").write_bytes(golden_adam(params, state, 3))
    with pytest.warns(UserWarning, match="legacy checkpoint has no random counter"):
        tio.read_torchlean_adam(tmp_path / "v3", params, opt)
    (tmp_path / "v4").write_bytes(golden_adam(params, state, 4, 5))
    with pytest.raises(lt.CheckpointError, match="has a random counter and the destination keeps none"):
        tio.read_torchlean_adam(tmp_path / "v4", params, opt, with_counter=False)


def _rejects(tmp_path, data, params, opt, match):
    (tmp_path / "bad").write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(lt.CheckpointError, match=match):
            tio.read_torchlean_adam(tmp_path / "bad", params, opt)


def test_tladamf_every_read_check(tmp_path):
    params = tied_params()
    opt, state = adam_state(params)
    good = golden_adam(params, state, 3)
    _rejects(tmp_path, b"TLADAMX" + good[7:], params, opt, "unsupported checkpoint family")
    _rejects(tmp_path, good[:7] + u64(5) + good[15:], params, opt, "unsupported format version 5")
    _rejects(tmp_path, golden_adam(params, state, 2)[:15] + good[15:], params, opt,
             "version 2 cannot restore shared parameter histories")
    _rejects(tmp_path, good[:15] + u64(2) + good[23:], params, opt, "unknown optimizer kind tag 2")
    _rejects(tmp_path, good[:23] + u64(f64bits(1.0)) + good[31:], params, opt, "invalid optimizer config")
    _rejects(tmp_path, good, params, optim.adam(0.1, beta1=0.8), "different optimizer configuration")
    _rejects(tmp_path, good, params, optim.adamw(0.1, 0.0), "different optimizer configuration")
    p, q = Param(torch.zeros(3)), Param(torch.tensor(0.0))
    _rejects(tmp_path, good, ParamList([p, q, p]), opt, "slot 0: schema mismatch")
    # the same shapes and flags, but slot 2 is its own storage: the alias map differs
    untied = ParamList([Param(torch.zeros(2)), Param(torch.tensor(0.0)), Param(torch.zeros(2))])
    _rejects(tmp_path, good, untied, opt, "storage alias mismatch for parameter 2")
    flag_off = good.replace(u64(0, 1, 1), u64(0, 1, 7), 1)
    _rejects(tmp_path, flag_off, params, opt, "invalid `requiresGrad` flag 7")
    _rejects(tmp_path, good[:-1], params, opt, "truncated checkpoint")
    _rejects(tmp_path, good + b"\0", params, opt, "1 trailing bytes")
    entries = good.index(u64(2) + u64(0, 7))
    _rejects(tmp_path, good[:entries] + u64(1) + good[entries + 8:], params, opt, "1 state entries")
    zero_t = good[:entries + 16] + u64(0) + good[entries + 24:]
    _rejects(tmp_path, zero_t, params, opt, "step count 0")
    dup = good[:entries + 8] + good[entries + 8:].replace(u64(1, 7, 1), u64(0, 7, 1), 1)
    _rejects(tmp_path, dup, params, opt, "duplicate state entry for parameter 0")


def test_tladamf_write_checks(tmp_path):
    params = tied_params()
    opt = optim.adam(0.1)
    with pytest.raises(lt.CheckpointError, match="no Adam or AdamW update has initialized"):
        tio.write_torchlean_adam(tmp_path / "a", params, opt.init(params))
    with pytest.raises(lt.CheckpointError, match="expected an Adam or AdamW optimizer state"):
        tio.write_torchlean_adam(tmp_path / "a", params, optim.sgd(0.1).init(params))
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------ JSON bits
def test_bits_file_key_order_and_pretty_layout(tmp_path):
    params = ParamList([Param(torch.tensor([1.0, -2.5], dtype=torch.float64))])
    tio.write_torchlean_bits(tmp_path / "b.json", params)
    text = (tmp_path / "b.json").read_text()
    assert text.index('"params"') < text.index('"format"') and text.index('"values"') < text.index('"shape"')
    want = {"params": [{"values": [f64bits(1.0), f64bits(-2.5)], "shape": [2]}],
            "format": "torchlean_paramlist_bits_v1"}
    assert json.loads(text) == want and "\n" in text


@pytest.mark.parametrize("doc, match", [
    ({"format": "torchlean_paramlist_bits_v1", "params": [{"values": [0, 0]}]}, "has no shape"),
    ({"format": "torchlean_paramlist_bits_v1", "params": [{"shape": [2], "values": [True, 0]}]}, "natural number"),
    ({"format": "torchlean_paramlist_bits_v1", "params": [{"shape": [2], "values": [1.0, 0]}]}, "natural number"),
    ({"format": "torchlean_paramlist_bits_v1", "params": [{"shape": [2], "values": [2**64, 0]}]}, "below 2\\^64"),
    ({"format": "torchlean_paramlist_bits_v1", "params": [{"shape": [2]}]}, "expected 2 values"),
    ({"format": "torchlean_paramlist_bits_v1", "params": [{"shape": [True, 1], "values": [0, 0]}]}, "expected shape"),
])
def test_bits_reader_rejects(tmp_path, doc, match, unchanged):
    params = ParamList([Param(torch.zeros(2, dtype=torch.float64))])
    (tmp_path / "b.json").write_text(json.dumps(doc))
    with unchanged(params), pytest.raises(lt.CheckpointError, match=match):
        tio.read_torchlean_bits(tmp_path / "b.json", params)


def test_bits_reader_accepts_omitted_values_and_params(tmp_path):
    params = ParamList([Param(torch.zeros(0, 3)), Param(torch.tensor([2.0]))])
    doc = {"params": [{"shape": [0, 3]}, {"values": [f64bits(4.0)], "shape": [1]}],
           "format": "torchlean_paramlist_bits_v1"}
    (tmp_path / "b.json").write_text(json.dumps(doc))
    tio.read_torchlean_bits(tmp_path / "b.json", params)
    assert params.values()[1].item() == 4.0
    (tmp_path / "e.json").write_text(json.dumps({"format": "torchlean_paramlist_bits_v1"}))
    tio.read_torchlean_bits(tmp_path / "e.json", ParamList([]))


# ------------------------------------------------------------- trainer state JSON
def test_state_files_golden_and_round_trip(tmp_path):
    params = ParamList([Param(torch.tensor([1.0, -2.5], dtype=torch.float64)), Param(torch.tensor(0.5))])
    golden = {"params": [{"values": [f64bits(1.0), f64bits(-2.5)], "shape": [2]},
                         {"values": [f64bits(0.5)], "shape": []}], "format": "torchlean_state_bits_v1"}
    (tmp_path / "g.json").write_text(json.dumps(golden))
    dest = ParamList([Param(torch.zeros(2, dtype=torch.float64)), Param(torch.tensor(0.0))])
    assert tio.read_torchlean_state(tmp_path / "g.json", dest) == "torchlean_state_bits_v1"
    assert dest.values()[0].tolist() == [1.0, -2.5] and dest.values()[1].item() == 0.5
    tio.write_torchlean_state(tmp_path / "w.json", params)
    assert json.loads((tmp_path / "w.json").read_text()) == golden
    tio.write_torchlean_state(tmp_path / "f.json", params, float32=True)
    words = json.loads((tmp_path / "f.json").read_text())["params"][0]["values"]
    assert words == [struct.unpack("<I", f32(1.0))[0], struct.unpack("<I", f32(-2.5))[0]]


def test_state_rejects_non_canonical_nan_and_writes_canonical(tmp_path, unchanged):
    dest = ParamList([Param(torch.zeros(1, dtype=torch.float64))])
    for fmt, word in (("torchlean_state_bits_v1", 0x7FF8000000000001), ("torchlean_state_float32_bits_v1", 0x7FC00001)):
        (tmp_path / "n.json").write_text(json.dumps({"params": [{"values": [word], "shape": [1]}], "format": fmt}))
        with unchanged(dest), pytest.raises(lt.CheckpointError, match="non-canonical NaN"):
            tio.read_torchlean_state(tmp_path / "n.json", dest)
    payload = torch.tensor([0x7FF8000000000123], dtype=torch.int64).view(torch.float64)  # a NaN with a payload
    nan = ParamList([Param(payload)])
    tio.write_torchlean_state(tmp_path / "c.json", nan)
    assert json.loads((tmp_path / "c.json").read_text())["params"][0]["values"] == [0x7FF8000000000000]


# ------------------------------------------------------------------- dispatch, CLI
def test_load_picks_the_reader_by_magic_or_tag(tmp_path):
    params = tied_params()
    opt, state = adam_state(params)
    tio.write_torchlean_f32(tmp_path / "p.bin", params)
    tio.write_torchlean_bits(tmp_path / "p.json", params)
    tio.write_torchlean_state(tmp_path / "s.json", params)
    tio.write_torchlean_adam(tmp_path / "a.bin", params, state, rng_counter=3)
    for name, fmt in (("p.bin", "TLPF32B"), ("p.json", "torchlean_paramlist_bits_v1"),
                      ("s.json", "torchlean_state_bits_v1")):
        dest = tied_params()
        dest.set_values([torch.zeros(2), torch.tensor(0.0), torch.zeros(2)])
        assert tio.load(tmp_path / name, dest).format == fmt
        assert all(torch.equal(a, b) for a, b in zip(dest.values(), params.values()))
    loaded = tio.load(tmp_path / "a.bin", tied_params(), opt)
    assert loaded.format == "TLADAMF" and loaded.adam.counter == 3
    (tmp_path / "x").write_bytes(b"nothing")
    with pytest.raises(lt.CheckpointError, match="not a TorchLean file"):
        tio.load(tmp_path / "x", params)


def test_export_and_inspect_from_the_command(tmp_path, capsys):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    r = lt.Runner.from_module(net, "mse")
    data = [(torch.randn(5, 3), torch.randn(5, 2)) for _ in range(3)]
    lt.train_samples(r, lt.TrainConfig(steps=3, optimizer=optim.adamw(0.01), log_every=0,
                                       checkpoint_path=tmp_path / "c.ckpt"), data)
    assert main(["export", str(tmp_path / "c.ckpt"), "--torchlean", "-o", str(tmp_path / "m.tlp")]) == 0
    out = capsys.readouterr().out
    assert "m.tlp (TLPF32B" in out and "m.tlp.adam (TLADAMF, adamw, step 3)" in out
    fresh = lt.Runner.from_module(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                                      torch.nn.Linear(4, 2)), "mse")
    tio.read_torchlean_f32(tmp_path / "m.tlp", fresh)
    for a, b in zip(fresh.params.values(), r.params.values()):
        assert torch.equal(a, b.float())
    adam = tio.read_torchlean_adam(tmp_path / "m.tlp.adam", fresh, optim.adamw(0.01), with_counter=False)
    assert adam.state.steps == 3
    for name in ("m.tlp", "m.tlp.adam"):
        assert main(["inspect", str(tmp_path / name)]) == 0
        assert "structure: OK" in capsys.readouterr().out
    tio.write_torchlean_state(tmp_path / "s.json", fresh)
    assert main(["inspect", str(tmp_path / "s.json")]) == 0
    assert "torchlean_state_bits_v1" in capsys.readouterr().out
    (tmp_path / "t.tlp").write_bytes((tmp_path / "m.tlp").read_bytes()[:-3])
    assert main(["inspect", str(tmp_path / "t.tlp")]) == 2


def _trained_checkpoint(path, opt):
    torch.manual_seed(0)
    r = lt.Runner.from_module(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), "mse")
    data = [(torch.randn(5, 3), torch.randn(5, 2)) for _ in range(3)]
    lt.train_samples(r, lt.TrainConfig(steps=3, optimizer=opt, log_every=0, checkpoint_path=path), data)
    return r


def test_export_never_writes_over_its_own_checkpoint(tmp_path, capsys):
    ck = tmp_path / "c.ckpt"
    _trained_checkpoint(ck, optim.adam(0.01))
    before = ck.read_bytes()
    for fmt in ("--weights", "--torchlean"):
        assert main(["export", str(ck), fmt, "-o", str(ck)]) == 2
        assert "would write over the checkpoint being exported" in capsys.readouterr().err
    assert ck.read_bytes() == before
    named = tmp_path / "m.adam"  # -o m would write its state to m.adam: the checkpoint
    named.write_bytes(before)
    assert main(["export", str(named), "--torchlean", "-o", str(tmp_path / "m")]) == 2
    assert "would write over the checkpoint" in capsys.readouterr().err
    assert named.read_bytes() == before and not (tmp_path / "m").exists()


def test_export_with_per_slot_settings_writes_the_parameters_and_says_why_not_the_state(tmp_path, capsys):
    ck = tmp_path / "c.ckpt"
    _trained_checkpoint(ck, optim.adamw(0.01, 0.1).per_slot(lambda p: {"weight_decay": 0.0} if len(p.shape) < 2 else {}))
    assert main(["export", str(ck), "--torchlean", "-o", str(tmp_path / "m.tlp")]) == 0
    out = capsys.readouterr().out
    assert "m.tlp (TLPF32B" in out and "per-slot hyperparameters" in out
    assert not (tmp_path / "m.tlp.adam").exists()


def test_an_export_without_state_removes_an_earlier_exports_state(tmp_path, capsys):
    adam_ck, sgd_ck = tmp_path / "a.ckpt", tmp_path / "s.ckpt"
    _trained_checkpoint(adam_ck, optim.adam(0.01))
    _trained_checkpoint(sgd_ck, optim.sgd(0.01))
    assert main(["export", str(adam_ck), "--torchlean", "-o", str(tmp_path / "m.tlp")]) == 0
    assert (tmp_path / "m.tlp.adam").exists()
    assert main(["export", str(sgd_ck), "--torchlean", "-o", str(tmp_path / "m.tlp")]) == 0
    out = capsys.readouterr().out
    assert "holds Adam/AdamW, this is sgd" in out and "removed" in out
    assert not (tmp_path / "m.tlp.adam").exists()


def _u64s(*xs):
    return b"".join(struct.pack("<Q", x) for x in xs)


@pytest.mark.parametrize("name, data, needle", [
    ("v9.tlp", b"TLPF32B" + _u64s(9, 0), "unsupported format version 9"),
    ("count.tlp", b"TLPF32B" + _u64s(2, 1, 1, 3, 4) + b"\0" * 16, "element count 4 does not match the shape (3,)"),
    ("nan.adam", b"TLADAMF" + _u64s(2, 0) + struct.pack("<dddd", math.nan, 0.999, 1e-8, 0.0) + _u64s(0, 0),
     "invalid optimizer config"),
    ("tag.adam", b"TLADAMF" + _u64s(2, 7), "unknown optimizer kind tag 7"),
    ("params.json", b'{"format": "torchlean_param_bits_v1", "params": 5}', "'params' is a list"),
    ("shape.json", b'{"format": "torchlean_param_bits_v1", "params": [{"shape": "x"}]}', "record 0: expected a shape"),
    ("deep.json", b'{"format": "torchlean_param_bits_v1", "params": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "not a readable JSON file"),
])
def test_inspect_refuses_what_the_readers_refuse(tmp_path, capsys, name, data, needle):
    path = tmp_path / name
    path.write_bytes(data)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
