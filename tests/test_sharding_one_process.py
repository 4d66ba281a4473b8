"""``sharding="parameters"`` in one process (#55 item 6): a model with buffers and one item
per update trains (its backward once read released storage) with the unsharded run's
bits, from the library and from the command (``--preset digits-cnn``); a parameter read
outside its module's forward is a ``ConfigError`` naming the slot, whether or not the run
measures its loss first; the collective error type is public."""

import copy

import pytest
import torch

import leantrain as lt
from leantrain import optim
from leantrain.cli.main import main


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


def test_the_collective_error_types_are_public():
    from leantrain.training.parallel import distributed

    assert lt.CollectiveError is distributed.CollectiveError and issubclass(lt.CollectiveError, RuntimeError)
    assert lt.ReplicaError is distributed.ReplicaError and issubclass(lt.ReplicaError, lt.LeantrainError)
