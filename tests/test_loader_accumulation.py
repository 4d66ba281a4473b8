"""LoaderTrainConfig(accumulate=K): K consecutive loader batches are one update with
the list-batch semantics (the mean over all their items; an epoch's short tail group is
its own mean), the step counter counts updates, and a resume between groups is exact."""

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim
from models import TiedNet, regression_batches
from optimizer_table import TABLE


def items(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 6, generator=g)) for _ in range(n)]


def runner(seed=0):
    torch.manual_seed(seed)
    return lt.Runner.from_module(TiedNet(bn=True), "mse")


@pytest.mark.parametrize("kind", sorted(TABLE))
@pytest.mark.parametrize("k", [1, 2, 3, 7, 9])
def test_groups_of_loader_batches_are_list_batches(k, kind):
    opt = TABLE[kind].make()
    data = items(14)
    batches = [data[i:i + 2] for i in range(0, 14, 2)]  # 7 loader batches of 2 items
    a, b = runner(), runner()
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=opt, log_every=1, accumulate=k, measure_loss=False)
    report, _ = lt.train_loader(a, cfg, batches, log=lambda s: None)
    groups = [sum(batches[i:i + k], []) for i in range(0, 7, k)]  # the tail group is shorter
    state = opt.init(b.params)
    losses = []
    for _ in range(2):
        for group in groups:
            state, loss = lt.step_batch_and_loss(b, opt, state, False, group)
            losses.append(loss)
    assert report.steps == 2 * len(groups) == state.steps
    assert [s for s, _ in report.losses] == list(range(1, report.steps + 1))  # updates numbered from 1
    assert [v for _, v in report.losses] == losses
    assert all(torch.equal(x, y) for x, y in zip(a.params.values(), b.params.values()))


