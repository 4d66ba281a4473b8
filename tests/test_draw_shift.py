"""Counting a forward's random draws and moving the generators ahead (``runner/draw_shift.py``):
the states it computes are the states the real draws reach, at every position of
MT19937's 624-word block and across blocks; a dropout model's items started from them
draw each item's one-process numbers; what cannot be counted says so (``None``)."""

import pytest
import torch
from torch import nn

from leantrain.training.runner import draw_shift


def state() -> tuple:
    return torch.get_rng_state(), None


@pytest.mark.parametrize("before", [0, 1, 5, 623, 624, 625, 1000])
@pytest.mark.parametrize("words", [0, 1, 2, 623, 624, 625, 1247, 1248, 5000, 200_000])
def test_counted_words_move_the_generator_where_the_draws_move_it(before, words):
    torch.manual_seed(7)
    torch.empty(before, dtype=torch.int32).random_()  # anywhere in a block
    start = state()
    torch.empty(words, dtype=torch.int32).random_()  # one word an element
    after = state()
    shift = draw_shift.measure(start, after)
    assert shift == draw_shift.Shift(words, None)
    starts = draw_shift.starts("t", start, [shift, shift, shift])
    torch.empty(2 * words, dtype=torch.int32).random_()
    assert torch.equal(starts[-1][0], torch.get_rng_state())  # three items later
    assert torch.equal(starts[0][0], start[0]) and torch.equal(starts[0].then[0], after[0])
    assert torch.equal(starts[1][0], after[0]) and starts[1].op == "t"


def test_items_started_from_the_counted_states_draw_their_one_process_numbers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 8), nn.Dropout(0.2))
    x, wide = torch.randn(32, 64), torch.randn(5, 64)
    items = [x, wide, x, x, wide, x]
    torch.manual_seed(3)
    start = state()
    with torch.no_grad():
        outs = [model(t) for t in items]  # one process: one after the other
    end = torch.get_rng_state()
    shifts = {}
    for t in (x, wide):
        torch.set_rng_state(start[0])
        with torch.no_grad():
            model(t)
        shifts[t.shape] = draw_shift.measure(start, state())
    assert shifts[x.shape].words == 2 * (32 * 64 + 32 * 8)  # CPU dropout: two words an element
    starts = draw_shift.starts("t", start, [shifts[t.shape] for t in items])
    for k in (4, 1, 3):  # any item, in any order
        torch.set_rng_state(starts[k][0])
        with torch.no_grad():
            assert torch.equal(model(items[k]), outs[k])
        assert torch.equal(torch.get_rng_state(), starts[k].then[0])
    assert torch.equal(starts[-1][0], end)


def test_what_cannot_be_counted_is_none():
    torch.manual_seed(3)
    start = state()
    torch.randn(3)  # fewer than 16 normal values: torch keeps the pair's second one cached
    assert draw_shift.measure(start, state()) is None
    start = state()  # the cache valid before the forward, too
    torch.rand(4)
    assert draw_shift.measure(start, state()) is None
    assert draw_shift.measure((torch.zeros(10, dtype=torch.uint8), None), (torch.zeros(10, dtype=torch.uint8), None)) \
        is None  # a layout this module does not know


def test_signature_names_shapes_dtypes_and_plain_values():
    a = draw_shift.signature((torch.zeros(2, 3), {"n": 4, "mask": torch.ones(2, dtype=torch.bool)}))
    assert a == draw_shift.signature((torch.ones(2, 3), {"n": 4, "mask": torch.zeros(2, dtype=torch.bool)}))
    assert a != draw_shift.signature((torch.ones(2, 4), {"n": 4, "mask": torch.zeros(2, dtype=torch.bool)}))
    assert a != draw_shift.signature((torch.ones(2, 3), {"n": 5, "mask": torch.zeros(2, dtype=torch.bool)}))


@pytest.mark.cuda
def test_a_cuda_generator_moves_by_its_offset():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 8), nn.Dropout(0.2)).to(dev)
    x = torch.randn(32, 64, device=dev)

    def cuda_state() -> tuple:
        return torch.get_rng_state(), torch.cuda.get_rng_state(dev)

    start = cuda_state()
    with torch.no_grad():
        outs = [model(x) for _ in range(5)]
    end = cuda_state()
    torch.set_rng_state(start[0])
    torch.cuda.set_rng_state(start[1], dev)
    with torch.no_grad():
        model(x)
    shift = draw_shift.measure(start, cuda_state())
    assert shift is not None and shift.words == 0 and shift.offset > 0
    starts = draw_shift.starts("t", start, [shift] * 5)
    for k in (3, 0, 4):
        torch.cuda.set_rng_state(starts[k][1], dev)
        with torch.no_grad():
            assert torch.equal(model(x), outs[k])
    assert torch.equal(starts[-1][1], end[1])
