"""The third hostile round (#39), by public operation: weight folders (precedence, a save
replacing a sharded folder, a config that cannot be written), LossSum counts, the TOML
file, paths the OS refuses, a loader state torch rejects, export into its own source,
and the plot of a run that logged nothing. Each case asserts the typed error (or the
command's one-line exit 2) and unchanged parameters, optimizer state and files."""

import json

import numpy
import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain import optim
from leantrain.cli.main import main
from models import class_batches, tiny_classifier


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -------------------------------------------------------------- weight folders
def test_load_weights_prefers_model_safetensors_over_a_stale_index_as_from_pretrained_does(tmp_path):
    old, new = tiny_classifier(1), tiny_classifier(2)
    lt.weights.save_weights(tmp_path / "model-00001-of-00001.safetensors", lt.Runner.from_module(old))
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n, _ in old.named_parameters()}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    lt.weights.save_weights(tmp_path / "model.safetensors", lt.Runner.from_module(new))  # newer, one file
    target = lt.Runner.from_module(tiny_classifier(3))
    lt.weights.load_weights(tmp_path, target)
    assert same(target.params.values(), lt.Runner.from_module(new).params.values())


def test_save_weights_pretrained_removes_the_sharded_format_it_replaces(tmp_path):
    old = tiny_classifier(1)
    shard = tmp_path / "model-00001-of-00001.safetensors"
    lt.weights.save_weights(shard, lt.Runner.from_module(old))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: shard.name for n, _ in old.named_parameters()}}))
    (tmp_path / "notes.txt").write_text("mine")
    new = lt.Runner.from_module(tiny_classifier(2))
    lt.weights.save_weights(tmp_path, new, pretrained=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    back = lt.Runner.from_module(tiny_classifier(3))
    lt.weights.load_weights(tmp_path, back)
    assert same(back.params.values(), new.params.values())


def test_a_config_that_cannot_be_written_leaves_no_half_written_folder(tmp_path):
    class Config:
        def to_json_string(self):
            raise TypeError("Object of type Tensor is not JSON serializable")

    model = tiny_classifier()
    model.config = Config()
    with pytest.raises(lt.CheckpointError, match="config cannot be written as JSON.*nothing was written"):
        lt.weights.save_weights(tmp_path / "out", lt.Runner.from_module(model), pretrained=True)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("blocked", ["config.json", "model.safetensors"])
def test_a_pretrained_folder_is_written_whole_or_not_at_all(tmp_path, blocked):
    """The config or the weights cannot be written (a folder holds the name): the folder
    keeps what it held, no new weights beside the old config or the reverse."""
    class Config:
        def to_json_string(self):
            return json.dumps({"model_type": "tiny"})

    model = tiny_classifier()
    model.config = Config()
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "old"}') if blocked != "config.json" else None
    (out / blocked).mkdir(exist_ok=True)
    if blocked == "config.json":
        (out / "model.safetensors").write_bytes(b"old weights")
    before = {p.name: (p.read_bytes() if p.is_file() else None) for p in out.iterdir()}
    with pytest.raises(lt.CheckpointError):
        lt.weights.save_weights(out, lt.Runner.from_module(model), pretrained=True)
    assert {p.name: (p.read_bytes() if p.is_file() else None) for p in out.iterdir()} == before


def test_a_symlinked_shard_in_a_weights_index_is_refused(tmp_path):
    model = tiny_classifier(1)
    elsewhere = tmp_path / "elsewhere.safetensors"
    lt.weights.save_weights(elsewhere, lt.Runner.from_module(model))
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "model-00001-of-00001.safetensors").symlink_to(elsewhere)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00001-of-00001.safetensors" for n, _ in model.named_parameters()}}))
    target = lt.Runner.from_module(tiny_classifier(2))
    before = target.params.values()
    with pytest.raises(lt.CheckpointError, match="no folder, no symlink"):
        lt.weights.load_weights(folder, target)
    assert same(before, target.params.values())


