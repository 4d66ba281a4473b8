import os

# Intel MKL's kernels for AVX-512 give results that depend on the operands' memory
# alignment unless its conditional numerical reproducibility is on: the same matrix
# product, run twice on tensors allocated elsewhere, can differ in the last bit, and the
# suite compares runs bit for bit. Set before torch loads MKL (spawned ranks inherit it).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def snapshot(params, state=None):
    """Bytes of every host tensor, mirror and optimizer-state tensor (for 'nothing changed')."""
    out = []
    for s in params.storages():
        out.append(("host", s.host.detach().clone(), s.host_current))
        out.append(("mirror", None if s.mirror is None else s.mirror.detach().clone(), id(s.mirror)))
    if state is not None:
        out.append(("state", state.lr, state.path, state.steps))
        for i, rec in enumerate(state.slots):
            if rec is None:
                out.append((i, None))
                continue
            out.append((i, type(rec).__name__, getattr(rec, "step", None)))
            for k, t in rec.tensors().items():
                out.append((i, k, t.detach().clone()))
    return out


def same(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if len(x) != len(y):
            return False
        for u, v in zip(x, y):
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)):
                    return False
                if u.dtype != v.dtype or u.shape != v.shape or not torch.equal(
                    u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
                ):
                    return False
            elif u != v:
                return False
    return True


@pytest.fixture
def unchanged():
    """``with unchanged(params, state): bad_call()`` asserts every byte stays put."""
    import contextlib

    @contextlib.contextmanager
    def guard(params, state=None):
        before = snapshot(params, state)
        yield
        assert same(before, snapshot(params, state)), "a rejected call changed parameter/state bytes"

    return guard
