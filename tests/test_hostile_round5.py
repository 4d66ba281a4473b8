"""The fifth hostile round (#68): each case failed on the code before its fix."""

import json

import numpy
import pytest
import torch

import leantrain as lt


def _forged(tmp_path, edit) -> tuple:
    from filetools import forged_loader_run

    return forged_loader_run(tmp_path, edit)


def _zero(name):
    def edit(manifest, tensors):
        tensors[name] = torch.zeros_like(tensors[name])
    return edit


def _word(name, k, value):
    def edit(manifest, tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][k] = value
    return edit


@pytest.mark.parametrize("case, edit, match", [
    ("python all zero", _zero("rng.python"), "'rng.python'.*every word is zero"),
    ("python word past 32 bits", _word("rng.python", 3, 2**32 + 5), "'rng.python'.*out of the 32-bit range"),
    ("python negative word", _word("rng.python", 3, -1), "'rng.python'.*out of the 32-bit range"),
    ("numpy all zero", _zero("rng.numpy"), "'rng.numpy'.*every word is zero"),
    ("numpy word past 32 bits", _word("rng.numpy", 0, 2**33), "'rng.numpy'.*out of the 32-bit range"),
])
def test_14_python_and_numpy_states_are_checked_as_torch_s_is(tmp_path, case, edit, match):
    """An all-zero Python or NumPy state resumed (the generator then returns 0.0 forever),
    out-of-range words were truncated or wrapped: each is now a CheckpointError before
    anything is installed."""
    import random

    runner, loader, cfg = _forged(tmp_path, edit)
    before = [p.detach().clone() for p in runner.module.parameters()]
    states = torch.get_rng_state(), random.getstate(), numpy.random.get_state()
    with pytest.raises(lt.CheckpointError, match=match):
        lt.train_loader(runner, cfg, loader)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.module.parameters()))
    assert torch.equal(states[0], torch.get_rng_state()) and states[1] == random.getstate()
    now = numpy.random.get_state()
    assert numpy.array_equal(states[2][1], now[1]) and states[2][2] == now[2]


def _small_loader(size):
    g = torch.Generator().manual_seed(1)
    items = [(torch.randn(4, generator=g), torch.randn(1, generator=g)) for _ in range(64)]
    return lt.DataLoader(items, batch_size=size, shuffle=False, collate=torch.utils.data.default_collate)


def test_3_the_batch_size_finder_averages_a_copy_of_the_user_s_averaged_model():
    """``find_batch_size(..., averaging=...)`` trained the user's own ``AveragedModel`` (its
    counter 8, its values from the trial copies afterwards)."""
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    runner = lt.Runner.from_module(model, "mse")
    averaged = AveragedModel(model)
    before = {k: v.clone() for k, v in averaged.state_dict().items()}
    got = lt.find_batch_size(runner, _small_loader, lt.optim.sgd(0.1), max_batch_size=8, memory_budget=2**40,
                             averaging=lt.Averaging(averaged))
    assert got.batch_size == 8
    after = averaged.state_dict()
    assert int(after["n_averaged"]) == 0
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kw, match", [
    ({"log_every": 5}, "log_every is the finder's own"),
    ({"callbacks": []}, "'callbacks' is not a LoaderTrainConfig option"),
])
def test_15_finder_keywords_it_cannot_take_are_config_errors(kw, match):
    """``find_batch_size(log_every=...)`` and ``(callbacks=...)`` were raw ``TypeError``s."""
    runner = lt.Runner.from_module(torch.nn.Linear(4, 1), "mse")
    with pytest.raises(lt.ConfigError, match=match):
        lt.find_batch_size(runner, _small_loader, lt.optim.sgd(0.1), memory_budget=2**40, **kw)


def _sgd_scheduler_optimizer():
    return lt.optim.sgd(0.1)


