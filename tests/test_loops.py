"""The supervised loops: schedules, logging, no host reads, loaders (spec §7.3-§7.5, §11)."""

import os
import copy

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from leantrain.optim.schedules import Schedule
from models import TiedNet, grid_samples, quickstart_mlp, regression_batches
from optimizer_table import TABLE


class Recording(Schedule):
    def __init__(self, rates):
        self.rates, self.calls = rates, []

    def lr_at(self, t):
        self.calls.append(t)
        return self.rates[t]


def linear_runner():
    """loss = w * x with x = 1: every SGD step moves w by exactly -lr."""
    net = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(10.0)
    return net, lt.Runner.from_module(net, lambda pred, y: pred.sum())


ONE = (torch.ones(1), torch.zeros(1))


def test_schedule_advances_per_step_in_memory():
    net, r = linear_runner()
    sched = Recording([0.5, 0.25, 0.125, 1.0])
    cfg = lt.TrainConfig(steps=4, optimizer=optim.sgd(99.0), scheduler=sched, log_every=0)
    lt.train_samples(r, cfg, [ONE])
    assert sched.calls == [0, 1, 2, 3]
    assert net.weight.item() == 10.0 - 0.5 - 0.25 - 0.125 - 1.0  # the schedule overrides lr


def test_schedule_advances_once_per_epoch_for_loaders():
    net, r = linear_runner()
    sched = Recording([0.5, 0.25])
    loader = lt.DataLoader(lt.Dataset([ONE] * 3), batch_size=1)
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(99.0), scheduler=sched, log_every=0)
    report, _ = lt.train_loader(r, cfg, loader)
    assert sched.calls == [0, 1] and report.steps == 6
    assert net.weight.item() == 10.0 - 3 * 0.5 - 3 * 0.25


def test_log_lines_use_a_global_step_and_pre_update_losses():
    net, r = linear_runner()
    lines = []
    loader = lt.DataLoader(lt.Dataset([ONE] * 3), batch_size=2)  # batches of 2 and 1
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=optim.sgd(1.0), log_every=3)
    report, _ = lt.train_loader(r, cfg, loader, log=lines.append)
    # epoch 0: updates 1, 2 (w 10 -> 9 -> 8); epoch 1: updates 3, 4; update 4 sees w = 7
    # (updates are numbered from 1: the first, then every log_every-th, is logged)
    assert lines == ["step 1: loss=10.000000", "step 4: loss=7.000000"]
    assert report.losses == ((1, 10.0), (4, 7.0)) and report.steps == 4 and report.samples_seen == 6


def test_partial_final_batch_is_averaged_over_its_own_size_and_drop_last_drops_it():
    net, r = linear_runner()
    data = [(torch.tensor([1.0]), torch.zeros(1)), (torch.tensor([3.0]), torch.zeros(1)),
            (torch.tensor([5.0]), torch.zeros(1))]
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(1.0), log_every=0)
    report, _ = lt.train_loader(r, cfg, lt.DataLoader(lt.Dataset(data), batch_size=2))
    assert net.weight.item() == 10.0 - (1.0 + 3.0) / 2 - 5.0 and report.steps == 2
    net, r = linear_runner()
    report, _ = lt.train_loader(r, cfg, lt.DataLoader(lt.Dataset(data), batch_size=2, drop_last=True))
    assert net.weight.item() == 10.0 - 2.0 and report.steps == 1 and report.samples_seen == 2


def test_cyclic_batches_wrap_and_do_not_multiply_steps():
    net, r = linear_runner()
    data = [(torch.tensor([float(v)]), torch.zeros(1)) for v in (1, 2, 3)]
    cfg = lt.TrainConfig(steps=2, batch_size=2, optimizer=optim.sgd(1.0), log_every=0)
    report = lt.train_samples(r, cfg, data)
    # batches [1, 2] then [3, 1]: updates of 1.5 and 2.0
    assert net.weight.item() == 10.0 - 1.5 - 2.0
    assert report.steps == 2 and report.samples_seen == 4


