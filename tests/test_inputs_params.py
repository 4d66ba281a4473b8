"""Bad input to the parameter packs and lists (``ParamList``, ``set_values``, the gradient
packs, storages, ``from_module``): one table, then the packs without dense data."""

import pytest
import torch

import leantrain as lt
from leantrain import ParamList
from inputs_table import native_params, check_row, g2, g3, ids, overlapping

PACKS = [
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
    ("module overlap", lambda c: ParamList.from_module(overlapping()), lt.AliasError, "overlap in memory"),
    ("from_module non-module", lambda c: ParamList.from_module(3), lt.PackTypeError, "expected a torch.nn.Module"),
]


@pytest.mark.parametrize("name, call, error, pattern", PACKS, ids=ids(PACKS))
def test_packs_rejects_and_changes_nothing(name, call, error, pattern, tmp_path):
    check_row(call, error, pattern, tmp_path)


@pytest.mark.parametrize("bad", [
    lambda: torch.empty(2, device="meta"),
    lambda: torch.zeros(2).to_sparse(),
    lambda: torch.zeros(1, 2).to_sparse_csr(),
    lambda: torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.quint8),
])
def test_set_values_refuses_tensors_without_dense_data_before_writing(bad, unchanged):
    params = native_params()  # the trained values live in the mirrors; the hosts are stale
    trained = [s.mirror.clone() for s in params.storages()]
    with unchanged(params), pytest.raises(lt.PackError, match="slot 1 \\('b'\\): expected a dense tensor"):
        params.set_values([torch.zeros(3), bad()])
    assert all(s.mirror is not None and torch.equal(s.mirror, t) for s, t in zip(params.storages(), trained))


