"""``engine=`` (#69) in one process: the settings, the refusals that name the fix, a module
already wrapped by a distributed engine refused before anything runs (DDP, ``fully_shard``,
DTensor parameters, DeepSpeed), the one-process run of a torch engine, ``export --dcp``.
The multi-process runs are ``tests/parallel/test_engines.py``."""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import leantrain as lt
from leantrain.cli.main import main


def config(**more):
    return lt.TrainConfig(**{"steps": 3, "batch_size": 2, "optimizer": lt.optim.sgd(0.1, momentum=0.9), **more})


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def samples(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, generator=g), torch.randn(2, generator=g)) for _ in range(n)]


@contextlib.contextmanager
def one_rank_group(tmp_path):
    """A process group of one rank (what torch's wrappers need to be built)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------- settings
def test_the_engine_is_a_setting_of_the_parallel_record():
    assert config().engine == "leantrain" and config().parallel.engine == "leantrain"
    assert config(engine="ddp").engine == lt.DDP()
    assert config(engine=lt.DDP(bucket_cap_mb=1.5, gradient_as_bucket_view=True)).parallel.engine.bucket_cap_mb == 1.5
    assert lt.ParallelOptions(engine="ddp").engine == lt.DDP()
    assert config(engine="fsdp2").engine == lt.FSDP2()
    assert config(engine=lt.FSDP2(param_dtype=torch.bfloat16)).parallel.engine.param_dtype is torch.bfloat16
    assert config(engine="fsdp2", shard_units=(nn.Linear,)).parallel.shard_units == (nn.Linear,)  # its units
    with pytest.raises(lt.ConfigError, match="shard_units is for sharding='parameters'"):
        config(engine="ddp", shard_units=(nn.Linear,))


@pytest.mark.parametrize("more, words", [
    ({"exact_reduction": True}, "exact_reduction=True is leantrain's own engine"),
    ({"sharding": "optimizer"}, "sharding='optimizer' is leantrain's own engine"),
    ({"sharding": "parameters"}, "use engine='leantrain'"),
    ({"accumulation": "vectorized"}, "accumulation='vectorized'"),
    ({"compile": True}, "compile=True"),
])
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_leantrain_only_settings_with_a_torch_engine_are_refused_naming_the_engine(more, words, engine):
    with pytest.raises(lt.ConfigError, match="engine") as e:
        config(engine=engine, **more)
    assert words in str(e.value)


@pytest.mark.parametrize("engine, words", [
    ("FSDP", "one of ('leantrain', 'ddp', 'fsdp2')"), ("DDP", "one of ('leantrain', 'ddp', 'fsdp2')"), (3, "one of"),
])
def test_an_unknown_engine_is_refused(engine, words):
    with pytest.raises(lt.ConfigError, match="engine") as e:
        config(engine=engine)
    assert words in str(e.value)


@pytest.mark.parametrize("options", [{"bucket_cap_mb": 0}, {"bucket_cap_mb": True}, {"gradient_as_bucket_view": "yes"},
                                     {"find_unused_parameters": 1}])
def test_ddp_options_are_checked(options):
    with pytest.raises(lt.ConfigError, match="DDP"):
        lt.DDP(**options)


@pytest.mark.parametrize("options", [{"param_dtype": torch.int64}, {"reduce_dtype": "bfloat16"},
                                     {"reshard_after_forward": 1}, {"cpu_offload": "no"}])
def test_fsdp2_options_are_checked(options):
    with pytest.raises(lt.ConfigError, match="FSDP2"):
        lt.FSDP2(**options)


def test_a_torch_engine_in_one_process_is_the_one_process_run():
    """No process group: nothing to reduce, the one-process bits."""
    runs = []
    for engine in ("leantrain", "ddp", "fsdp2"):
        model = net()
        lt.train_samples(lt.Runner.from_module(model, "mse"), config(engine=engine), samples(), log=None)
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][k], run[k]) for run in runs[1:] for k in runs[0])


def test_fsdp2_on_a_one_rank_group_is_the_one_process_run(tmp_path):
    """One rank (``torchrun --nproc-per-node 1``) has nothing to shard: the one-process
    run's bits (parameter sharding's one-rank plan) and a checkpoint folder as every fsdp2
    run writes, the module's own Parameters and ties, no .grad."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks = nn.Embedding(7, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            h = self.emb(x)
            for b in self.blocks:
                h = torch.tanh(b(h))
            return self.head(h)

    data = [(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4])), (torch.tensor([4, 5]), torch.tensor([5, 6]))] * 3
    ends = []
    for engine in ("leantrain", "fsdp2"):
        torch.manual_seed(0)
        model = Tied()
        objects = [id(p) for p in model.parameters()]
        more = {"checkpoint_path": str(tmp_path / "run"), "checkpoint_every": 3} if engine == "fsdp2" else {}
        (tmp_path / engine).mkdir()
        with one_rank_group(tmp_path / engine) if engine == "fsdp2" else contextlib.nullcontext():
            report = lt.train_samples(lt.Runner.from_module(model, "cross_entropy"),
                                      config(engine=engine, optimizer=lt.optim.adamw(0.01), **more), data, log=None)
        assert model.head.weight is model.emb.weight and [id(p) for p in model.parameters()] == objects
        assert all(p.grad is None for p in model.parameters())
        assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())
        ends.append((model.state_dict(), report))
    assert all(torch.equal(ends[1][0][k], v) for k, v in ends[0][0].items())
    assert (tmp_path / "run").is_dir()
    resumed = Tied()
    lt.train_samples(lt.Runner.from_module(resumed, "cross_entropy"),
                     config(optimizer=lt.optim.adamw(0.01), steps=4, resume_from=str(tmp_path / "run")), data,
                     log=None)
    assert resumed.head.weight is resumed.emb.weight