class HostReads:
    """Counts tensor-to-host conversions (item, tolist, float, bool, numpy, cpu), except
    of the host counters torch.optim's implementations read (``kernels.host_counter``:
    host memory, never a device value)."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(self_, *a, _orig=original, **k):
                if not (getattr(self_, "host_counter", False) and self_.device.type == "cpu"):
                    self.count += 1
                return _orig(self_, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("kind", sorted(TABLE))
@pytest.mark.parametrize("mirrors", [False, True])
def test_no_host_reads_between_log_points(monkeypatch, kind, mirrors):
    """Skip mode never reads the host between log points; raise mode reads one flag a step."""
    torch.manual_seed(0)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    if mirrors:
        r.to("cpu")
    opt = TABLE[kind].make()
    data = regression_batches(4, 3)
    state = opt.init(r.params, native=lt.training.loops.session.uses_native(r, opt))
    batches = lt.training.loops.sample_loop.cyclic_batches("t", data, 2)
    reads = HostReads(monkeypatch)

    def run(**kw):
        cfg = lt.TrainConfig(steps=6, batch_size=2, optimizer=opt, scheduler=optim.exponential(0.01, 0.9), **kw)
        before = reads.count
        lt.run_sample_steps(r, cfg, lambda: next(batches), lambda d: None, opt, state,
                            lambda t, s: s.with_lr(cfg.scheduler.lr_at(t)), log=lambda s: None)
        return reads.count - before

    # Adafactor (torch's form) reads each parameter's RMS every update, as documented
    rule = lt.optim.rules.rule_for(opt.hyper)
    own = 6 * getattr(rule, "host_reads", 0) * len(state.records())
    assert run(log_every=0, nonfinite="skip") == own
    assert run(log_every=4, nonfinite="skip") == 2 + own  # steps 0 and 4 asked for their loss
    assert run(log_every=0, nonfinite="raise") == 6 + own  # the documented per-step flag read


def test_native_loop_on_mirrors_equals_the_host_loop():
    torch.manual_seed(1)
    a = TiedNet(bn=True)
    b = copy.deepcopy(a)
    ra, rb = lt.Runner.from_module(a, "mse"), lt.Runner.from_module(b, "mse").to("cpu")
    cfg = lt.TrainConfig(steps=5, batch_size=2, optimizer=optim.adam(0.01), log_every=2)
    data = regression_batches(3, 4)
    rep_a = lt.train_samples(ra, cfg, data, log=lambda s: None)
    rep_b = lt.train_samples(rb, cfg, data, log=lambda s: None)
    # the loop syncs once when it returns: the module itself shows the trained values
    assert rb.params.has_mirrors() and all(s.host_current for s in rb.params.storages())
    for x, y in zip(ra.params.values(), rb.params.values()):
        assert torch.equal(x, y)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    assert rep_a.losses == rep_b.losses and rep_a.after == rep_b.after


def test_continuing_with_the_returned_loader_equals_one_longer_run():
    torch.manual_seed(2)
    a = quickstart_mlp(3)
    b = copy.deepcopy(a)
    data = grid_samples()
    loader = lt.DataLoader(lt.Dataset(data), batch_size=4, shuffle=True, seed=9)
    ra, rb = lt.Runner.from_module(a, "mse"), lt.Runner.from_module(b, "mse")
    sgd = optim.sgd(0.05)  # stateless, so two calls continue exactly
    lt.train_loader(ra, lt.LoaderTrainConfig(epochs=3, optimizer=sgd, log_every=0), loader)
    _, next_loader = lt.train_loader(rb, lt.LoaderTrainConfig(epochs=1, optimizer=sgd, log_every=0), loader)
    lt.train_loader(rb, lt.LoaderTrainConfig(epochs=2, optimizer=sgd, log_every=0), next_loader)
    for x, y in zip(ra.params.values(), rb.params.values()):
        assert torch.equal(x, y)


def test_train_loader_accepts_a_torch_dataloader():
    from torch.utils.data import DataLoader as TorchLoader, TensorDataset

    torch.manual_seed(3)
    r = lt.Runner.from_module(quickstart_mlp(1), "mse")
    xs = torch.stack([x for x, _ in grid_samples()])
    ys = torch.stack([y for _, y in grid_samples()])
    loader = TorchLoader(TensorDataset(xs, ys), batch_size=5, shuffle=False)
    report, returned = lt.train_loader(r, lt.LoaderTrainConfig(epochs=20, optimizer=optim.adam(0.03), log_every=0), loader)
    assert returned is loader and report.steps == 100 and report.samples_seen == 100
    assert report.after < report.before


def test_quickstart_trains_below_0_01(capsys):
    r = lt.Runner.from_module(quickstart_mlp(0), "mse")
    cfg = lt.TrainConfig(steps=200, optimizer=optim.adam(0.03), log_every=25)
    report = lt.train_samples(r, cfg, grid_samples())
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1: loss=") and len(out) == 8
    assert report.after < 0.01 < report.before and report.steps == 200
    assert r.mode == "train"


def test_memory_watch_samples_on_cpu():
    lines = []
    r = lt.Runner.from_module(quickstart_mlp(0), "mse")
    cfg = lt.TrainConfig(steps=4, optimizer=optim.sgd(0.01), log_every=0, mem_watch=2)
    lt.train_samples(r, cfg, grid_samples(), log=lines.append)
    assert [ln.split(":")[0] for ln in lines] == ["  mem step=0", "  mem step=2", "  mem step=4"]
    assert "rss=" in lines[0]


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: lt.TrainConfig(steps=-1), "TrainConfig: steps must be an integer >= 0, got -1"),
        (lambda: lt.TrainConfig(steps=1, batch_size=0), "TrainConfig: batch_size must be an integer >= 1, got 0"),
        (lambda: lt.TrainConfig(steps=1, log_every=-2), "log_every must be an integer >= 0"),
        (lambda: lt.TrainConfig(steps=1, optimizer=torch.optim.SGD), "optimizer must be built with leantrain.optim"),
        (lambda: lt.TrainConfig(steps=1, accumulation="fast"), "accumulation must be one of"),
        (lambda: lt.LoaderTrainConfig(epochs=-1.5), "LoaderTrainConfig: epochs must be an integer >= 0 or a finite "
                                                    "number > 0"),  # 1.5 is taken since #70 (Trainer's fractions)
        (lambda: lt.LoaderTrainConfig(epochs=1, scheduler=0.1), "scheduler must be a leantrain.optim schedule"),
    ],
)
def test_bad_configs_rejected(make, pattern):
    with pytest.raises(lt.ConfigError, match=pattern):
        make()


def test_empty_data_raises_and_changes_nothing(unchanged):
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    with unchanged(r.params), pytest.raises(lt.DataError, match="train_samples: empty sample list"):
        lt.train_samples(r, lt.TrainConfig(steps=3), [])
    with unchanged(r.params), pytest.raises(lt.DataError, match="train_loader: empty dataset"):
        lt.train_loader(r, lt.LoaderTrainConfig(epochs=1), lt.DataLoader(lt.Dataset([]), batch_size=2))
    with unchanged(r.params), pytest.raises(lt.DataError, match=r"train_samples: item 1: expected an \(x, y\) pair"):
        lt.train_samples(r, lt.TrainConfig(steps=3), [regression_batches(1, 2)[0], (torch.zeros(2),)])


def test_the_quickstart_example_script_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "quickstart.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    after = float(out.stdout.split("mean_loss(after training) = ")[1].split()[0])
    assert after < 0.01


def test_memory_watch_warns_once_when_exhaustion_is_projected():
    from leantrain.training.loops.memory import MemoryWatch, cadence

    class Fake(MemoryWatch):
        free = [1000, 900, 800, 700, 600]

        def _read(self):
            return "mem fake=1", self.free.pop(0)

    lines = []
    watch = Fake(every=10, total_steps=100, device=torch.device("cpu"), log=lines.append)
    for done in (0, 5, 10, 20, 30, 40):  # step 5 is off-cadence: no sample
        watch(done)
    warnings = [ln for ln in lines if "warning" in ln]
    # 10 bytes a step: at every sample, done + free/10 == 100, never before the last step
    assert warnings == []
    lines.clear()
    fast = Fake(every=10, total_steps=1000, device=torch.device("cpu"), log=lines.append)
    fast.free = [1000, 500, 400, 300]
    for done in (0, 10, 20, 30):
        fast(done)
    warnings = [ln for ln in lines if "warning" in ln]
    assert len(warnings) == 1 and "near step 20" in warnings[0]  # 500 bytes/step, 500 free at 10
    assert cadence(0, 5000, torch.device("cuda")) == 500 and cadence(0, 5000, torch.device("cpu")) == 0
    assert cadence(7, 10, torch.device("cpu")) == 7 and cadence(0, 999, torch.device("cuda")) == 0


def test_cpu_memory_readings_are_psutils_and_a_file_read_does_not_look_like_a_leak(tmp_path):
    """``available`` is the kernel's estimate (page cache included), as psutil reads it:
    reading a 256 MiB file fills the page cache, which the old free-pages reading counted
    as used memory (it fell by the file's size); the available reading barely moves."""
    import psutil

    from leantrain.training.loops.memory import _cpu_rss_and_free

    rss, available = _cpu_rss_and_free()
    assert abs(rss - psutil.Process().memory_info().rss) < 64 * 2**20
    assert abs(available - psutil.virtual_memory().available) < 256 * 2**20
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(256):
            f.write(os.urandom(2**20))
    before = _cpu_rss_and_free()[1]
    with open(big, "rb") as f:
        while f.read(2**24):
            pass
    after = _cpu_rss_and_free()[1]
    assert before - after < 128 * 2**20, (before - after) / 2**20


def test_the_report_counts_the_tokens_seen_and_a_resume_continues_the_count(tmp_path):
    """#70: ``TrainReport.tokens_seen`` (Trainer's ``num_input_tokens_seen``): the tokens of
    every update (an attention mask's ones), over the whole run, a resumed run's included;
    ``None`` for data that are not tokens."""
    import leantrain as lt

    class TokenModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 4)
            self.head = torch.nn.Linear(4, 20)

        def forward(self, input_ids, attention_mask, labels):
            import types

            logits = self.head(self.emb(input_ids))
            return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(
                logits.reshape(-1, 20), labels.reshape(-1), ignore_index=-100))

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 20, (int(n),), generator=g) for n in torch.randint(2, 9, (24,), generator=g)]
    expected = sum(len(s) for s in seqs) * 2  # two epochs, every sequence once per epoch

    def run(steps=None, resume=None):
        torch.manual_seed(0)
        runner = lt.Runner.from_module(TokenModel(), "model")
        cfg = lt.LoaderTrainConfig(epochs=2, max_steps=steps, log_every=0, checkpoint_path=tmp_path / "ck",
                                   checkpoint_every=2, resume_from=resume)
        loader = lt.DataLoader(seqs, batch_size=4, shuffle=True, seed=1, collate=lt.collate.pad_tokens)
        return lt.train_loader(runner, cfg, loader, log=None)[0]

    straight = run()
    assert straight.tokens_seen == expected
    (tmp_path / "ck").unlink()
    assert run(steps=5).tokens_seen < expected
    resumed = run(resume="auto")
    assert resumed.resumed_from is not None and resumed.tokens_seen == expected
    plain = lt.train_samples(lt.Runner.from_module(torch.nn.Linear(2, 1), "mse"), lt.TrainConfig(steps=1),
                             [(torch.zeros(2), torch.zeros(1))], log=None)
    assert plain.tokens_seen is None