@pytest.mark.parametrize("make, match", [
    (lambda o: lt.optim.lr_scheduler.PolynomialLR(o, total_iters=4, power=-1), "power must be a number >= 0"),
    (lambda o: lt.optim.get_scheduler("cosine", o, 2, 10, scheduler_specific_kwargs={"cycles": 2}),
     "cosine takes no keyword 'cycles' .* num_cycles"),
    (lambda o: lt.optim.get_scheduler("linear", o, 2, 10, scheduler_specific_kwargs=[("a", 1)]),
     "scheduler_specific_kwargs must be a dict"),
    (lambda o: lt.optim.get_scheduler(["linear"], o, 2, 10), "is not one of transformers' scheduler types"),
])
def test_15_scheduler_arguments_that_failed_raw_are_config_errors(make, match):
    """``PolynomialLR(power=-1)`` failed with ``ZeroDivisionError`` at update 5, after 4
    updates; ``get_scheduler`` with an unknown keyword, a non-dict keyword set or a list
    as the name raised ``TypeError``: each is refused when the schedule is made."""
    with pytest.raises(lt.ConfigError, match=match):
        make(_sgd_scheduler_optimizer())


def test_15_a_multiplicative_factor_that_is_not_a_number_names_the_schedule():
    opt = _sgd_scheduler_optimizer()
    sched = lt.optim.lr_scheduler.MultiplicativeLR(opt, lr_lambda=lambda t: "0.9")
    runner = lt.Runner.from_module(torch.nn.Linear(2, 1), "mse")
    data = [(torch.randn(2, 2), torch.randn(2, 1)) for _ in range(4)]
    with pytest.raises(lt.ConfigError, match=r"MultiplicativeLR: lr_lambda\(1\) must return a number"):
        lt.train_samples(runner, lt.TrainConfig(steps=3, batch_size=1, optimizer=opt, scheduler=sched, log_every=0),
                         data)


def test_15_neftune_on_a_model_whose_get_input_embeddings_raises_is_a_config_error():
    class NoEmbeddings(torch.nn.Linear):
        def get_input_embeddings(self):
            raise NotImplementedError  # transformers' PreTrainedModel where a model does not say

    runner = lt.Runner.from_module(NoEmbeddings(2, 1), "mse")
    data = [(torch.randn(2, 2), torch.randn(2, 1)) for _ in range(2)]
    with pytest.raises(lt.ConfigError, match="neftune_noise_alpha needs a model with get_input_embeddings"):
        lt.train_samples(runner, lt.TrainConfig(steps=1, batch_size=1, log_every=0, neftune_noise_alpha=5.0), data)


TOKEN_SUM = '''
import torch
import leantrain

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.head(self.emb(input_ids))

def make():
    return Tiny()

def token_sum(logits, sample):
    labels = sample["labels"]
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1), reduction="sum")
    return leantrain.LossSum(total, labels.numel())

def data():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 20, (6,), generator=g) for _ in range(24)]
    samples = [{"input_ids": r, "labels": r} for r in rows]
    return samples[:16], samples[16:]
'''


def test_8_the_command_on_a_token_model_with_its_own_loss_sum_ends_cleanly(tmp_path, monkeypatch, capsys):
    """It trained, wrote report.json, then crashed at the end with ``KeyError:
    'test_perplexity'`` (exit 1): report.json omits null keys and the console indexed one."""
    from leantrain.cli.main import main

    (tmp_path / "toksum.py").write_text(TOKEN_SUM)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    code = main(["train", "--model", "toksum:make", "--data", "toksum:data", "--loss", "toksum:token_sum",
                 "--out", str(run), "--epochs", "1", "--batch-size", "8"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads((run / "report.json").read_text())
    assert "test_perplexity" not in report and report["tokens_seen"] == 16 * 6 and report["model"] == "toksum:make"
    assert None not in report.values() and "preset" not in report
    assert "tokens per second:" in out and "perplexity" not in out
    assert out.strip().splitlines()[-1].startswith("wrote ")


def _hf_run(tmp_path):
    """A run keeping a folder of checkpoints of a tiny Hugging Face GPT-2 (its config kept)."""
    pytest.importorskip("transformers")
    from hf_export_model import tiny

    run = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": t[None], "labels": t[None]} for t in torch.randint(0, 50, (8, 8), generator=g)]
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.adamw(0.05), log_every=0,
                               checkpoint_path=run / "checkpoints" / "step{step}.ckpt", keep_last=1)
    runner = lt.Runner.from_module(tiny(), "model")
    lt.train_loader(runner, cfg, lt.DataLoader(samples, batch_size=2))
    (run / "config.json").write_text(json.dumps({"model": "hf_export_model:tiny", "keep_last": 1}))
    (run / "metrics.jsonl").write_text("")
    return run, runner


def test_5_export_with_a_config_into_the_run_folder_is_refused(tmp_path, capsys):
    """``export RUN --weights --config hf.json -o RUN`` replaced the run's own config.json;
    ``train --resume RUN`` was then refused."""
    from leantrain.cli.main import main

    run, runner = _hf_run(tmp_path)
    hf = tmp_path / "hf.json"
    hf.write_text(runner.module.config.to_json_string())
    before = (run / "config.json").read_bytes()
    capsys.readouterr()
    for out in (run, run / "model.safetensors"):
        assert main(["export", str(run), "--weights", "--config", str(hf), "-o", str(out)]) == 2
        assert "is a leantrain run folder" in capsys.readouterr().err
    assert (run / "config.json").read_bytes() == before and not (run / "model.safetensors").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "weights.safetensors"])
