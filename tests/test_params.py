"""ParamList: slots, storage identity, canonical map, host/mirror ownership (spec §1, §2, §10.1)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import leantrain as lt
from leantrain import Param, ParamList


def t(*vals):
    return torch.tensor(vals, dtype=torch.float32)


def test_frozen_first_occurrence_never_owns_a_history():
    p, q = Param(t(1.0)), Param(t(2.0))
    params = ParamList([p.view(requires_grad=False), p, q, p])
    assert params.canonical_slot_indices() == [None, 1, 2, 1]
    assert params.requires_grad_array() == [False, True, True, True]
    storages = params.optimizer_storage()
    assert storages[0] is None and storages[1] is storages[3] is p.storage


def test_identity_is_the_storage_not_name_or_contents():
    p, q = Param(t(1.0), name="p"), Param(t(2.0), name="q")
    renamed = p.view(name="other")
    same_values = Param(t(1.0), name="p")  # equal contents and name: a different storage
    vec = Param(t(1.0, 2.0))
    params = ParamList([p, q, renamed, same_values, vec, p.view(requires_grad=False), p])
    before = params.canonical_slot_indices()
    assert before == [0, 1, 0, 3, 4, None, 0]
    params.set_values([t(9.0), t(8.0), t(7.0), t(6.0), t(1.0, 1.0), t(5.0), t(4.0)])
    assert params.canonical_slot_indices() == before  # contents changes never change identity


def test_retie_and_untie_are_honoured_every_call():
    p = Param(t(1.0))
    for _ in range(4):
        assert ParamList([p, p]).canonical_slot_indices() == [0, 0]
        assert ParamList([p, Param(t(1.0))]).canonical_slot_indices() == [0, 1]


def test_fresh_allocations_never_reuse_a_decision():
    for _ in range(128):
        fresh, other = Param(t(0.0)), Param(t(0.0))
        assert ParamList([fresh, other, fresh]).canonical_slot_indices() == [0, 1, 0]


def test_of_pack_never_aliases_and_copies():
    x = t(1.0, 2.0)
    params = ParamList.of_pack([x, x])
    assert params.canonical_slot_indices() == [0, 1]
    x.add_(1.0)
    assert torch.equal(params.values()[0], t(1.0, 2.0))


def test_of_pack_with_requires_grad_mask():
    params = ParamList.of_pack_with_requires_grad([t(1.0), t(2.0)], [True, False])
    assert params.requires_grad_array() == [True, False]
    assert params.canonical_slot_indices() == [0, None]
    with pytest.raises(lt.PackError, match="shorter than the pack: expected 2 flags, got 1"):
        ParamList.of_pack_with_requires_grad([t(1.0), t(2.0)], [True])
    with pytest.raises(lt.PackError, match="longer than the pack: expected 0 flags, got 1"):
        ParamList.of_pack_with_requires_grad([], [True])
    with pytest.raises(lt.PackTypeError, match="flag 1: expected a bool"):
        ParamList.of_pack_with_requires_grad([t(1.0), t(2.0)], [True, 1])


def test_values_are_snapshots_in_slot_order():
    p = Param(t(1.0))
    params = ParamList([p, Param(t(2.0, 3.0)), p])
    vals = params.values()
    assert [v.tolist() for v in vals] == [[1.0], [2.0, 3.0], [1.0]]
    vals[0].add_(100.0)
    assert params.values()[0].item() == 1.0


def test_set_values_last_alias_wins_and_frozen_slots_are_written():
    p = Param(t(1.0))
    params = ParamList([p, p.view(requires_grad=False), p])
    params.set_values([t(5.0), t(6.0), t(7.0)])
    assert p.storage.host.item() == 7.0


@pytest.mark.parametrize(
    "pack, error, pattern",
    [
        ([t(1.0)], lt.PackError, r"set_values: pack length mismatch: expected 2 tensors .*got 1"),
        ([t(1.0), t(1.0)], lt.PackError, r"slot 1 \('w'\): expected shape \(2,\), got \(1,\)"),
        (
            [t(1.0), torch.zeros(2, dtype=torch.float64)],
            lt.PackError,
            r"slot 1 \('w'\): expected dtype torch.float32, got torch.float64",
        ),
        ([t(1.0), [1.0, 2.0]], lt.PackTypeError, r"slot 1 \('w'\): expected a torch.Tensor, got list"),
        ("nope", lt.PackTypeError, "expected a list of tensors, got str"),
    ],
)
def test_set_values_rejects_before_writing(pack, error, pattern, unchanged):
    params = ParamList([Param(t(1.0), name="b"), Param(t(2.0, 3.0), name="w")])
    params.to_device("cpu")
    with unchanged(params), pytest.raises(error, match=pattern):
        params.set_values(pack)


def test_mirror_ownership_on_cpu_mirrors():
    p = Param(t(1.0, 2.0))
    params = ParamList([p, p]).to_device("cpu")
    s = p.storage
    assert s.mirror is not None and s.mirror.data_ptr() != s.host.data_ptr()
    assert s.host_current
    s.write_mirror(t(5.0, 6.0))  # a device write: host becomes stale
    assert not s.host_current
    assert params.values()[0].tolist() == [1.0, 2.0]  # values() never syncs
    assert params.values_synced()[1].tolist() == [5.0, 6.0]
    assert s.host_current and s.mirror is not None  # the mirror is kept after a sync
    params.set_values([t(7.0, 7.0), t(8.0, 8.0)])  # a host write drops the mirror
    assert s.mirror is None and s.host_current and s.host.tolist() == [8.0, 8.0]


def test_mirror_shape_mismatch_rejected(unchanged):
    p = Param(t(1.0, 2.0))
    params = ParamList([p]).to_device("cpu")
    with unchanged(params), pytest.raises(lt.PackError, match=r"expected \(2,\), got \(3,\)"):
        p.storage.write_mirror(t(1.0, 2.0, 3.0))


@pytest.mark.cuda
def test_cuda_mirror_round_trip():
    p = Param(t(1.0, 2.0))
    params = ParamList([p]).to_device("cuda")
    assert p.storage.mirror.is_cuda
    p.storage.mirror.add_(1.0)
    p.storage.host_current = False
    assert params.values()[0].tolist() == [1.0, 2.0]
    assert params.values_synced()[0].tolist() == [2.0, 3.0]


def test_paramlist_rejects_non_params():
    with pytest.raises(lt.PackTypeError, match="slot 1: expected a Param, got Tensor"):
        ParamList([Param(t(1.0)), t(2.0)])
    with pytest.raises(lt.PackTypeError, match="Param: expected a torch.Tensor"):
        Param([1.0])


# --------------------------------------------------------------- properties
@st.composite
def layouts(draw):
    """Random slot layouts over a few storages: repeats and frozen views."""
    n_storages = draw(st.integers(1, 4))
    shapes = [draw(st.sampled_from([(), (2,), (2, 3)])) for _ in range(n_storages)]
    n_slots = draw(st.integers(0, 9))
    slots = [(draw(st.integers(0, n_storages - 1)), draw(st.booleans())) for _ in range(n_slots)]
    return shapes, slots


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_canonical_map_properties(layout):
    shapes, slots = layout
    base = [Param(torch.randn(s)) for s in shapes]
    params = ParamList([base[k].view(requires_grad=trainable) for k, trainable in slots])
    m = params.canonical_slot_indices()
    assert len(m) == len(slots)  # never compressed
    for i, (k, trainable) in enumerate(slots):
        if not trainable:
            assert m[i] is None
            continue
        first = next(j for j, (kk, tr) in enumerate(slots) if kk == k and tr)
        assert m[i] == first and m[first] == first  # first trainable occurrence, no chains
    assert ParamList(list(params)).canonical_slot_indices() == m  # nothing cached


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(0, 2**16))
def test_canonical_sums_equal_per_storage_sums(layout, seed):
    shapes, slots = layout
    gen = torch.Generator().manual_seed(seed)
    base = [Param(torch.randn(s, generator=gen)) for s in shapes]
    params = ParamList([base[k].view(requires_grad=tr) for k, tr in slots])
    grads = [torch.randn(base[k].shape, generator=gen) for k, _ in slots]
    sums = lt.canonical_gradients(params.canonical_slot_indices(), grads)
    for k in range(len(shapes)):
        occ = [i for i, (kk, tr) in enumerate(slots) if kk == k and tr]
        if not occ:
            continue
        expected = grads[occ[0]]
        for i in occ[1:]:
            expected = expected + grads[i]  # left to right, in slot order
        assert torch.equal(sums[occ[0]], expected)
        if len(occ) == 1:
            assert sums[occ[0]] is grads[occ[0]]  # an unaliased slot keeps its gradient as is
        assert all(sums[i] is None for i in occ[1:])
