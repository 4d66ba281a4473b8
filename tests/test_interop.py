"""Weights export/import and TorchLean's own parameter formats (spec §9.4, §10.3)."""

import json
import struct

import pytest
import torch

import leantrain as lt
from leantrain import Param, ParamList
from leantrain.torchlean_io import (
    read_torchlean_bits, read_torchlean_f32, write_torchlean_bits, write_torchlean_f32,
)
from leantrain.weights import export_state_dict, import_state_dict, load_weights, save_weights
from models import TiedNet


def u64(n):
    return struct.pack("<Q", n)


def test_float32_stream_bytes_are_pinned(tmp_path):
    params = ParamList([Param(torch.tensor([1.0, -2.5]))])
    write_torchlean_f32(tmp_path / "p.bin", params)
    payload = bytes.fromhex("0000803f000020c0")
    assert (tmp_path / "p.bin").read_bytes() == b"TLPF32B" + u64(2) + u64(1) + u64(1) + u64(2) + u64(2) + payload
    dest = ParamList([Param(torch.zeros(2))])
    read_torchlean_f32(tmp_path / "p.bin", dest)
    assert dest.values()[0].tolist() == [1.0, -2.5]


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda b: b[:-1], r"truncated checkpoint \(wanted 8 bytes, got 7\)"),
        (lambda b: b[:7] + u64(3) + b[15:], "unsupported format version 3; expected 2"),
        (lambda b: b"TLPF32X" + b[7:], "unsupported checkpoint family"),
        (lambda b: b + b"\x00", "1 trailing bytes"),
    ],
)
def test_float32_stream_rejections_leave_parameters(tmp_path, mutate, pattern, unchanged):
    write_torchlean_f32(tmp_path / "p.bin", ParamList([Param(torch.tensor([1.0, -2.5]))]))
    (tmp_path / "p.bin").write_bytes(mutate((tmp_path / "p.bin").read_bytes()))
    dest = ParamList([Param(torch.zeros(2))])
    with unchanged(dest), pytest.raises(lt.CheckpointError, match=pattern):
        read_torchlean_f32(tmp_path / "p.bin", dest)
    assert dest.values()[0].tolist() == [0.0, 0.0]


def test_float32_stream_writes_every_slot_frozen_and_aliases_too(tmp_path):
    r = lt.Runner.from_module(TiedNet(), "mse")
    write_torchlean_f32(tmp_path / "m.bin", r)
    data = (tmp_path / "m.bin").read_bytes()
    assert struct.unpack("<Q", data[15:23])[0] == len(r.params)
    other = lt.Runner.from_module(TiedNet(), "mse")
    read_torchlean_f32(tmp_path / "m.bin", other)
    for a, b in zip(r.params.values(), other.params.values()):
        assert torch.equal(a, b)


def test_json_bits_round_trip_and_rejections(tmp_path, unchanged):
    params = ParamList([Param(torch.tensor([1.0, -2.5], dtype=torch.float64)), Param(torch.tensor(0.1, dtype=torch.float64))])
    write_torchlean_bits(tmp_path / "p.json", params)
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["format"] == "torchlean_paramlist_bits_v1"
    assert doc["params"][0] == {"shape": [2], "values": [0x3FF0000000000000, 0xC004000000000000]}
    dest = ParamList([Param(torch.zeros(2, dtype=torch.float64)), Param(torch.tensor(0.0, dtype=torch.float64))])
    read_torchlean_bits(tmp_path / "p.json", dest)
    assert dest.values()[1].item() == 0.1
    bad = dict(doc, params=doc["params"] + [doc["params"][1]])
    (tmp_path / "t.json").write_text(json.dumps(bad))
    fresh = ParamList([Param(torch.zeros(2, dtype=torch.float64)), Param(torch.tensor(0.0, dtype=torch.float64))])
    with unchanged(fresh), pytest.raises(lt.CheckpointError, match="unexpected 1 trailing parameter record"):
        read_torchlean_bits(tmp_path / "t.json", fresh)
    (tmp_path / "m.json").write_text(json.dumps(dict(doc, params=doc["params"][:1])))
    with unchanged(fresh), pytest.raises(lt.CheckpointError, match="missing parameter 1/2"):
        read_torchlean_bits(tmp_path / "m.json", fresh)
    big = json.loads(json.dumps(doc))
    big["params"][0]["values"][0] = 2**64
    (tmp_path / "b.json").write_text(json.dumps(big))
    with unchanged(fresh), pytest.raises(lt.CheckpointError, match="below 2\\^64"):
        read_torchlean_bits(tmp_path / "b.json", fresh)


def test_state_dict_export_loads_into_the_module_with_ties():
    torch.manual_seed(0)
    r = lt.Runner.from_module(TiedNet(), "mse")
    sd = export_state_dict(r)
    assert sd["mid.weight"] is sd["out.weight"]
    fresh = TiedNet()
    fresh.load_state_dict(sd)
    assert fresh.out.weight is fresh.mid.weight
    assert torch.equal(fresh.mid.weight, r.module.mid.weight)


def test_safetensors_weights_write_shared_tensors_once(tmp_path):
    from safetensors import safe_open

    torch.manual_seed(1)
    r = lt.Runner.from_module(TiedNet(), "mse")
    save_weights(tmp_path / "w.safetensors", r)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert "out.weight" not in f.keys() and "mid.weight" in f.keys()
        assert json.loads(f.metadata()["aliases"]) == {"out.weight": "mid.weight"}
    other = lt.Runner.from_module(TiedNet(), "mse")
    assert load_weights(tmp_path / "w.safetensors", other) == []
    for a, b in zip(r.params.values(), other.params.values()):
        assert torch.equal(a, b)


def test_import_reports_every_mismatch_and_changes_nothing(unchanged):
    r = lt.Runner.from_module(TiedNet(), "mse")
    sd = {k: v.clone() for k, v in export_state_dict(r).items()}
    sd["inp.weight"] = torch.zeros(2, 2)
    del sd["mid.bias"]
    sd["extra"] = torch.zeros(1)
    sd["out.weight"] = sd["out.weight"] + 1  # disagrees with its tie
    with unchanged(r.params), pytest.raises(lt.CheckpointError) as err:
        import_state_dict(r, sd)
    msg = str(err.value)
    for part in ["slot 0 ('inp.weight'): expected (6, 4) float32, got (2, 2)", "slot 2 ('mid.bias'): missing",
                 "unexpected entry 'extra'", "is tied to slot 1 ('mid.weight') but the weights differ"]:
        assert part in msg, part