def test_9_an_export_path_ending_in_safetensors_is_a_file_with_its_config_beside_it(tmp_path, capsys, name):
    """``export RUN --weights -o out/model.safetensors`` for a Hugging Face model made a
    *folder* named ``model.safetensors``."""
    import transformers
    from leantrain.cli.main import main

    run, runner = _hf_run(tmp_path)
    out = tmp_path / "out" / name
    assert main(["export", str(run), "--weights", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert out.is_file() and (out.parent / "config.json").is_file() and "config.json beside it" in said
    if name == "model.safetensors":
        loaded = transformers.GPT2LMHeadModel.from_pretrained(out.parent)
        assert all(torch.equal(t, loaded.state_dict()[k]) for k, t in runner.module.state_dict().items())
    else:
        assert "once the file is named model.safetensors" in said
        fresh = lt.Runner.from_module(tiny_model(), "model")
        lt.weights.load_weights(out, fresh)
        assert all(torch.equal(t, fresh.module.state_dict()[k]) for k, t in runner.module.state_dict().items())


def tiny_model():
    from hf_export_model import tiny

    return tiny()


def test_13_an_averaged_model_that_does_not_fit_is_refused_before_the_parameters_are_installed(tmp_path):
    """Resuming with an averaged model that did not match was refused only after the
    checkpoint's parameters were installed into the module."""
    from torch.optim.swa_utils import AveragedModel

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))

    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    model = net()
    lt.train_samples(lt.Runner.from_module(model, "mse"),
                     lt.TrainConfig(steps=2, optimizer=lt.optim.sgd(0.1), log_every=0, checkpoint_path=tmp_path / "c",
                                    averaging=lt.Averaging(AveragedModel(model))), data, log=None)
    fresh = net()
    before = [p.detach().clone() for p in fresh.parameters()]
    other = AveragedModel(fresh).double()  # the same names and shapes, another dtype
    with pytest.raises(lt.CheckpointError, match="averaged model does not fit"):
        lt.train_samples(lt.Runner.from_module(fresh, "mse"),
                         lt.TrainConfig(steps=4, optimizer=lt.optim.sgd(0.1), log_every=0, resume_from=tmp_path / "c",
                                        averaging=lt.Averaging(other)), data, log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))