# ---------------------------------------------------------------- LossSum
class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w


def _counted_loss(dtype, count):
    def loss(out, y):
        return lt.LossSum(((out - y) ** 2).sum(), torch.tensor(count, dtype=dtype))
    return loss


@pytest.mark.parametrize("dtype, count", [(torch.uint8, 200), (torch.int8, 100), (torch.int16, 20000),
                                          (torch.int32, 2**30)])
def test_lossum_counts_are_summed_in_int64_whatever_their_dtype(dtype, count):
    """Two counts summed past their dtype's range (200 + 200 in uint8 was 144; in int8 the
    sum turned negative and the update went uphill)."""
    x, y = torch.ones(3), torch.zeros(3)
    r = lt.Runner.from_module(Counted(), _counted_loss(dtype, count))
    opt = optim.sgd(1.0)
    state = opt.init(r.params)
    state, loss = lt.step_batch_and_loss(r, opt, state, False, [(x, y), (x, y)])
    assert loss == pytest.approx(6.0 / (2 * count))
    assert torch.allclose(r.params.values()[0], torch.full((3,), 1 - 2 * 2 / (2 * count)))


def test_lossum_counts_that_are_numpy_integers_work_and_bad_ones_are_refused():
    x, y = torch.ones(3), torch.zeros(3)
    for count, ok in ((numpy.int64(4), True), (2**60, False), (0, False), (2.5, False)):
        r = lt.Runner.from_module(Counted(), lambda out, t, c=count: lt.LossSum(((out - t) ** 2).sum(), c))
        opt = optim.sgd(0.1)
        state = opt.init(r.params)
        before = r.params.values()
        if ok:
            lt.step_batch(r, opt, state, False, [(x, y)])
            continue
        with pytest.raises(lt.DataError, match=r"LossSum.count must be an integer in \[1, 2\*\*53\]"):
            lt.step_batch(r, opt, state, False, [(x, y)])
        assert same(before, r.params.values())


def test_a_negative_tensor_count_is_refused_as_non_finite_not_an_uphill_step():
    x, y = torch.ones(3), torch.zeros(3)
    r = lt.Runner.from_module(Counted(), lambda out, t: lt.LossSum(((out - t) ** 2).sum(), torch.tensor(-3)))
    opt = optim.sgd(0.1)
    state = opt.init(r.params)
    before = r.params.values()
    with pytest.raises(lt.NonFiniteError):
        lt.step_batch(r, opt, state, False, [(x, y)])
    assert same(before, r.params.values())


def test_a_count_on_the_meta_device_is_refused():
    x, y = torch.ones(3), torch.zeros(3)
    r = lt.Runner.from_module(Counted(), lambda o, t: lt.LossSum(((o - t) ** 2).sum(), torch.tensor(2, device="meta")))
    with pytest.raises(lt.DataError, match="LossSum.count is on meta"):
        lt.step_batch(r, optim.sgd(0.1), optim.sgd(0.1).init(r.params), False, [(x, y)])


