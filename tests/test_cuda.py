"""CUDA paths (run with `pytest -m cuda` on a machine with a GPU; skipped elsewhere)."""

import copy

import pytest
import torch

import leantrain as lt
from optimizer_table import TABLE
from leantrain import optim
from models import TiedNet, regression_batches

pytestmark = pytest.mark.cuda


def without_syncs(run) -> None:
    """``run()`` once as a warm-up (allocations, mirrors), then again with any device sync
    an error."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def updates_without_syncs(r, cfg, data) -> None:
    """A whole ``train_samples`` run as a warm-up, then another whose updates from the
    second to the last run with any device sync an error (a read-only callback turns the
    check on after the first and off after the last: the end of a run reads its report and
    the module's values back on purpose)."""
    lt.train_samples(r, cfg, data, log=lambda s: None)
    torch.cuda.synchronize()

    class Checked(lt.Callback):
        reads_only = True

        def on_step(self, event):
            torch.cuda.set_sync_debug_mode("error" if event.step < cfg.steps else "default")

    try:
        lt.train_samples(r, cfg, data, log=lambda s: None, callbacks=[Checked()])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def on_cuda(batches):
    return [(x.cuda(), y.cuda()) for x, y in batches]


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_native_cuda_matches_the_cpu_host_run(kind):
    torch.manual_seed(0)
    net = TiedNet(bn=True)
    cpu, gpu = lt.Runner.from_module(net, "mse"), lt.Runner.from_module(copy.deepcopy(net), "mse").to("cuda")
    # ``mid.bias`` feeds a BatchNorm: its gradient is zero up to rounding, which Adam's g/sqrt(v)
    # turns into steps of +-lr whose sign differs between devices; a larger eps keeps them small
    opt = optim.sgd(0.01) if kind == "sgd" else getattr(optim, kind)(0.01, eps=1e-3)
    cfg = lt.TrainConfig(steps=8, batch_size=2, optimizer=opt, log_every=0)
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
    batches = lt.training.loops.sample_loop.cyclic_batches("t", data, 2)
    cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=opt, log_every=0, nonfinite="skip")
    without_syncs(lambda: lt.run_sample_steps(r, cfg, lambda: next(batches), lambda d: None, opt, state,
                                              lambda t, s: s.with_lr(0.01), log=lambda s: None))


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


def test_the_everyday_features_never_sync():
    """Clipping, per-slot settings, float16 autocast with loss scaling and a moving
    average: a loop that reads no loss reads nothing back from the device."""
    torch.manual_seed(3)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse").to("cuda")
    opt = optim.adamw(0.01, 0.1).per_slot(lambda p: {"weight_decay": 0.0} if len(p.shape) < 2 else {})
    data = on_cuda(regression_batches(4, 5))
    cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=opt, log_every=0, nonfinite="skip", measure_loss=False,
                         clip_grad_norm=0.5, autocast="float16", ema_decay=0.9)
    lt.train_samples(r, cfg, data)  # warm-up (allocations, the mirrors)
    state = opt.init(r.params, native=True)
    batches = lt.training.loops.sample_loop.cyclic_batches("t", data, 2)
    session = lt.training.loops.session.Session("t", r, cfg, "samples", log=lambda s: None)
    r.keep_ema(lt.training.runner.ema.EMA(r.params, 0.9))
    with session.computing():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            lt.run_sample_steps(r, cfg, lambda: next(batches), lambda d: None, opt, state,
                                lambda t, s: s.with_lr(0.01), session=session)
        finally:
            torch.cuda.set_sync_debug_mode("default")


# the table's fused optimizers with the device path (plain SGD, Adam, AdamW) and SGD momentum,
# whose update on the host mirrors torch's device kernel bit for bit
@pytest.mark.parametrize("kind", [n for n in TABLE if TABLE[n].torch()[1].get("fused")
                                  and (TABLE[n].opt.native or n == "momentum")])