@pytest.mark.parametrize("make", [
    lambda: lt.optim.warmup_cosine(0.1, 0.0, 8, 48),
    lambda: lt.optim.get_scheduler("cosine", lt.optim.adamw(0.1), num_warmup_steps=8, num_training_steps=48),
], ids=["warmup_cosine", "get_scheduler"])
def test_6_a_schedule_counted_in_updates_indexed_by_epoch_is_refused_naming_schedule_per(make):
    """A 3-epoch loader run of 16 batches with a horizon of 48 updates ran every epoch at
    one warm-up rate (lr 0.0 for the transformers-named one) and ended at chance, silently:
    a schedule whose peak lies past the run's epochs is refused, naming schedule_per='step'
    (which schedules it over updates and is accepted)."""
    with pytest.raises(lt.ConfigError, match=r"never leave its warm-up .* set schedule_per='step'"):
        lt.LoaderTrainConfig(epochs=3, scheduler=make())
    assert lt.LoaderTrainConfig(epochs=3, scheduler=make(), schedule_per="step").schedule_per == "step"
    assert lt.LoaderTrainConfig(epochs=60, scheduler=make()).epochs == 60  # an epoch horizon it reaches


def test_low_memory_budget_inf_is_refused():
    """``memory_budget=inf`` was accepted (and doubling never ends on a loader without a length)."""
    runner = lt.Runner.from_module(torch.nn.Linear(4, 1), "mse")
    with pytest.raises(lt.ConfigError, match="memory_budget must be a finite number of bytes > 0"):
        lt.find_batch_size(runner, _small_loader, lt.optim.sgd(0.1), memory_budget=float("inf"))


def test_low_an_exported_hugging_face_config_names_its_architecture(tmp_path):
    """A Hugging Face ``config.json`` written by export lacked ``architectures`` (what
    ``save_pretrained`` adds: the model's class)."""
    from leantrain.cli.main import main

    run, runner = _hf_run(tmp_path)
    assert main(["export", str(run), "--weights", "-o", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [type(runner.module).__name__]


RANDOM_DATA = '''
import random
import numpy
import torch

def make():
    return torch.nn.Linear(3, 1)

def data():
    rows = [(torch.tensor([random.random(), float(numpy.random.rand()), 1.0]), torch.tensor([random.random()]))
            for _ in range(24)]
    return rows[:16], rows[16:]
'''


def test_low_the_command_s_seed_seeds_python_and_numpy_as_the_api_does(tmp_path, monkeypatch):
    """``--seed`` seeded torch only, where the API's ``seed=`` also seeds Python's and
    NumPy's generators: data drawing from ``random`` differed between two identical runs."""
    from leantrain.cli.main import main

    (tmp_path / "randdata.py").write_text(RANDOM_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    reports = []
    for k in range(2):
        out = tmp_path / f"run{k}"
        assert main(["train", "--model", "randdata:make", "--data", "randdata:data", "--loss", "mse",
                     "--out", str(out), "--epochs", "1", "--batch-size", "4", "--seed", "3"]) == 0
        got = json.loads((out / "report.json").read_text())
        reports.append((got["loss_before"], got["loss_after"], got["test_loss"]))
    assert reports[0] == reports[1]


def test_low_warmup_ratio_without_a_scheduler_is_refused(tmp_path, capsys):
    """``--warmup-ratio`` with ``--scheduler none`` was silently ignored."""
    from leantrain.cli.main import main

    code = main(["train", "--preset", "digits-mlp", "--out", str(tmp_path / "r"), "--warmup-ratio", "0.1",
                 "--scheduler", "none", "--epochs", "1"])
    assert code == 2 and "--warmup-ratio" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_15_predict_over_an_uncollated_leantrain_loader_names_the_item_and_collate():
    """``lt.predict`` over an ``lt.DataLoader`` without a collate (each sample one item)
    raised torch's raw shape error."""
    torch.manual_seed(0)
    runner = lt.Runner.from_module(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)), "mse")
    samples = [(torch.randn(3), torch.randn(4)) for _ in range(8)]
    with pytest.raises(lt.DataError, match=r"predict: item 0: the model rejected the sample .*give collate="):
        lt.predict(runner, lt.DataLoader(samples, batch_size=4), collect=True)
    collated = lt.DataLoader(samples, batch_size=4, collate=torch.utils.data.default_collate)
    assert [tuple(o.shape) for o in lt.predict(runner, collated, collect=True)] == [(4, 4), (4, 4)]


def test_16_a_kept_run_resumed_under_a_renamed_template_says_what_to_do(tmp_path):
    """Resuming a kept run under a renamed template (``step{step}`` -> ``ck{step:04d}``) was
    refused with "progress.checkpoints: expected [name, step, metric, run id, file id]
    entries naming files of 'ck{step:04d}.ckpt'": now in plain words, nothing changed."""
    from models import class_batches, tiny_classifier

    def cfg(template, **kw):
        return lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.sgd(0.5), log_every=0, keep_last=2,
                                    checkpoint_every=1, checkpoint_path=tmp_path / "ck" / template, **kw)

    lt.train_loader(lt.Runner.from_module(tiny_classifier(), "cross_entropy"), cfg("step{step}.ckpt"),
                    class_batches(4, 1))
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    runner = lt.Runner.from_module(tiny_classifier(), "cross_entropy")
    with pytest.raises(lt.CheckpointError, match=r"kept its checkpoints under other names \(such as 'step4\.ckpt'\) "
                                                 r"than this run's checkpoint_path makes \('ck\{step:04d\}\.ckpt'\): "
                                                 r"resume with the checkpoint_path the run was started with"):
        lt.train_loader(runner, cfg("ck{step:04d}.ckpt", resume_from=tmp_path / "ck" / "step4.ckpt"),
                        class_batches(4, 1))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before