# ----------------------------------------------------------------- wrapped modules
def refused(module, *words):
    before = copy.deepcopy(module.state_dict())
    with pytest.raises(lt.ConfigError) as e:
        lt.Runner.from_module(module, "mse")
    for w in words:
        assert w in str(e.value), str(e.value)
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing read, nothing changed
    return str(e.value)


def test_a_ddp_wrapped_module_is_refused_naming_the_plain_module(tmp_path):
    with one_rank_group(tmp_path):
        wrapped = nn.parallel.DistributedDataParallel(net())
        message = refused(wrapped, "Runner", "DistributedDataParallel", "plain module", "engine='ddp'")
        assert "overlap" not in message
        refused(nn.DataParallel(net()), "DataParallel")


def test_a_fully_shard_module_and_dtensor_parameters_are_refused(tmp_path):
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard

    with one_rank_group(tmp_path):
        model = net()
        fully_shard(model[0])
        fully_shard(model)
        refused(model, "fully_shard", "plain module")
        mesh = init_device_mesh("cpu", (1,))
        plain = net()
        plain[2].weight = nn.Parameter(distribute_tensor(plain[2].weight.detach(), mesh, [Shard(0)]))
        refused(plain, "DTensor", "'2.weight'", "parallelize_module")


def test_deepspeed_engines_and_zero3_modules_are_refused_by_name():
    class DeepSpeedEngine(nn.Module):  # DeepSpeed's class, by its name (leantrain never imports deepspeed)
        def __init__(self):
            super().__init__()
            self.module = net()

    refused(DeepSpeedEngine(), "DeepSpeedEngine", "not an engine")
    zero3 = net()
    p = nn.Parameter(torch.empty(0))
    p.ds_id, p.ds_numel = 0, 32  # what deepspeed.zero.Init leaves on a partitioned parameter
    zero3[0].weight = p
    refused(zero3, "ZeRO-3", "'0.weight'", "shape (0,)", "32 elements")


# ----------------------------------------------------------------- export --dcp
def test_export_dcp_writes_the_plain_modules_state_dict(tmp_path, capsys):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.norm, self.head = nn.Embedding(7, 4), nn.BatchNorm1d(4), nn.Linear(4, 7, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.norm(self.emb(x)))

    torch.manual_seed(0)
    model = Tied()
    data = [(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]))] * 4
    lt.train_samples(lt.Runner.from_module(model, "cross_entropy"),
                     config(checkpoint_path=str(tmp_path / "run.ckpt")), data, log=None)
    out = tmp_path / "dcp"
    assert main(["export", str(tmp_path / "run.ckpt"), "--dcp", "-o", str(out)]) == 0
    assert "torch.distributed.checkpoint" in capsys.readouterr().out
    torch.manual_seed(5)
    fresh = Tied()
    state = fresh.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "no process group: one process" note
        dcp.load(state, checkpoint_id=str(out))
    want = model.state_dict()
    assert list(state) == list(want) and "head.weight" in state  # the module's names, the tie's too
    assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)
    assert fresh.head.weight is fresh.emb.weight
    # an existing folder with files is never written into; a file is not replaced
    assert main(["export", str(tmp_path / "run.ckpt"), "--dcp", "-o", str(out)]) == 2
    assert "already exists and holds files" in capsys.readouterr().err
    before = sorted(p.name for p in out.iterdir())
    assert main(["export", str(tmp_path / "run.ckpt"), "--dcp", "--weights", "-o", str(tmp_path / "x")]) == 2
    assert sorted(p.name for p in out.iterdir()) == before and not (tmp_path / "x").exists()
