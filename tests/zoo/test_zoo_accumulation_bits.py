"""Several items per update: a loop's updates give the bits of the same updates called one
by one (``step_batch``, outside any loop: nothing checked once and reused, no gradients
held between updates), over the zoo, the Hugging Face models, activation checkpoints of
both kinds and every kind of gradient the accumulation hooks leave to the fold (sparse,
one element, a slot some items do not reach, a gradient that turns from sparse to dense
or back between items, which plain PyTorch's ``.grad`` accumulation takes too)."""

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from zoo_models import ZOO


def bits(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


def loop_and_calls(build, loss, samples, k, opt, steps=3):
    """(the runner a loop trained, the runner ``step_batch`` trained with the same batches)."""
    a = lt.Runner.from_module(build(), loss)
    cfg = lt.TrainConfig(steps=steps, batch_size=k, optimizer=opt, log_every=0, measure_loss=False)
    torch.manual_seed(4)  # the same dropout draws on both sides
    lt.train_samples(a, cfg, samples[:k], log=None)
    b = lt.Runner.from_module(build(), loss)
    state = opt.init(b.params)
    torch.manual_seed(4)
    for _ in range(steps):
        state = lt.step_batch(b, opt, state, False, samples[:k])
    return a, b


def assert_same_bits(a, b):
    for i, (va, vb) in enumerate(zip(a.params.values(), b.params.values())):
        assert torch.equal(bits(va), bits(vb)), a.params.label(i)


OPTS = {"sgd_momentum": lambda: optim.sgd(0.05, momentum=0.9), "adamw": lambda: optim.adamw(1e-2)}


@pytest.mark.parametrize("opt_name", list(OPTS))
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_a_loop_gives_the_bits_of_the_calls_one_by_one(entry, k, opt_name):
    model_ids = []

    def build():
        m = entry.model()
        model_ids.append(m)
        return m

    a, b = loop_and_calls(build, entry.loss, entry.samples(k), k, OPTS[opt_name]())
    assert_same_bits(a, b)
    trained = model_ids[0]
    assert all(p.grad is None for p in trained.parameters())  # the user's .grad untouched
    if entry.tied:
        assert trained.lm_head.weight is trained.tok_emb.weight


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hugging_face_models_too(name):
    hf = pytest.importorskip("hf_models")
    entry = hf.BY_NAME[name]
    a, b = loop_and_calls(entry.model, "model_mean", entry.samples(3), 3, optim.adamw(1e-3), steps=2)
    assert_same_bits(a, b)


class Mixed(nn.Module):
    """Every kind of gradient the hooks do not take, and one that changes kind: a sparse
    embedding, a one-element scale, a layer only odd items reach, and a table whose
    gradient is dense for one item kind (a matmul) and sparse for the other (a sparse
    lookup)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.odd = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(10, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        ids, kind = x[:, :3], int(x[0, 3])
        h = self.emb(ids).mean(1) * self.scale
        if kind == 0:  # dense: a one-hot matmul
            h = h + nn.functional.one_hot(ids[:, 0], 10).float() @ self.table
        else:  # sparse: a sparse lookup of the same table
            h = h + nn.functional.embedding(ids[:, 0], self.table, sparse=True)
        if kind == 1:
            h = self.odd(h)
        return self.head(h)


def mixed_samples(kinds):
    g = torch.Generator().manual_seed(3)
    return [(torch.cat([torch.randint(0, 10, (2, 3), generator=g), torch.full((2, 1), kind)], 1),
             torch.randn(2, 2, generator=g)) for kind in kinds]


@pytest.mark.parametrize("kinds", [(0, 1, 0), (1, 0, 0), (0, 0, 1, 1), (1, 1, 0)], ids=str)
def test_sparse_one_element_unreached_and_changing_kinds_give_the_fold_bits(kinds):
    """SGD takes sparse gradients. A sparse sum followed by a dense gradient was a torch
    error (``add(sparse, dense)``); plain PyTorch's accumulation takes it, and so do we,
    with its bits."""
    def build():
        torch.manual_seed(0)
        return Mixed()

    samples = mixed_samples(kinds)
    a, b = loop_and_calls(build, "mse", samples, len(kinds), optim.sgd(0.1))
    assert_same_bits(a, b)
    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        for x, y in samples:
            nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / len(kinds))
        opt.step()
    for (name, p), v in zip(ref.named_parameters(), a.params.values()):
        assert torch.equal(bits(p), bits(v)), name


def test_a_negative_zero_gradient_stays_negative():
    """The first item's gradient is the sum, never added to zeros (0.0 + -0.0 is +0.0): a
    weight of -0.0 with a gradient of -0.0 ends where torch.optim puts it."""
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([-0.0, -0.0, 1.0]))

        def forward(self, x):
            return self.w * x

    model = Scale()
    w = model.w
    x = torch.tensor([-0.0, -0.0, 1.0])
    r = lt.Runner.from_module(model, lambda out, y: out.sum())
    lt.train_samples(r, lt.TrainConfig(steps=1, batch_size=1, optimizer=optim.sgd(1.0), log_every=0,
                                       measure_loss=False), [(x, x)], log=None)
    ref = nn.Parameter(torch.tensor([-0.0, -0.0, 1.0]))
    opt = torch.optim.SGD([ref], lr=1.0)
    (ref * x).sum().backward()
    opt.step()
    assert torch.equal(bits(w), bits(ref))
    assert not torch.signbit(w[0]) and not torch.signbit(ref[0])  # -0.0 - 1.0 * -0.0 is +0.0


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpoints_of_both_kinds(reentrant):
    """A reentrant checkpoint's backward goes through ``.grad`` (no hooks: every item is
    folded); a non-reentrant one through the hooks. Both: the calls' bits and the user's
    ``.grad`` untouched."""
    from test_zoo_checkpointing import Checkpointed

    built = []

    def build():
        torch.manual_seed(0)
        built.append(Checkpointed(reentrant))
        return built[-1]

    samples = [(torch.randn(6, generator=torch.Generator().manual_seed(k)), torch.randn(1)) for k in range(3)]
    a, b = loop_and_calls(build, "mse", samples, 3, optim.adamw(0.01))
    assert_same_bits(a, b)
    assert all(p.grad is None for p in built[0].parameters())
