"""Dataset and DataLoader: the upstream LCG shuffle, batching, drop_last (spec §8)."""

import pytest

import leantrain as lt
from leantrain import DataLoader, Dataset


def lcg_order(items, seed):
    s, keyed = seed, []
    for i, x in enumerate(items):
        s = (1103515245 * s + 12345) % 2**31
        keyed.append((s, x))
    keyed.sort(key=lambda e: e[0])
    return s, [x for _, x in keyed]


def test_shuffle_reproduces_the_lcg_formula():
    items = list(range(10))
    seed, ds = Dataset(items).shuffle(42)
    assert (seed, ds.to_list()) == lcg_order(items, 42)


def test_shuffled_order_persists_and_compounds():
    dl = DataLoader(Dataset(list(range(7))), batch_size=3, shuffle=True, seed=5)
    dl1, b1 = dl.epoch()
    s1, order1 = lcg_order(list(range(7)), 5)
    assert [x for b in b1 for x in b] == order1 and dl1.seed == s1
    dl2, b2 = dl1.epoch()
    s2, order2 = lcg_order(order1, s1)  # the shuffled order is shuffled again
    assert [x for b in b2 for x in b] == order2 and dl2.seed == s2
    assert [len(b) for b in b2] == [3, 3, 1]
    assert dl.dataset.to_list() == list(range(7))  # the loader itself is immutable


def test_batches_and_drop_last():
    dl = DataLoader(Dataset(list(range(5))), batch_size=2, drop_last=True)
    _, batches = dl.epoch()
    assert batches == [[0, 1], [2, 3]] and len(dl) == 2
    _, batches = DataLoader(Dataset(list(range(5))), batch_size=2).epoch()
    assert batches == [[0, 1], [2, 3], [4]]
    _, batches = DataLoader(Dataset([1]), batch_size=3, drop_last=True).epoch()
    assert batches == []  # everything dropped: no updates, no error


def test_loader_rejections():
    with pytest.raises(lt.ConfigError, match="batch_size must be an integer >= 1, got 0"):
        DataLoader(Dataset([1]), batch_size=0)
    with pytest.raises(lt.ConfigError, match="seed must be an integer >= 0, got -1"):
        DataLoader(Dataset([1]), batch_size=1, seed=-1)
    with pytest.raises(lt.DataError, match="train_loader: empty dataset"):
        DataLoader(Dataset([]), batch_size=1).epoch("train_loader")


def test_dataset_helpers():
    ds = Dataset([1, 2, 3])
    assert ds.size == 3 and not ds.is_empty() and ds.get(5) is None and ds.get(1) == 2
    a, b = ds.split_at(1)
    assert a.to_list() == [1] and b.to_list() == [2, 3]
    assert ds.map(lambda x: x * 2).append(Dataset([0])).to_list() == [2, 4, 6, 0]


@pytest.mark.parametrize("n", [0, 1, 2, 1023, 1024, 1025, 2049, 10_007])
@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 1])
def test_the_vectorised_shuffle_is_upstreams_order(seed, n):
    """Keys by the LCG's block jump and a stable argsort: the same order and next seed as
    the per-item form at every length, block edges included (benchmarks/shuffle.py: 1.9 s
    -> 0.13 s per epoch at 1M items)."""
    from leantrain.data import lcg_permutation, lcg_permutation_per_item

    assert lcg_permutation(seed, n) == lcg_permutation_per_item(seed, n)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_for_over_a_loader_is_one_pass_and_the_next_for_the_next_pass(lazy):
    """#70: ``for batch in loader`` works as a torch user expects: each ``for`` one pass,
    the batches ``epoch()`` gives, the next ``for`` the next pass's shuffle; ``epoch()``
    keeps the value form; a loader given to ``train_loader`` after a ``for`` starts from
    the pass it stands at."""
    import torch
    items = [(torch.tensor([float(i)]), torch.tensor([float(i)])) for i in range(10)]

    class MapStyle:  # a torch-style map dataset: read by index, never copied
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            return items[i]

    source = MapStyle() if lazy else items

    def make():
        return lt.DataLoader(source, batch_size=4, shuffle=True, seed=7)

    first_next, first = make().epoch()
    _, second = first_next.epoch()
    loader = make()
    same = lambda a, b: len(a) == len(b) and all(  # noqa: E731
        len(x) == len(y) and all(torch.equal(p[0], q[0]) for p, q in zip(x, y)) for x, y in zip(a, b))
    assert same([b for b in loader], first) and same([b for b in loader], second)
    assert not same(first, second)
    fresh = make()
    _, again = fresh.epoch()
    assert same(again, first) and same([b for b in fresh], first)  # epoch() changed nothing
