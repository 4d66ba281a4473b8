"""CUDA paths (run with `pytest -m cuda` on a machine with a GPU; skipped elsewhere)."""

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim
from models import TiedNet, regression_batches

pytestmark = pytest.mark.cuda


def on_cuda(batches):
    return [(x.cuda(), y.cuda()) for x, y in batches]


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_native_cuda_matches_the_cpu_host_run(kind):
    torch.manual_seed(0)
    net = TiedNet(bn=True)
    cpu, gpu = lt.Runner.from_module(net, "mse"), lt.Runner.from_module(copy.deepcopy(net), "mse").to("cuda")
    cfg = lt.TrainConfig(steps=8, batch_size=2, optimizer=getattr(optim, kind)(0.01), log_every=0)
    data = regression_batches(4, 5)
    lt.train_samples(cpu, cfg, data)
    lt.train_samples(gpu, cfg, on_cuda(data))
    assert all(s.mirror is not None and s.mirror.is_cuda for s in gpu.params.storages())
    for a, b in zip(cpu.params.values(), gpu.params.values_synced()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_native_step_never_syncs(kind):
    torch.manual_seed(1)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse").to("cuda")
    opt = getattr(optim, kind)(0.01)
    state = opt.init(r.params, native=True)
    data = on_cuda(regression_batches(4, 5))
    batches = lt.training.sample_loop.cyclic_batches("t", data, 2)
    cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=opt, log_every=0, nonfinite="skip")
    lt.run_sample_steps(r, cfg, lambda: next(batches), lambda d: None, opt, state,
                        lambda t, s: s.with_lr(0.01), log=lambda s: None)  # warm-up (allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lt.run_sample_steps(r, cfg, lambda: next(batches), lambda d: None, opt, state,
                            lambda t, s: s.with_lr(0.01), log=lambda s: None)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_checkpoint_round_trip(tmp_path):
    torch.manual_seed(2)
    r = lt.Runner.from_module(TiedNet(), "mse").to("cuda")
    opt = optim.adam(0.01)
    state = opt.init(r.params, native=True)
    state = lt.step_batch(r, opt, state, True, on_cuda(regression_batches(2, 3)))
    lt.save_checkpoint(tmp_path / "c.ckpt", r, state=state)
    other = lt.Runner.from_module(TiedNet(), "mse").to("cuda")
    ck = lt.load_checkpoint(tmp_path / "c.ckpt", other, optimizer=opt)
    assert ck.state.path == "native"
    assert all(t.is_cuda for rec in ck.state.records().values() for t in rec.tensors().values())
    for a, b in zip(r.params.values_synced(), other.params.values_synced()):
        assert torch.equal(a, b)


def test_memory_watch_samples_the_cuda_allocator():
    lines = []
    r = lt.Runner.from_module(TiedNet(bn=False), "mse").to("cuda")
    cfg = lt.TrainConfig(steps=4, optimizer=optim.sgd(0.01), log_every=0, mem_watch=2)
    lt.train_samples(r, cfg, on_cuda(regression_batches(2, 3)), log=lines.append)
    assert [ln.split(":")[0] for ln in lines] == ["  cuda_mem step=0", "  cuda_mem step=2", "  cuda_mem step=4"]
