"""Parameter sharding in one process (a one-rank plan): what a user meets without a
process group. The runs give the unsharded bits; what the mode does not take is refused
before anything is released or trained; a model that reads a released Parameter outside
its module's forward is refused with the slot named, not a crash; a failed run leaves the
module whole; NumPy-shared parameter memory is given memory of its own first.

Also (#55): a model with buffers and one item per update (whose backward once read
released storage) trains with the unsharded bits, from the library and from the command
(``--preset digits-cnn``); the read-outside refusal is a ``ConfigError`` whether or not
the run measures its loss first, also where buffers take a pass of their own; the
collective error types are public; a moving average of the weights (``ema_decay``,
``eval_ema``) is the unsharded one's bits, checkpointed and resumed; torch's transformer
layers (each gathered whole for its forward) and a Hugging Face Llama with a tied head
train with the unsharded bits."""

import copy
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from leantrain.cli.main import main
from leantrain.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent.parent / "zoo"))
import zoo_models  # noqa: E402

GPT = zoo_models.BY_NAME["gpt_persistent_mask"]


def config(**kw):
    base = dict(steps=4, batch_size=3, optimizer=lt.optim.adamw(1e-2, weight_decay=0.1), log_every=1)
    return lt.TrainConfig(**dict(base, **kw))


def trained(sharding, model=None, data=None, **kw):
    model = GPT.model(0) if model is None else model
    runner = lt.Runner.from_module(model, GPT.loss if data is None else "mse")
    torch.manual_seed(5)
    report = lt.train_samples(runner, config(sharding=sharding, **kw), GPT.samples(7) if data is None else data,
                              log=None)
    return model, report


def same_values(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
               for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_one_process_with_evaluations_and_a_callback_is_the_unsharded_run():
    eval_data = GPT.samples(2, seed=9)
    seen = {None: [], "parameters": []}

    def callback(sharding):
        def on_step(event):  # the user's code reads the weights between updates: whole, current
            seen[sharding].append(runner_of[sharding].module.blocks[0].attn.qkv.weight.detach().clone())
        return on_step

    runner_of, reports = {}, {}
    for sharding in (None, "parameters"):
        model = GPT.model(0)
        runner_of[sharding] = runner = lt.Runner.from_module(model, GPT.loss)
        torch.manual_seed(5)
        reports[sharding] = lt.train_samples(runner, config(sharding=sharding, eval_data=eval_data, eval_every=2),
                                             GPT.samples(7), log=None, callback=callback(sharding))
    assert same_values(runner_of[None].module, runner_of["parameters"].module)
    assert reports[None].losses == reports["parameters"].losses and len(reports[None].losses) == 4
    assert reports[None].evals == reports["parameters"].evals and len(reports[None].evals) == 2
    assert len(seen["parameters"]) == 4
    for a, b in zip(seen[None], seen["parameters"]):
        assert torch.equal(a, b)
    model = runner_of["parameters"].module
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize("extra, named", [(dict(compile=True), "compile"), (dict(accumulation="vectorized"), "vectorized")])
def test_what_the_mode_does_not_take_is_refused_by_the_config(extra, named):
    with pytest.raises(ConfigError, match=f"sharding='parameters' does not take .*{named}"):
        config(sharding="parameters", **extra)


class Viewed(nn.Module):
    """Two parameters over one block of memory (a flat buffer's views)."""

    def __init__(self):
        super().__init__()
        flat = torch.randn(4 * 3 + 3)
        self.weight = nn.Parameter(flat[:12].view(3, 4))
        self.bias = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x @ self.weight.t() + self.bias


def data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(4)]


def test_a_parameter_viewing_a_larger_block_is_refused_before_anything_changes(unchanged):
    model = Viewed()
    runner = lt.Runner.from_module(model, "mse")
    before = model.weight.detach().clone()
    with unchanged(runner.params):
        with pytest.raises(ConfigError, match=r"slot \d+ \(weight\).*view into a larger block"):
            lt.train_samples(runner, config(sharding="parameters", batch_size=2), data(), log=None)
    assert model.weight.untyped_storage().nbytes() == 15 * 4  # never released
    assert torch.equal(model.weight, before)