# ------------------------------------------------------------------- TOML
def test_a_toml_file_mixing_top_level_keys_and_a_train_table_is_refused(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text('preset = "digits-cnn"\nepochs = 9\n[train]\nlr = 0.01\n')
    assert main(["train", str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "both at the top level (epochs, preset) and in a [train] table" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ paths
@pytest.mark.parametrize("path", ["a\x00b.ckpt", "x" * 300 + ".ckpt", "d/" + "y" * 256 + "/c.ckpt"])
def test_paths_the_os_refuses_are_typed_errors_everywhere(tmp_path, path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = lt.Runner.from_module(tiny_classifier())
    before = r.params.values()
    calls = [lambda: lt.save_checkpoint(path, r), lambda: lt.read_checkpoint(path),
             lambda: lt.load_checkpoint(path, r), lambda: lt.weights.save_weights(path, r),
             lambda: lt.weights.load_weights(path, r), lambda: lt.weights.save_weights(path, r, pretrained=True),
             lambda: lt.train_samples(r, lt.TrainConfig(steps=1, checkpoint_path=path), class_batches(2, 0))]
    for call in calls:
        with pytest.raises(lt.LeantrainError, match="NUL byte|bytes long"):
            call()
    assert same(before, r.params.values()) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["train", "--epochs", "1", "--out", "z" * 300], ["inspect", "z" * 300],
                                  ["export", "z" * 300, "--weights", "-o", "w"], ["plot", "m", "-o", "p" * 300]])
def test_the_command_says_one_line_for_a_path_the_os_refuses(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bytes long" in err and "Traceback" not in err


# ---------------------------------------------------------- loader state
def test_a_loader_state_torchdata_rejects_is_refused_before_the_parameters_are_installed(tmp_path):
    from dataclasses import replace
    from filetools import edit_manifest

    cfg, data, Loader = _stateful_checkpoint(tmp_path)
    path = tmp_path / "c.ckpt"

    def break_state(m):
        m["loader"]["state"]["_sampler_iter_state"] = {"x": 1}  # torchdata raises KeyError when it applies it

    path.write_bytes(edit_manifest(path.read_bytes(), break_state))
    fresh = lt.Runner.from_module(tiny_classifier(5), "cross_entropy")
    before = params(fresh.module)
    loader = Loader(data, batch_size=5)
    mine = loader.state_dict()
    with pytest.raises(lt.CheckpointError, match="StatefulDataLoader.load_state_dict refused"):
        lt.train_loader(fresh, replace(cfg, resume_from=path), loader)
    assert same(before, params(fresh.module))
    assert loader.state_dict() == mine


# ------------------------------------------------------------ the command
def test_export_consolidate_into_the_folder_it_reads_is_refused(tmp_path, capsys):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "parallel"))
    from test_sharded_files import _run

    folder, _ = _run(tmp_path)
    index = (folder / "index.json").read_bytes()
    assert main(["export", str(folder), "--consolidate", "-o", str(folder / "index.json")]) == 2
    assert "would write over the checkpoint being exported" in capsys.readouterr().err
    assert (folder / "index.json").read_bytes() == index


def test_a_run_that_logged_nothing_to_plot_still_exits_0(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", "--epochs", "1", "--max-steps", "3", "--log-every", "0", "--out", str(out)]) == 0
    assert "no plot:" in capsys.readouterr().out and (out / "report.json").is_file()


def _stateful_checkpoint(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))

    class Stop(lt.Callback):
        def on_step(self, event):
            return event.step == 3

    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=optim.adam(0.01), log_every=0, checkpoint_path=tmp_path / "c.ckpt")
    lt.train_loader(lt.Runner.from_module(tiny_classifier(), "cross_entropy"), cfg,
                    StatefulDataLoader(data, batch_size=5), callbacks=[Stop()])
    return cfg, data, StatefulDataLoader


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["loader"].update(state={}), "stateful loader state is empty"),
    (lambda m: m["progress"].update(batch=99), "progress.batch: 99 batches done in epoch 0, but one pass of this "
                                               "loader has 8"),
])
def test_a_loader_position_that_cannot_be_in_the_loader_is_refused_not_restarted_silently(tmp_path, edit, needle):
    from dataclasses import replace
    from filetools import edit_manifest

    cfg, data, Loader = _stateful_checkpoint(tmp_path)
    path = tmp_path / "c.ckpt"
    path.write_bytes(edit_manifest(path.read_bytes(), edit))
    fresh = lt.Runner.from_module(tiny_classifier(5), "cross_entropy")
    before = params(fresh.module)
    with pytest.raises(lt.CheckpointError, match=needle):
        lt.train_loader(fresh, replace(cfg, resume_from=path), Loader(data, batch_size=5))
    assert same(before, params(fresh.module))
