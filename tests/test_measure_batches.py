"""The loader loop's ``before``/``after`` (#54, whole-run speed): by default the first
batch of a measuring pass at the first and at the final weights (two forwards in the whole
run); ``measure_batches=None`` is upstream's whole passes; ``measure_loss=False`` none."""

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim
from models import class_batches, tiny_classifier


class Counted(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.forwards = inner, 0

    def forward(self, x):
        self.forwards += 1
        return self.inner(x)


def _run(**kw):
    torch.manual_seed(0)
    model = Counted(tiny_classifier())
    first = lt.Runner.from_module(copy.deepcopy(model), "cross_entropy")
    runner = lt.Runner.from_module(model, "cross_entropy")
    data = class_batches(6, 1)
    report, _ = lt.train_loader(runner, lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.5), log_every=0, **kw),
                                data, log=None)
    return report, runner, first, data, model.forwards - len(data)  # beyond training's one forward per batch


@pytest.mark.parametrize("kw, passes", [({}, 1), ({"measure_batches": 2}, 2), ({"measure_batches": None}, 6)])
def test_before_and_after_read_the_same_first_batches_at_the_first_and_final_weights(kw, passes):
    report, runner, first, data, extra = _run(**kw)
    assert extra == 2 * passes
    assert report.before == pytest.approx(lt.evaluate(first, data[:passes])["loss"], rel=1e-6)
    assert report.after == pytest.approx(lt.evaluate(runner, data[:passes])["loss"], rel=1e-6)
    assert report.after < report.before


def test_measure_loss_false_reads_nothing_more():
    report, _, _, _, extra = _run(measure_loss=False)
    assert extra == 0 and report.before is None and report.after is None