class Reaches(nn.Module):
    """The root reads a child's weight directly, outside the child's forward."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = self.inner(x)
        return self.head(h) + h @ self.inner.weight[:, :3]


def test_a_parameter_read_outside_its_modules_forward_is_refused_and_the_module_is_whole_again():
    model = Reaches()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    runner = lt.Runner.from_module(model, "mse")
    with pytest.raises(ConfigError, match=r"slot \d+ \(inner\.weight\) was read outside the forward"):
        lt.train_samples(runner, config(sharding="parameters", batch_size=2), data(), log=None)
    for k, v in model.state_dict().items():  # nothing updated, every storage whole again
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
        assert torch.equal(v, before[k]), k


def test_shard_units_gather_a_block_whole_so_a_block_reading_its_childs_weight_trains():
    """``shard_units=(Reaches,)``: each instance is one unit gathered for its whole
    forward and backward (FSDP2's ``fully_shard`` on a block), so the read the default
    units refuse trains, with the unsharded bits; the zoo GPT with its blocks as units (the
    default: each element of an ``nn.ModuleList``; and named) and with every module its own."""
    for build, samples, loss, units in ((Reaches, data(), "mse", (Reaches,)),
                                        (lambda: GPT.model(0), GPT.samples(7), GPT.loss, None),
                                        (lambda: GPT.model(0), GPT.samples(7), GPT.loss, (zoo_models.Block,)),
                                        (lambda: GPT.model(0), GPT.samples(7), GPT.loss, ())):
        torch.manual_seed(0)
        sharded = lt.Runner.from_module(build(), loss)
        torch.manual_seed(0)
        plain = lt.Runner.from_module(build(), loss)
        torch.manual_seed(3)
        lt.train_samples(sharded, config(sharding="parameters", batch_size=2, shard_units=units), samples, log=None)
        torch.manual_seed(3)
        lt.train_samples(plain, config(batch_size=2), samples, log=None)
        for (k, a), b in zip(sharded.module.state_dict().items(), plain.module.state_dict().values()):
            assert torch.equal(a, b), k
    with pytest.raises(ConfigError, match=r"shard_units is for sharding='parameters'"):
        config(sharding="gradients", shard_units=(Reaches,))
    with pytest.raises(ConfigError, match=r"shard_units must be a tuple of torch.nn.Module classes"):
        config(sharding="parameters", shard_units=("Block",))


def test_a_run_that_fails_in_the_users_callback_leaves_the_module_whole():
    def boom(event):
        if event.step == 2:
            raise RuntimeError("the user's callback failed")

    model = GPT.model(0)
    runner = lt.Runner.from_module(model, GPT.loss)
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        lt.train_samples(runner, config(sharding="parameters"), GPT.samples(7), log=None, callback=boom)
    plain = GPT.model(0)
    lt.train_samples(lt.Runner.from_module(plain, GPT.loss), config(steps=2), GPT.samples(7), log=None)
    assert same_values(model, plain)  # two updates, then whole: one process owns every range
    assert model.lm_head.weight is model.tok_emb.weight


def test_numpy_shared_parameter_memory_is_given_memory_of_its_own_and_trains_alike():
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 3))
        shared = np.ascontiguousarray(m[0].weight.detach().numpy().copy())
        m[0].weight = nn.Parameter(torch.from_numpy(shared))  # its storage cannot be resized
        return m, shared

    a, _ = build()
    b, shared = build()
    weight = b[0].weight
    lt.train_samples(lt.Runner.from_module(a, "mse"), config(batch_size=2), data(), log=None)
    lt.train_samples(lt.Runner.from_module(b, "mse"), config(sharding="parameters", batch_size=2), data(), log=None)
    assert b[0].weight is weight and same_values(a, b)
    assert not np.array_equal(shared, b[0].weight.detach().numpy())  # the user's array was left alone


def test_the_loader_loop_takes_it_too():
    def run(sharding):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 3)),
                                             batch_size=6, shuffle=False)
        cfg = lt.LoaderTrainConfig(epochs=2, optimizer=lt.optim.adam(1e-2), log_every=1, pieces=2, sharding=sharding)
        report, _ = lt.train_loader(lt.Runner.from_module(model, "mse"), cfg, loader, log=None)
        return model, report

    (a, ra), (b, rb) = run(None), run("parameters")
    assert same_values(a, b) and ra.losses == rb.losses and len(ra.losses) == 8


def test_a_config_names_the_mode_in_its_choices():
    with pytest.raises(ConfigError, match="'parameters'"):
        replace(config(), sharding="params")


@pytest.mark.parametrize("by, clip", [("range", None), ("slot", 0.5)])
def test_on_device_mirrors_the_mirrors_are_released_and_the_run_is_the_unsharded_one(by, clip):
    """The CUDA semantics on CPU mirrors: the working tensors (the mirrors) are what is
    released and gathered; the module's own (host) tensors get the trained values when
    the loop returns. Whole slots per rank with clipping: ``clip_grad_norm_``'s bits."""
    import shard_cases as sc

    out, held = [], {None: [], "parameters": []}
    for sharding in (None, "parameters"):
        torch.manual_seed(4)
        runner = lt.Runner.from_module(sc.Wide(), "mse").to("cpu")
        mirrors = [s.mirror for s in runner.params.storages()]
        loss_fn = runner.loss_fn

        def watched(*args, runner=runner, sharding=sharding):
            held[sharding].append([v.name for v in runner.params if v.storage.mirror.requires_grad
                                   and v.storage.mirror.untyped_storage().nbytes()])
            return loss_fn(*args)

        runner.loss_fn = watched
        cfg = lt.TrainConfig(steps=5, batch_size=3, optimizer=lt.optim.adamw(1e-2), log_every=1, sharding=sharding,
                             shard_by=by, clip_grad_norm=clip, measure_loss=False)
        report = lt.train_samples(runner, cfg, sc.wide_data(), log=None)
        assert [s.mirror for s in runner.params.storages()] == mirrors
        out.append(([p.detach().clone() for p in runner.module.state_dict().values()], report.losses))
    (a, la), (b, lb) = out
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and la == lb
    assert all(len(names) == 8 for names in held[None])  # every trained slot, the tie's both occurrences
    # the sharded run's mirrors, at the loss: released but the last module's (kept for its backward)
    # and the b/c tie's (two units: gathered once per forward, kept until its gradient is handed
    # over); in the first update, under the guard, the tie goes between its units (and the first
    # forward has not learned the last module yet)
    tie = ["b.weight", "c.weight"]
    assert all(names in ([], ["head.weight"], tie + ["head.weight"]) for names in held["parameters"]), held["parameters"]
    assert tie + ["head.weight"] in held["parameters"], held["parameters"]


def test_skipped_nonfinite_updates_and_a_resume_from_an_unsharded_file_match_the_unsharded_run(tmp_path):
    """``nonfinite="skip"`` puts back the owned ranges and their state as unsharded; a run
    saved unsharded (one file) resumes under parameter sharding to the straight bits."""
    bad = data()
    bad[1] = (torch.full((2, 4), float("nan")), bad[1][1])

    def run(sharding, stop_at=None, **kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        report = lt.train_samples(lt.Runner.from_module(model, "mse"),
                                  config(batch_size=2, steps=6, nonfinite="skip", sharding=sharding, **kw), bad, log=None,
                                  callback=lambda event: event.step == stop_at)
        return model, report

    (a, ra), (b, rb) = run(None), run("parameters")
    assert same_values(a, b) and rb.skipped_steps == ra.skipped_steps > 0
    stopped = tmp_path / "stopped.ckpt"
    run(None, stop_at=3, checkpoint_path=stopped)
    c, rc = run("parameters", resume_from=stopped, checkpoint_path=tmp_path / "resumed")
    assert same_values(a, c)


def test_a_callback_that_runs_the_model_still_reads_whole_parameters():
    """The user's code holds the parameters whole: a forward it runs (an evaluation of its
    own) does not release them under it."""
    model = GPT.model(0)
    runner = lt.Runner.from_module(model, GPT.loss)
    probe = GPT.samples(1, seed=4)
    seen = []

    def callback(event):
        runner.mean_loss(probe)  # the model's forward, inside the callback
        seen.append(all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters()))
        seen.append(float(model.lm_head.weight.detach().sum()))  # a read that would fault on released memory

    lt.train_samples(runner, config(sharding="parameters"), GPT.samples(7), log=None, callback=callback)
    assert seen[0::2] == [True] * 4 and all(v == v for v in seen[1::2])


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))