ROWS_SEEN = '''
import torch

largest = [0]

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 1)

    def forward(self, x):
        largest[0] = max(largest[0], x.shape[0])
        return self.a(x)

def make():
    return Net()

def data():
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(4, generator=g), torch.randn(1, generator=g)) for _ in range(80)]
    return rows[:64], rows[64:]
'''


def test_2_find_batch_size_measures_the_batch_size_it_recommends(tmp_path, monkeypatch, capsys):
    """Every trial reused the job's collate, which cut each batch into pieces of the
    configured ``--batch-size``: with ``--batch-size 8`` the largest forward was 8 rows,
    yet it advised "train with --batch-size 32"."""
    from leantrain.cli.main import main

    (tmp_path / "rowsseen.py").write_text(ROWS_SEEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import rowsseen

    assert main(["find-batch-size", "--model", "rowsseen:make", "--data", "rowsseen:data", "--loss", "mse",
                 "--batch-size", "8", "--memory-budget", str(2**20), "--max-batch-size", "32",
                 "--out", str(tmp_path / "f")]) == 0
    assert "train with --batch-size 32" in capsys.readouterr().out
    assert rowsseen.largest[0] == 32  # the forward the recommended flag runs


@pytest.mark.parametrize("keep", [False, True], ids=["one checkpoint file", "kept folder"])
def test_1_overwrite_never_removes_a_live_run_s_files(tmp_path, capsys, keep):
    """``--overwrite`` ignored a live run's lock: with one checkpoint file it deleted the
    live run's checkpoint, metrics, report and plot and rewrote config.json, and only then
    the lock refused the new run; with ``--keep-last`` it deleted the live run's lock and
    checkpoints as a killed run's, and the new run trained beside the live one."""
    import os
    import socket
    from leantrain.cli.main import main
    from leantrain.io.run_lock import NAME

    run = tmp_path / "run"
    extra = ["--keep-last", "2"] if keep else []
    assert main(["train", "--preset", "digits-mlp", "--out", str(run), "--epochs", "1", *extra]) == 0
    lock = run / "checkpoints" / NAME if keep else run / f".checkpoint.ckpt{NAME}"
    with _live_process() as pid:
        lock.write_text(json.dumps({"run": "the-live-one", "pid": pid, "host": socket.gethostname(),
                                    "started": "now"}))
        before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
        capsys.readouterr()
        assert main(["train", "--preset", "digits-mlp", "--out", str(run), "--epochs", "1", "--overwrite",
                     *extra]) == 2
        assert "may still be running (run the-live-one" in capsys.readouterr().err
        assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def _live_process():
    """A child process that runs until the block ends (a lock's live holder)."""
    import contextlib
    import subprocess
    import sys

    @contextlib.contextmanager
    def running():
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            yield child.pid
        finally:
            child.stdin.close()
            child.wait()
    return running()


def _lock_file(path, run, pid):
    import socket

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run, "pid": pid, "host": socket.gethostname(), "started": "then"}))


