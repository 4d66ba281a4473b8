"""The opt-in compiled step (``compile=True``, training/compiled.py) on the model zoo.

Compiled kernels may round differently from eager PyTorch, so the compiled run is
compared with the eager one to rounding, and with itself bit for bit. (Dropout is set
to 0 for the comparison with eager: compiled code draws its masks from another
generator; SGD keeps rounding differences proportional, where Adam's normalised step
turns a last-bit difference of a near-zero gradient into a step of ``lr``.)"""

import copy
import shutil

import pytest
import torch

import leantrain as lt
from leantrain import optim
from zoo_models import BY_NAME

# Each model compiles once (seconds on CPU); Inductor needs a C++ compiler on the CPU.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                                   reason="torch.compile on CPU needs a C++ compiler")]


def bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _train(entry, model, compile, steps=3):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    r = lt.Runner.from_module(model, entry.loss)
    cfg = lt.TrainConfig(steps=steps, batch_size=2, optimizer=optim.sgd(0.1), log_every=1, compile=compile)
    report = lt.train_samples(r, cfg, entry.samples(4), log=lambda s: None)
    return r, report


@pytest.mark.parametrize("name", ["gpt", "cnn_batchnorm"])
def test_compiled_training_matches_eager_to_rounding_and_itself_exactly(name):
    entry = BY_NAME[name]
    base = entry.model()
    eager_model, compiled_model, again_model = base, copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(3)
    _, eager = _train(entry, eager_model, compile=False)
    torch.manual_seed(3)
    r, compiled = _train(entry, compiled_model, compile=True)
    torch.manual_seed(3)
    _, again = _train(entry, again_model, compile=True)
    assert r.loop.compiled is None  # only for the loop's length
    if name == "gpt":
        assert compiled_model.lm_head.weight is compiled_model.tok_emb.weight  # the tie is the user's still
    for (k, a), b, c in zip(compiled_model.state_dict().items(), eager_model.state_dict().values(),
                            again_model.state_dict().values()):
        assert torch.equal(bits(a), bits(c)), k  # compiled == compiled, bit for bit
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(a, b), k  # counters (BatchNorm's num_batches_tracked)
    assert compiled.losses == again.losses
    for (s1, l1), (s2, l2) in zip(compiled.losses, eager.losses):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-5)


def test_compile_must_be_a_bool():
    with pytest.raises(lt.ConfigError, match=r"compile"):
        lt.TrainConfig(steps=1, compile="yes")