@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "parameters"])
def test_one_item_per_update_with_buffers_gives_the_unsharded_bits(sharding):
    model = _cnn()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    runs = []
    for m, kw in ((model, {"sharding": sharding}), (ref, {})):
        runner = lt.Runner.from_module(m, "cross_entropy")
        report, _ = lt.train_loader(runner, lt.LoaderTrainConfig(epochs=2, optimizer=optim.adam(1e-2), log_every=1,
                                                                 **kw), data, log=None)
        runs.append(report)
    assert runs[0].losses == runs[1].losses and (runs[0].before, runs[0].after) == (runs[1].before, runs[1].after)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def test_the_digits_cnn_preset_trains_under_parameter_sharding_with_the_unsharded_parameters(tmp_path, capsys):
    for name, extra in (("sharded", ["--sharding", "parameters"]), ("plain", [])):
        assert main(["train", "--preset", "digits-cnn", "--epochs", "1", "--out", str(tmp_path / name), *extra]) == 0
    capsys.readouterr()
    sharded = lt.read_checkpoint(tmp_path / "sharded" / "checkpoint.ckpt")[1]
    plain = lt.read_checkpoint(tmp_path / "plain" / "checkpoint.ckpt")[1]
    keys = [k for k in plain if k.startswith(("storage.", "state."))]
    assert len(keys) > 16 and all(torch.equal(sharded[k], plain[k]) for k in keys)