def test_10_a_job_restarted_in_place_takes_over_its_dead_incarnation_s_lock(tmp_path):
    """A container restart gives the same hostname and pid: the job's own dead incarnation's
    lock refused it, calling its own run id "another run"."""
    import os
    from leantrain.io.run_lock import RunLock

    path = tmp_path / ".c.ckpt.leantrain-run.json"
    _lock_file(path, "run-1", os.getpid())  # this pid, held by no run of this process: a dead incarnation
    lock = RunLock(path, "run-1")
    assert lock.acquire("t", "c.ckpt") is None and lock.held
    other = RunLock(path, "run-2")  # while it is held, a second run of this process is refused
    assert "another run writes the checkpoints of c.ckpt: run run-1" in other.acquire("t", "c.ckpt")
    lock.release()
    assert not path.exists()


def test_10_a_killed_run_s_unreaped_process_does_not_hold_its_lock(tmp_path):
    """A killed run's zombie (dead, not yet reaped by its parent) blocked the resume."""
    import os
    from leantrain.io.atomic import process_alive
    from leantrain.io.run_lock import RunLock

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # it has exited; left unreaped: a zombie
    try:
        assert not process_alive(pid)
        path = tmp_path / ".c.ckpt.leantrain-run.json"
        _lock_file(path, "run-1", pid)
        assert RunLock(path, "run-1").acquire("t", "c.ckpt") is None
    finally:
        os.waitpid(pid, 0)


def test_11_a_takeover_lost_to_another_run_leaves_that_run_s_lock(tmp_path, monkeypatch):
    """Two runs taking over one dead lock at once could both hold it: the takeover moves the
    dead lock aside first, and what it moved is checked (injected: another run takes the
    lock over between this run's read and its move)."""
    from leantrain.io import run_lock

    path = tmp_path / ".c.ckpt.leantrain-run.json"
    _lock_file(path, "dead-run", 2**22 + 12345)  # no such process
    real = run_lock.os.rename
    with _live_process() as pid:
        def rename(src, dst):
            if str(src) == str(path) and not str(dst).endswith(".restored"):
                _lock_file(path, "quicker-run", pid)  # the other run's takeover lands first
            return real(src, dst)
        monkeypatch.setattr(run_lock.os, "rename", rename)
        got = run_lock.RunLock(path, "slower-run").acquire("t", "c.ckpt")
        assert got is not None and "run quicker-run" in got
        assert json.loads(path.read_text())["run"] == "quicker-run"
        assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_12_a_file_in_a_folder_a_live_run_keeps_is_refused(tmp_path):
    """Locks were per file name: a second job checkpointing to ``kept/step4.ckpt`` replaced
    a live run's kept file."""
    from leantrain.io.run_lock import NAME

    kept = tmp_path / "kept"
    with _live_process() as pid:
        _lock_file(kept / NAME, "keeping-run", pid)
        (kept / "step4.ckpt").write_bytes(b"the live run's")
        runner = lt.Runner.from_module(torch.nn.Linear(2, 1), "mse")
        data = [(torch.randn(2, 2), torch.randn(2, 1)) for _ in range(2)]
        with pytest.raises(lt.LeantrainError, match="another run writes the checkpoints of .*run keeping-run"):
            lt.train_samples(runner, lt.TrainConfig(steps=2, batch_size=1, log_every=0,
                                                    checkpoint_path=kept / "step4.ckpt"), data, log=None)
        assert (kept / "step4.ckpt").read_bytes() == b"the live run's"


