"""Mutated checkpoint files always raise CheckpointError and leave the destination alone."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leantrain as lt
from leantrain import Param, ParamList, optim
from filetools import edit_manifest


def build(frozen_value=0.5):
    p = Param(torch.tensor([1.0, -2.5, 3.0]), name="w")
    b = Param(torch.tensor([0.25, 0.75]), name="b")
    return ParamList([p, b, Param(torch.tensor(frozen_value), name="f", requires_grad=False), p])


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    params = build()
    opt = optim.adam(0.1)
    state = opt.init(params)
    for k in range(3):
        state = opt.step(state, params, [torch.ones(3) * k, torch.ones(2), torch.zeros(()), torch.ones(3)])
    path = tmp_path_factory.mktemp("fuzz") / "v.ckpt"
    lt.save_checkpoint(path, params, state=state, progress={"step": 3}, rng=False)
    return path.read_bytes()


def header_span(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


EDITS = {
    "shape": lambda m: m["slots"][1].__setitem__("shape", [3]),
    "dtype": lambda m: m["slots"][0].__setitem__("dtype", "float64"),
    "alias map": lambda m: m.__setitem__("representatives", [0, 1, None, 1]),
    "frozen mask": lambda m: m["slots"][2].__setitem__("requires_grad", True),
    "no slots": lambda m: m.pop("slots"),
    "optimizer kind": lambda m: m["optimizer"].__setitem__("kind", "sgd"),
    "bad hyper": lambda m: m["optimizer"]["hyper"].__setitem__("beta1", 1.5),
    "lost record": lambda m: m["optimizer"]["records"].pop("0"),
    "checksum": lambda m: m["checksums"].__setitem__("storage.0", 12345),
    "version": lambda m: m.__setitem__("version", 99),
    "record tensors": lambda m: m["optimizer"]["records"]["0"].__setitem__("tensors", []),
    "record scalar": lambda m: m["optimizer"]["records"]["0"]["scalars"].pop("step"),
    "lr not a number": lambda m: m["optimizer"].__setitem__("lr", "fast"),
    "records keys": lambda m: m["optimizer"].__setitem__("records", {"x": {}}),
    "slots not objects": lambda m: m.__setitem__("slots", [1, 2, 3, 4]),
    "claims rng": lambda m: m["rng"].__setitem__("torch", True),
    "claims loader": lambda m: m.__setitem__("loader", {"seed": 1}),
}


def swap_tensors(data: bytes) -> bytes:
    """Exchange the data ranges of two tensors of the same size (their bytes differ)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    a, b = "state.0.m", "state.0.v"
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


mutations = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0.0, 0.999)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0.0, 0.9999), st.integers(0, 7)), min_size=1, max_size=3)),
    st.tuples(st.just("edit"), st.sampled_from(sorted(EDITS)), st.booleans()),
    st.tuples(st.just("swap")),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=16)),
)


def mutate(data: bytes, m) -> bytes:
    kind = m[0]
    if kind == "truncate":
        return data[: int(m[1] * len(data))]
    if kind == "flip":
        out = bytearray(data)
        flips = {}
        for pos, bit in m[1]:
            flips.setdefault(int(pos * len(out)), bit)  # one bit per byte: a real change, never whitespace
        for index, bit in flips.items():
            out[index] ^= 1 << bit
        return bytes(out)
    if kind == "edit":
        return edit_manifest(data, EDITS[m[1]], reseal=m[2])
    if kind == "swap":
        return swap_tensors(data)
    return data + m[1]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations)
def test_mutated_files_are_rejected_and_change_nothing(valid, tmp_path, m):
    path = tmp_path / "m.ckpt"
    path.write_bytes(mutate(valid, m))
    dest = build(frozen_value=9.0).to_device("cpu")
    before = [(s.host.clone(), None if s.mirror is None else s.mirror.clone()) for s in dest.storages()]
    with pytest.raises(lt.CheckpointError):
        lt.load_checkpoint(path, dest, optimizer=optim.adam(0.1))
    for (h, mirror), s in zip(before, dest.storages()):
        assert torch.equal(h, s.host) and torch.equal(mirror, s.mirror)


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_every_resealed_manifest_edit_is_rejected(valid, tmp_path, edit):
    """Edits that keep the manifest's own checksum valid must still fail validation."""
    path = tmp_path / "e.ckpt"
    path.write_bytes(edit_manifest(valid, EDITS[edit], reseal=True))
    dest = build(frozen_value=9.0)
    before = [t.clone() for t in dest.values()]
    with pytest.raises(lt.CheckpointError):
        lt.load_checkpoint(path, dest, optimizer=optim.adam(0.1))
    assert all(torch.equal(a, b) for a, b in zip(before, dest.values()))


def test_the_unmutated_file_loads(valid, tmp_path):
    path = tmp_path / "v.ckpt"
    path.write_bytes(valid)
    dest = build(frozen_value=9.0)
    ck = lt.load_checkpoint(path, dest, optimizer=optim.adam(0.1))
    assert ck.state.slots[0].step == 3 and dest.values()[2].item() == 0.5