class ReadsOutside(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.norm(self.a(x)) + self.a.weight.sum())  # a.weight outside a's forward


@pytest.mark.parametrize("measure_loss", [True, False])
def test_a_parameter_read_outside_its_module_is_a_config_error_naming_the_slot(measure_loss):
    model = ReadsOutside()
    before = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(3)]
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), sharding="parameters", measure_loss=measure_loss,
                               log_every=0)
    with pytest.raises(lt.ConfigError, match=r"train_loader: sharding='parameters': slot 0 \(a.weight\) was read "
                                             r"outside the forward of the module that holds it"):
        lt.train_loader(lt.Runner.from_module(model, "mse"), cfg, data, log=None)
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))


class TieReadOutside(torch.nn.Module):
    """A tie two units use (``a`` and ``c``), read between them outside either's forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.c, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        self.c.weight = self.a.weight

    def forward(self, x):
        return self.b(self.c(self.a(x) + self.a.weight.sum()))


def test_a_tie_read_between_its_units_is_refused_though_training_keeps_it_gathered():
    """Training keeps a tie two units use gathered from its first use to its gradient, so
    the read between them would pass there and touch released memory in a forward without
    a gradient (an evaluation): the first update releases it between its units, and the
    guard names it."""
    model = TieReadOutside()
    before = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(3)]
    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=optim.sgd(0.1), sharding="parameters", log_every=0,
                               measure_loss=False)  # no loss before the first update: its forward is the one guarded
    with pytest.raises(lt.ConfigError, match=r"train_loader: sharding='parameters': slot 0 \(a.weight\) was read "
                                             r"outside the forward of the module that holds it"):
        lt.train_loader(lt.Runner.from_module(model, "mse"), cfg, data, log=None)
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))
    assert model.c.weight is model.a.weight


def test_the_public_autograd_grad_route_is_not_taken_for_a_read_outside_a_forward(monkeypatch):
    """On a GPU (and for tensor subclasses) the step differentiates through the public
    ``torch.autograd.grad``, which names the released Parameters as its inputs: the first
    update's guard lets it through (it refused it as a read outside a forward, seen on an
    H200). Forced here on the CPU: the run equals the unsharded one."""
    from leantrain.training.runner import backward

    monkeypatch.setattr(backward, "_ENGINE", None)  # every step through torch.autograd.grad
    plain, _ = trained(None)
    sharded, _ = trained("parameters")
    assert same_values(plain, sharded)


def test_the_collective_error_types_are_public():
    from leantrain.training.parallel import distributed

    assert lt.CollectiveError is distributed.CollectiveError and issubclass(lt.CollectiveError, RuntimeError)
    assert lt.ReplicaError is distributed.ReplicaError and issubclass(lt.ReplicaError, lt.LeantrainError)


def test_the_average_evaluated_in_the_users_callback_is_the_unsharded_ones():
    """A step callback runs with every Parameter whole; evaluating the average there
    (``evaluate(..., ema=True)``) reads the average, not the trained weights."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(5)]
    seen = {}
    for sharding in ("parameters", None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        runner = lt.Runner.from_module(model, "mse")
        losses = seen[sharding] = []

        def on_step(event, runner=runner, losses=losses):
            losses.append((lt.evaluate(runner, data[:2], ema=True)["loss"], lt.evaluate(runner, data[:2])["loss"]))
        lt.train_loader(runner, lt.LoaderTrainConfig(epochs=1, optimizer=optim.adamw(1e-2), sharding=sharding,
                                                     ema_decay=0.5, log_every=0, measure_loss=False),
                        data, log=None, callback=on_step)
    assert seen["parameters"] == seen[None] and len(seen[None]) == 5
    assert all(avg != trained for avg, trained in seen[None][1:])  # the average is not the weights


def _ema_run(sharding, tmp_path=None, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(5)]
    runner = lt.Runner.from_module(model, "mse")
    ck = {} if tmp_path is None else {"checkpoint_path": tmp_path / "ck", "checkpoint_every": 1}
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=optim.adamw(1e-2), sharding=sharding, log_every=1, ema_decay=0.9,
                               eval_data=data[:2], eval_ema=True, **ck, **kw)
    report, _ = lt.train_loader(runner, cfg, data, log=None)
    with runner.ema.applied(runner.params):
        averaged = [p.detach().clone() for p in model.parameters()]
    return report, [t.clone() for t in model.state_dict().values()], averaged