def test_equal_to_plain_pytorch_accumulation():
    """A hand-written loop: each group's summed item losses times 1/n, one backward, one step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    ref = copy.deepcopy(model)
    data = items(8)
    batches = [data[0:2], data[2:4], data[4:6], data[6:8]]
    lt.train_loader(lt.Runner.from_module(model, "mse"),
                    lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), log_every=0, accumulate=2), batches)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for group in (data[0:4], data[4:8]):
        opt.zero_grad()
        total = None
        for x, y in group:
            loss = torch.nn.functional.mse_loss(ref(x), y)
            total = loss if total is None else total + loss
        (total * 0.25).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stop_at", [1, 2, 4])
def test_a_resume_between_groups_is_exact(tmp_path, stop_at):
    data = regression_batches(11, 2)  # items of two rows (BatchNorm needs more than one)

    def loader():
        return lt.DataLoader(lt.Dataset(data), batch_size=2, shuffle=True, seed=3)

    cfg = lt.LoaderTrainConfig(epochs=3, optimizer=optim.adam(0.01), log_every=1, accumulate=2,
                               checkpoint_path=tmp_path / "a.ckpt")
    straight = runner()
    full, _ = lt.train_loader(straight, cfg, loader(), log=lambda s: None)
    assert full.steps == 3 * 3  # 6 loader batches per epoch, 3 groups
    first = runner()
    lt.train_loader(first, lt.LoaderTrainConfig(**{**cfg.__dict__, "checkpoint_path": tmp_path / "b.ckpt"}), loader(),
                    log=lambda s: None, callback=lambda ev: ev.step == stop_at)
    resumed = runner(seed=9)
    cfg_b = lt.LoaderTrainConfig(**{**cfg.__dict__, "checkpoint_path": tmp_path / "c.ckpt",
                                    "resume_from": tmp_path / "b.ckpt"})
    report, _ = lt.train_loader(resumed, cfg_b, loader(), log=lambda s: None)
    assert report.steps == full.steps and report.losses == full.losses
    assert all(torch.equal(x, y) for x, y in zip(straight.params.values(), resumed.params.values()))


def test_a_resume_with_another_accumulate_is_refused(tmp_path, unchanged):
    data = regression_batches(8, 2)
    loader = lt.DataLoader(lt.Dataset(data), batch_size=2, shuffle=True, seed=3)
    cfg = lt.LoaderTrainConfig(epochs=1, log_every=0, accumulate=2, checkpoint_path=tmp_path / "a.ckpt")
    lt.train_loader(runner(), cfg, loader)
    r = runner(seed=4)
    with unchanged(r.params), pytest.raises(lt.CheckpointError, match="accumulate: checkpoint has 2, this run has 3"):
        lt.train_loader(r, lt.LoaderTrainConfig(epochs=2, accumulate=3, resume_from=tmp_path / "a.ckpt"), loader)


def test_collated_torch_batches_are_one_item_each():
    """A torch DataLoader's collated batch is one vectorised item: a group of K of them is
    the mean of their K batch losses."""
    torch.manual_seed(0)
    x, y = torch.randn(12, 4), torch.randn(12, 6)
    tl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)
    a, b = lt.Runner.from_module(torch.nn.Linear(4, 6), "mse"), None
    b = lt.Runner.from_module(copy.deepcopy(a.module), "mse")
    lt.train_loader(a, lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), log_every=0, accumulate=2), tl)
    opt = optim.sgd(0.1)
    state = opt.init(b.params)
    for i in (0, 6):
        state = lt.step_batch(b, opt, state, False, [(x[i:i + 3], y[i:i + 3]), (x[i + 3:i + 6], y[i + 3:i + 6])])
    assert all(torch.equal(p, q) for p, q in zip(a.params.values(), b.params.values()))


def test_accumulate_is_validated():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(lt.ConfigError, match="accumulate"):
            lt.LoaderTrainConfig(epochs=1, accumulate=bad)


def test_max_steps_beyond_the_epochs_is_said_once_and_reaching_it_says_nothing():
    import warnings

    data = [[(torch.randn(3), torch.randn(1))] for _ in range(10)]
    for max_steps, expect in ((25, 1), (10, 0), (4, 0)):
        runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
        cfg = lt.LoaderTrainConfig(epochs=1, max_steps=max_steps, optimizer=lt.optim.sgd(0.01), log_every=0)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            report, _ = lt.train_loader(runner, cfg, data, log=None)
        mine = [str(w.message) for w in said if "max_steps" in str(w.message)]
        assert report.steps == min(10, max_steps) and len(mine) == expect, mine
        if expect:
            assert mine[0] == ("train_loader: epochs=1 ended after 10 updates, before max_steps=25; max_steps "
                               "counts updates over the whole run, so raise epochs to reach it")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_accumulation_against_the_hand_loop_is_what_exactness_md_says(tied, n):
    """docs/concepts/exactness.md: against ``(loss_i / n).backward()`` per micro-batch, one
    update: an untied model agrees for powers of two and differs for n = 3 (1/3 rounds); a
    tied one adds its uses in another order (per backward there, once here); every
    difference is rounding-sized."""
    torch.manual_seed(0)
    model = TiedNet(bn=False)
    if not tied:
        model.out.weight = torch.nn.Parameter(model.mid.weight.detach().clone())
    ref = copy.deepcopy(model)
    data = items(n)
    lt.train_loader(lt.Runner.from_module(model, "mse"),
                    lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), log_every=0, accumulate=n,
                                         measure_loss=False), [[d] for d in data], log=None)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, fused=True)
    for x, y in data:
        (torch.nn.functional.mse_loss(ref(x), y) / n).backward()
    opt.step()
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    if not tied:  # dividing by a power of two is exact: the same additions in the same order
        assert same or n == 3  # 1/3 rounds: equal or not by the values
    # a tied model's sums are associated differently (uses per backward there, items per slot
    # here): equal or not by the machine's roundings (2 and 4 were equal on an AMD EPYC, 4 is not
    # on an Intel Xeon with AVX-512), rounding-sized either way
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-7, atol=0)