def test_fused_kernels_equal_torch_fused_on_cuda(kind):
    """Against torch.optim's fused kernel on the device."""
    torch.manual_seed(4)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).cuda()
    ref = copy.deepcopy(net)
    r = lt.Runner.from_module(net, "mse").to("cuda")
    ours = TABLE[kind].make()
    cls, kwargs = TABLE[kind].torch()
    theirs = cls(ref.parameters(), **kwargs)
    data = [(x.cuda(), y.cuda()) for x, y in regression_batches(4, 2, d=5, out=3)]
    lt.train_samples(r, lt.TrainConfig(steps=4, batch_size=1, optimizer=ours, log_every=0), data)
    for x, y in data:
        theirs.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        theirs.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_float16_on_cuda_is_the_grad_scaler_loop():
    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).cuda()
    ref = copy.deepcopy(net)
    r = lt.Runner.from_module(net, "mse").to("cuda")
    data = [(x.cuda() * 100, y.cuda()) for x, y in regression_batches(6, 2, d=5, out=3)]
    report = lt.train_samples(r, lt.TrainConfig(steps=6, batch_size=1, optimizer=optim.sgd(1e-4), log_every=0,
                                                autocast="float16"), data)
    opt = torch.optim.SGD(ref.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(ref(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    r.sync()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam", "adamw"])
def test_cuda_fused_kernels_get_dense_tensors_in_the_parameters_layout(kind):
    """Views with gaps and interleaved views of one CUDA base, a transposed parameter,
    stride-0 and transposed gradients: torch.optim(fused=True) on dense copies, bit for
    bit, and the base's elements no parameter owns unchanged."""
    torch.manual_seed(3)
    base = torch.randn(7, 4, device="cuda")
    guard = base[6].clone()
    wt = torch.randn(3, 4, device="cuda").t()
    views = [base[0:6:2], base[1:6:2], wt]
    params = lt.ParamList([lt.Param.of_storage(lt.Storage(v), name=f"p{k}") for k, v in enumerate(views)])
    ours = getattr(optim, kind)(0.05)
    ref = [torch.nn.Parameter(v.clone()) for v in views]
    # torch has no fused Adagrad on CUDA (it refuses fused=True there): its default, foreach
    how = {"foreach": True} if kind == "adagrad" else {"fused": True}
    theirs = getattr(torch.optim, {"sgd": "SGD", "adagrad": "Adagrad", "adam": "Adam", "adamw": "AdamW"}[kind])(
        ref, lr=0.05, **how)
    state = ours.init(params)
    for k in range(3):
        gs = [torch.randn(4, device="cuda").expand(3, 4), torch.randn(4, 3, device="cuda").t(),
              torch.randn(4, 3, device="cuda")]
        state = ours.step(state, params, gs)
        for p, g in zip(ref, gs):
            p.grad = torch.empty_like(p).copy_(g)
        theirs.step()
    assert torch.equal(base[6], guard)
    for v, p in zip(views, ref):
        if kind in ("sgd", "adagrad"):
            assert torch.equal(v, p.detach())
        else:
            torch.testing.assert_close(v, p.detach(), rtol=1e-6, atol=1e-7)


def test_cuda_sparse_embedding_with_sgd_never_syncs():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Embedding(9, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(20, 2))
    r = lt.Runner.from_module(model, "mse").to("cuda")
    opt = optim.sgd(0.1)
    state = opt.init(r.params, native=True)
    x = torch.randint(0, 9, (3, 5), device="cuda")
    y = torch.randn(3, 2, device="cuda")
    states = [state]  # each call continues from the last one's state, as a loop does
    without_syncs(lambda: states.append(lt.step_batch(r, opt, states[-1], True, [(x, y)], nonfinite="skip")))


@pytest.mark.parametrize("sharding, by", [("optimizer", "range"), ("gradients", "range"), ("gradients", "slot")])
def test_a_sharded_cuda_run_equals_the_unsharded_one(sharding, by):
    """One process on the GPU: the sharded update (ranges of the mirrors, the fused
    kernels, the moving average) gives the unsharded run's bits."""
    torch.manual_seed(4)
    net = TiedNet(bn=True)
    data = on_cuda(regression_batches(4, 5))
    out = []
    for sh in (None, sharding):
        r = lt.Runner.from_module(copy.deepcopy(net), "mse").to("cuda")
        cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=optim.adamw(0.01, 0.1), log_every=1, ema_decay=0.9,
                             clip_grad_norm=0.5 if by == "slot" or sharding == "optimizer" else None,
                             sharding=sh, shard_by=by)
        report = lt.train_samples(r, cfg, data, log=lambda s: None)
        out.append(([t.clone() for t in r.params.values_synced()], report.losses, r.ema_values()))
    (a, la, ea), (b, lb, eb) = out
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and la == lb
    assert all(torch.equal(x, y) for x, y in zip(ea, eb))


@pytest.mark.parametrize("clip, by", [({"clip_grad_value": 0.5}, "range"), ({"clip_grad_norm": 0.5}, "range"),
                                      ({"clip_grad_norm": 0.5}, "slot")])
def test_a_sharded_step_never_syncs(clip, by):
    """Gradient sharding on one GPU with skip mode, clipping and a moving average: a loop
    that reads no loss reads nothing back from the device."""
    torch.manual_seed(5)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse").to("cuda")
    data = on_cuda(regression_batches(4, 5))
    cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=optim.adam(0.01), log_every=0, nonfinite="skip",
                         measure_loss=False, ema_decay=0.9, sharding="gradients", shard_by=by, **clip)
    updates_without_syncs(r, cfg, data)


def test_a_parameter_sharded_cuda_run_equals_the_unsharded_one_and_never_syncs():
    """Parameter sharding on one GPU: the mirrors are released and gathered around each
    module, the one-process bits; after a warm-up run, a loop that reads no loss reads
    nothing back from the device (the resizes and gathers stay on the device)."""
    torch.manual_seed(4)
    net = TiedNet(bn=True)
    data = on_cuda(regression_batches(4, 5))
    out = []
    for sh in (None, "parameters"):
        r = lt.Runner.from_module(copy.deepcopy(net), "mse").to("cuda")
        cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=optim.adamw(0.01, 0.1), log_every=1, sharding=sh)
        report = lt.train_samples(r, cfg, data, log=lambda s: None)
        out.append(([t.clone() for t in r.params.values_synced()], report.losses))
    (a, la), (b, lb) = out
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and la == lb
    r = lt.Runner.from_module(copy.deepcopy(net), "mse").to("cuda")
    cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=optim.adam(0.01), log_every=0, measure_loss=False,
                         nonfinite="skip", sharding="parameters")  # "raise" reads the step's flag on purpose
    updates_without_syncs(r, cfg, data)