def test_a_moving_average_under_parameter_sharding_is_the_unsharded_ones_bits_and_resumes(tmp_path):
    plain = _ema_run(None)
    sharded = _ema_run("parameters")
    assert sharded[0].evals == plain[0].evals and sharded[0].losses == plain[0].losses
    assert all(torch.equal(a, b) for a, b in zip(sharded[1] + sharded[2], plain[1] + plain[2]))
    _ema_run("parameters", tmp_path, max_steps=3)
    resumed = _ema_run("parameters", tmp_path, resume_from=tmp_path / "ck")
    assert resumed[0].evals == plain[0].evals
    assert all(torch.equal(a, b) for a, b in zip(resumed[1] + resumed[2], plain[1] + plain[2]))


def _same_run(make, loss, data, eval_data):
    results = []
    for sharding in ("parameters", None):
        model = make()
        runner = lt.Runner.from_module(model, loss)
        report, _ = lt.train_loader(runner, lt.LoaderTrainConfig(epochs=2, optimizer=optim.adamw(1e-2), log_every=1,
                                                                 sharding=sharding, eval_data=eval_data), data, log=None)
        results.append((report.losses, report.evals, [t.clone() for t in model.state_dict().values()], model))
    (losses, evals, values, model), (plain_losses, plain_evals, plain_values, _) = results
    assert losses == plain_losses and evals == plain_evals
    assert all(torch.equal(a, b) for a, b in zip(values, plain_values))
    return model


def test_torch_transformer_layers_train_under_parameter_sharding_with_the_unsharded_bits():
    entry = zoo_models.BY_NAME["torch_encoder"]
    data = entry.samples(4)
    _same_run(lambda: entry.model(0), entry.loss, data, data[:2])  # evaluation: the layers' fast path too


def test_a_hugging_face_llama_trains_under_parameter_sharding_with_the_unsharded_bits_and_its_tie():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 64, (2, 12), generator=g) for _ in range(4))]

    def make():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    model = _same_run(make, "model", data, data[:2])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_released_modules_own_forward_is_refused_by_name_until_its_checkpoint_is_loaded(tmp_path):
    """#68 (low): ``gather_at_end=False`` leaves the module released; calling it is a
    ``ConfigError`` naming the tensor, not torch's error about a storage of size 0, and
    once its sharded checkpoint is loaded into it the guard goes and it computes the
    unsharded run's outputs."""
    data = [(torch.randn(4), torch.randn(2)) for _ in range(6)]
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    runner = lt.Runner.from_module(model, "mse")
    cfg = config(steps=3, batch_size=2, sharding="parameters", gather_at_end=False, checkpoint_path=tmp_path / "ck")
    lt.train_samples(runner, cfg, data, log=None)
    with pytest.raises(ConfigError, match=r"'0.weight' holds no values: the sharding='parameters' run ended with the "
                                          r"module released .* lt.load_checkpoint\(path, runner\)"):
        model(torch.zeros(1, 4))
    with pytest.raises(ConfigError, match="'0.weight'"):
        lt.evaluate(runner, data)  # leantrain's own calls refuse it by name too
    lt.load_checkpoint(tmp_path / "ck", runner)  # into the released module itself: its memory back, then filled
    assert runner.unfilled == {} and lt.evaluate(runner, data)["items"] == 6
    lt.train_samples(lt.Runner.from_module(plain, "mse"), replace(cfg, sharding=None, gather_at_end=None,
                                                                 checkpoint_path=None), data, log=None)
    x = torch.randn(3, 4)
    assert torch.equal(model(x), plain(x))
    assert all(not m._forward_pre_hooks for m in model.modules())  # the guards went with the first forward
