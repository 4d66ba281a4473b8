"""Gradient packs and canonical gradients (spec §2, §7.1)."""

import pytest
import torch

import leantrain as lt


def t(*vals):
    return torch.tensor(vals)


def test_canonical_gradients_sum_left_to_right_and_drop_frozen():
    a, b, c, f = t(1.0), t(2.0), t(3.0), t(100.0)
    sums = lt.canonical_gradients([None, 1, 2, 1], [f, a, b, c])
    assert sums[0] is None and sums[3] is None
    assert sums[1].item() == 4.0 and sums[2] is b


def test_a_tie_sums_a_sparse_and_a_dense_gradient_in_either_order():
    dense, sparse = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.0, -1.0]).to_sparse()
    for pack in ([sparse, dense], [dense, sparse]):
        (total, alias) = lt.canonical_gradients([0, 0], pack)
        assert alias is None and torch.equal(total.to_dense(), torch.tensor([1.5, 2.0, 2.0]))
    opt = lt.optim.sgd(0.5)  # SGD takes sparse gradients: the tie's one update uses the sum
    params = lt.ParamList([lt.Param(torch.zeros(3), name="w")])
    tied = lt.ParamList([params[0], lt.Param.of_storage(params[0].storage, name="w2")])
    opt.step(opt.init(tied), tied, [sparse, dense])
    assert torch.equal(params[0].storage.host, torch.tensor([-0.75, -1.0, -1.0]))


def test_canonical_gradients_rejects_mixed_shapes():
    with pytest.raises(lt.PackError, match=r"slot 1: gradient does not match its representative slot 0"):
        lt.canonical_gradients([0, 0], [torch.zeros(()), torch.zeros(1)])


@pytest.mark.parametrize(
    "slots, pattern",
    [
        ([0, 2, 2], r"slot 1: invalid canonical slot 2"),  # c > i
        ([None, 0], r"slot 1: invalid canonical slot 0"),  # points at a frozen slot
        ([0, 0, 1], r"slot 2: invalid canonical slot 1"),  # points at a non-representative
        ([0, -1], r"slot 1: invalid canonical slot -1"),
        ([0, "0"], r"slot 1: invalid canonical slot '0'"),
    ],
)
def test_canonical_gradients_rejects_bad_maps(slots, pattern):
    grads = [torch.zeros(2)] * len(slots)
    with pytest.raises(lt.PackError, match=pattern):
        lt.canonical_gradients(slots, grads)


def test_canonical_gradients_rejects_length_and_missing():
    with pytest.raises(lt.PackError, match="map has 2 slots, gradient pack has 1"):
        lt.canonical_gradients([0, 1], [torch.zeros(1)])
    with pytest.raises(lt.PackTypeError, match=r"slot 1 \('w'\): expected a gradient tensor, got missing"):
        lt.canonical_gradients([0, 1], [torch.zeros(1), None], names=["b", "w"])


def test_canonical_gradient_reads_and_checks():
    sums = lt.canonical_gradients([0, 0, None], [t(1.0), t(2.0), t(5.0)])
    assert lt.canonical_gradient((1,), sums, 0).item() == 3.0
    with pytest.raises(lt.PackError, match="slot 1: no canonical gradient"):
        lt.canonical_gradient((1,), sums, 1)
    with pytest.raises(lt.PackError, match=r"slot 0: expected shape \(2,\), got \(1,\)"):
        lt.canonical_gradient((2,), sums, 0)
    with pytest.raises(lt.PackError, match="slot 7: no canonical gradient"):
        lt.canonical_gradient((1,), sums, 7)


def test_add_and_scale_gradient_packs_materialize():
    a, b = [t(1.0, 2.0), None], [t(3.0, 4.0), None]
    s = lt.add_gradient_packs(a, b)
    assert s[0].tolist() == [4.0, 6.0] and s[1] is None and s[0] is not a[0]
    m = lt.scale_gradient_pack(0.5, s)
    assert m[0].tolist() == [2.0, 3.0] and m[0] is not s[0]
    with pytest.raises(lt.PackError, match=r"slot 0: shape mismatch: \(2,\)"):
        lt.add_gradient_packs([t(1.0, 2.0)], [t(1.0)])
    with pytest.raises(lt.PackError, match="pack length mismatch: 1 vs 2"):
        lt.add_gradient_packs([t(1.0)], [t(1.0), t(2.0)])