def test_7_evaluate_weighs_the_loss_by_examples_as_trainer_and_lightning_do():
    """``evaluate`` averaged batch means, so a short last batch weighed as much as a full
    one: 66 rows in batches of 8 with "mse" gave the mean of the 9 batch means where
    transformers' Trainer and Lightning give the mean over the 66 examples. The same number
    drives keep_best, load_best_at_end and EarlyStopping. Batches of one size keep
    upstream's mean of items, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    runner = lt.Runner.from_module(model, "mse")
    x, y = torch.randn(66, 3), torch.randn(66, 1)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 66, 8)]
    got = lt.evaluate(runner, batches)["loss"]
    with torch.no_grad():
        over_examples = float(torch.nn.functional.mse_loss(model(x), y))
        means = [torch.nn.functional.mse_loss(model(a), b) for a, b in batches]
    assert got == pytest.approx(over_examples, rel=1e-6)
    assert abs(got - float(sum(means) / len(means))) > 1e-3  # the old figure, far from it
    even = batches[:8]  # 64 rows: one size
    with torch.no_grad():
        total = None
        for a, b in even:
            loss = torch.nn.functional.mse_loss(model(a), b)
            total = loss if total is None else total + loss
    assert lt.evaluate(runner, even)["loss"] == float(total * (1.0 / 8))


def test_item_17_a_csv_log_with_a_newline_in_a_metric_name_resumes_as_the_straight_run(tmp_path):
    """A metric named with a newline, a quote and a comma: killed after update 7 (an epoch
    is 4 updates, checkpoints every 3) and resumed, the CSV log holds the straight run's
    records once each, numbered alike (the log is trimmed as CSV records, not lines)."""
    import csv

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(16)]

    def metric(o, t):
        return (o - t).abs().mean()

    def run(name, kill=None, resume=None):
        torch.manual_seed(0)
        runner = lt.Runner.from_module(torch.nn.Linear(3, 1), "mse")
        cfg = lt.LoaderTrainConfig(epochs=3, eval_data={"val": data[:4]}, eval_metrics={'m\nx "q",': metric},
                                   checkpoint_path=tmp_path / f"{name}.ckpt", checkpoint_every=3,
                                   resume_from=resume, log_every=2)

        def killer(e):
            if e.step == kill:
                raise KeyboardInterrupt

        try:
            lt.train_loader(runner, cfg, lt.DataLoader(data, batch_size=4, shuffle=True, seed=1), log=None,
                            callbacks=[lt.CSVLogger(tmp_path / f"{name}.csv")], callback=killer)
        except KeyboardInterrupt:
            pass
        with open(tmp_path / f"{name}.csv", newline="") as f:
            return [r for r in csv.reader(f) if r[3] != "samples_per_s"]

    straight = run("straight")
    run("resumed", kill=7)
    resumed = run("resumed", resume="auto")
    assert resumed == straight and sum(r[3] == 'val_m\nx "q",' for r in straight) == 3


def test_low_a_schedule_that_goes_negative_is_named_with_its_index():
    class Falling(lt.optim.Schedule):
        def lr_at(self, t):
            return 0.1 - 0.2 * t

    runner = lt.Runner.from_module(torch.nn.Linear(2, 1), "mse")
    data = [(torch.randn(2), torch.randn(1)) for _ in range(4)]
    with pytest.raises(lt.ConfigError, match=r"the scheduler Falling gives at index 1 what the optimizer refuses "
                                             r"\(OptState.with_lr: lr must be finite and >= 0, got -0.1\)"):
        lt.train_samples(runner, lt.TrainConfig(steps=3, scheduler=Falling(), log_every=0), data, log=None)


def test_low_a_scheduler_standing_a_billion_steps_in_is_refused_not_replayed():
    import time

    t0 = time.perf_counter()
    with pytest.raises(lt.ConfigError, match=r"lr_scheduler.StepLR: last_epoch=1000000000 stands 1000000001 steps in"):
        lt.optim.lr_scheduler.StepLR(0.1, 3, last_epoch=10**9)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    sched.last_epoch = 10**8  # a long-stepped scheduler (as a job that ran for days leaves it)
    with pytest.raises(lt.ConfigError, match=r"optim.from_torch: StepLR stands 100000000 steps in"):
        lt.optim.from_torch(sched)
    assert time.perf_counter() - t0 < 5  # refused at once, no replay
    assert lt.optim.lr_scheduler.StepLR(0.1, 3, last_epoch=5).lr_at(0) == pytest.approx(0.1 * 0.1 ** 2)
