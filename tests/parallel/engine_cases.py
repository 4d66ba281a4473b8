"""The ranks of the engine table (``test_engines.py``): every rank of a world runs every
case with ``engine="ddp"`` (torch's DistributedDataParallel reduces the gradients) and
the cases of ``FSDP2_CASES`` with ``engine="fsdp2"`` (torch's fully_shard runs the items,
leantrain's optimizer steps the shards), and writes what it ended with (its parameters
and buffers, its report) to ``{out}/{world}/{engine}-{case}.{rank}.pt``; the test compares
them with the one-process runs. The worlds run in order (2, then 3).

The cases: the tied GPT (a mask buffer, dropout), the BatchNorm CNN, a reentrant
activation checkpoint, a frozen backbone, a token-weighted ``LossSum``, updates with fewer
items than ranks, the same run twice (its bits repeat at a fixed world size), evaluation
every N updates, ten loops in a row in one process (a rank was killed by the group's
teardown), and a resume: a checkpoint written by ``engine="ddp"`` continued by a
one-process run (the test) and by ``engine="ddp"`` on 3 ranks; an ``engine="fsdp2"``
checkpoint folder continued by ``sharding="parameters"`` on 3 ranks and that one's by one
process (the test), and the DDP file continued by ``engine="fsdp2"`` on 3 ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).parent.parent / "zoo"))

import leantrain as lt
import spawning  # noqa: E402
from zoo_models import BY_NAME  # noqa: E402

STEPS = 4


class Checkpointed(nn.Module):
    """A reentrant activation checkpoint (``use_reentrant=True``): its backward runs a backward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def block(self, h):
        return torch.tanh(self.b(torch.tanh(self.a(h))))

    def forward(self, x):
        return self.c(checkpoint(self.block, self.pre(x), use_reentrant=True))


class Tokens(nn.Module):
    """A model whose loss is a ``LossSum`` over the rows of an item (items of 1 to 4 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Unused(nn.Module):
    """A trainable layer the forward never uses (DDP must be told: find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(2, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def regression(n: int) -> list:
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(4, generator=g), torch.randn(1, generator=g)) for _ in range(n)]


def with_a_nan(samples: list, at: int) -> list:
    """``samples`` with item ``at``'s input NaN: under ``nonfinite="skip"`` its update is
    skipped on every rank (the flag agreed), the values and state kept."""
    out = list(samples)
    x, y = out[at]
    out[at] = (torch.full_like(x, float("nan")), y)
    return out


def unfreeze_at_2(model):
    """A callback that turns the frozen first layer on after update 2 (gradual unfreezing)."""
    def on_step(event):
        if event.step == 2:
            model[0].weight.requires_grad_(True)
    return on_step


def batchnorm_eval_at_2(model):
    """A callback that puts the model's BatchNorm modules in eval mode after update 2."""
    def on_step(event):
        if event.step == 2:
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
    return on_step


def frozen(model):
    """Every parameter frozen: nothing to reduce; the losses still are."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def token_loss(out, y):
    return lt.LossSum(((out - y) ** 2).sum(), y.shape[0])


def token_samples(n: int) -> list:
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(n):
        rows = 1 + k % 4
        out.append((torch.randn(rows, 3, generator=g), torch.randn(rows, 1, generator=g)))
    return out


def checkpointed_samples(n: int) -> list:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(2, 6, generator=g), torch.randn(2, 1, generator=g)) for _ in range(n)]


def zoo(name):
    e = BY_NAME[name]
    return lambda: e.model(0), e.samples(4 * STEPS, rows=2), e.loss


# name -> (a fresh model, the samples, the loss, items per update)
CASES = {
    "gpt": (*zoo("gpt"), 3),
    "cnn_batchnorm": (*zoo("cnn_batchnorm"), 3),
    "frozen_backbone": (*zoo("frozen_backbone"), 4),
    "reentrant_checkpoint": (lambda: (torch.manual_seed(0), Checkpointed())[1], checkpointed_samples(4 * STEPS),
                             "mse", 3),
    "loss_sum": (lambda: (torch.manual_seed(0), Tokens())[1], token_samples(4 * STEPS), token_loss, 4),
    "fewer_items_than_ranks": (*zoo("cnn_batchnorm"), 2),
    "unused_found": (lambda: (torch.manual_seed(0), Unused())[1], regression(4 * STEPS), "mse", 4),
    "unfreeze_clip_ema": (mlp, regression(4 * STEPS), "mse", 4),
    "bucket_options": (mlp, regression(4 * STEPS), "mse", 4),
    # the rest of the zoo: a persistent mask buffer, a submodule called twice, an LSTM (its own weight list),
    # a padded embedding, weight norm's parametrization, a constant buffer
    **{name: (*zoo(name), 3) for name in ("gpt_persistent_mask", "shared_twice", "lstm", "padded_embedding",
                                          "weight_norm", "constant_buffer")},
    "all_frozen": (lambda: frozen(mlp()), regression(4 * STEPS), "mse", 3),
    # leantrain's autocast (bfloat16; float16 with its loss scaling) and a NaN item's update skipped
    "autocast_bf16": (*zoo("gpt"), 3),
    "autocast_fp16": (mlp, regression(4 * STEPS), "mse", 4),
    "nonfinite_skip": (mlp, with_a_nan(regression(4 * STEPS), 5), "mse", 4),
}
# what a case adds to the config (every world, one process too) and the DDP options it needs
MORE = {"unused_found": {"engine": "ddp_unused"}, "unfreeze_clip_ema": {"clip_grad_norm": 0.5, "ema_decay": 0.9},
        "bucket_options": {"engine": "ddp_buckets"}, "autocast_bf16": {"autocast": "bfloat16"},
        "autocast_fp16": {"autocast": "float16"}, "nonfinite_skip": {"nonfinite": "skip"}}


# engine="fsdp2": what it runs of the table (gradual unfreezing is refused under any sharding: its own
# case, "unfreeze_refused"), and its own cases: clipping and EMA without the unfreezing, FSDP2's options
FSDP2_CASES = ("gpt", "cnn_batchnorm", "frozen_backbone", "reentrant_checkpoint", "loss_sum", "fewer_items_than_ranks",
               "unused_found", "gpt_persistent_mask", "shared_twice", "lstm", "padded_embedding", "weight_norm",
               "constant_buffer", "all_frozen", "clip_ema", "no_reshard", "bfloat16", "batchnorm_eval_at_2",
               "linear_units", "autocast_bf16", "autocast_fp16", "nonfinite_skip")
CASES["clip_ema"] = (mlp, regression(4 * STEPS), "mse", 4)
# the user's callback freezes BatchNorm's statistics after update 2 (eval mode on its modules): the
# working copy follows the module's modes
CASES["batchnorm_eval_at_2"] = CASES["cnn_batchnorm"]
CASES["linear_units"] = CASES["clip_ema"]  # shard_units=(nn.Linear,): each Linear a fully_shard unit of its own
CASES["no_reshard"] = CASES["bfloat16"] = CASES["gpt"]
MORE.update({"clip_ema": {"clip_grad_norm": 0.5, "ema_decay": 0.9}, "no_reshard": {"engine": "fsdp2_kept"},
             "bfloat16": {"engine": "fsdp2_bf16"}, "linear_units": {"shard_units": (nn.Linear,)}})
# not run with DDP (its own cases cover them)
FSDP2_ONLY = ("clip_ema", "no_reshard", "bfloat16", "batchnorm_eval_at_2", "linear_units")


# plain SGD where a wrong scale of the mean would show (Adam's update hardly sees one)
SGD = {"reentrant_checkpoint", "loss_sum", "fewer_items_than_ranks", "bucket_options"}


def config(name: str, batch: int, **more) -> lt.TrainConfig:
    opt = lt.optim.sgd(0.1) if name in SGD else lt.optim.adamw(0.01)
    return lt.TrainConfig(**{"steps": STEPS, "batch_size": batch, "optimizer": opt, "seed": 3, **more})


ENGINES = {"ddp_unused": lt.DDP(find_unused_parameters=True),
           "ddp_buckets": lt.DDP(gradient_as_bucket_view=True, bucket_cap_mb=0.0001),  # one tiny bucket per parameter
           "fsdp2_kept": lt.FSDP2(reshard_after_forward=False),
           "fsdp2_bf16": lt.FSDP2(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def run(name: str, world: int, engine: str = "ddp", **more):
    """One case trained (``engine`` where the world has ranks): (model, report)."""
    build, samples, loss, batch = CASES[name]
    model = build()
    callback = None
    if name == "unfreeze_clip_ema":
        model[0].weight.requires_grad_(False)
        callback = unfreeze_at_2(model)
    if name == "batchnorm_eval_at_2":
        callback = batchnorm_eval_at_2(model)
    runner = lt.Runner.from_module(model, loss)
    extra = {"engine": engine, **MORE.get(name, {})}
    extra.update(more)
    if engine == "fsdp2" and extra["engine"] in ("ddp_unused", "ddp_buckets"):
        extra["engine"] = "fsdp2"  # FSDP2 needs no option for an unused parameter
    extra["engine"] = ENGINES.get(extra["engine"], extra["engine"])
    if world == 1:  # the one-process reference: leantrain's defaults
        extra.pop("engine")
        extra.pop("shard_units", None)
    owned = [id(t) for t in (*model.parameters(), *model.buffers())]
    report = lt.train_samples(runner, config(name, batch, **extra), samples, log=None, callback=callback)
    assert [id(t) for t in (*model.parameters(), *model.buffers())] == owned  # the user's own objects, kept
    return model, report


def row_hint() -> list:
    """Single rows without a collate (the loader's hint at the point of use): what this rank said."""
    import warnings

    cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.sgd(0.01), log_every=0, measure_loss=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        lt.train_loader(lt.Runner.from_module(mlp(), "mse"), cfg, lt.DataLoader(regression(8), batch_size=4),
                        log=None)
    return [str(w.message) for w in said]


def unused_refused() -> str:
    """A parameter the forward never uses, DDP not told: the job's ConfigError naming the option."""
    torch.manual_seed(0)
    runner = lt.Runner.from_module(Unused(), "mse")
    try:
        lt.train_samples(runner, config("x", 4, engine="ddp"), regression(16), log=None)
    except lt.ConfigError as e:
        return str(e)
    return "trained"


def ended(model, report) -> dict:
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "steps": report.steps,
            "losses": report.losses, "evals": report.evals, "tied": getattr(model, "lm_head", None) is None
            or model.lm_head.weight is model.tok_emb.weight,
            "grads": [p.grad for p in model.parameters()]}


class Scalar(nn.Module):
    """A 0-dim parameter (torch's fully_shard shards none)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gain = nn.Linear(4, 1), nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.lin(x) * self.gain


def fsdp2_refusals() -> dict:
    """What fully_shard cannot take, refused before anything changes: message -> bytes kept."""
    out = {}
    for build, engine in ((Scalar, "fsdp2"), (mlp, lt.FSDP2(cpu_offload=True))):
        torch.manual_seed(0)
        model = build()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            lt.train_samples(lt.Runner.from_module(model, "mse"), config("x", 4, engine=engine), regression(8),
                             log=None)
            message = "trained"
        except lt.ConfigError as e:
            message = str(e)
        out[message] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return out


def unfreeze_refused() -> str:
    """Gradual unfreezing under engine="fsdp2": refused before the update that would follow it."""
    try:
        run("unfreeze_clip_ema", 2, engine="fsdp2")
    except lt.ConfigError as e:
        return str(e)
    return "trained"


def every_case(out: Path, world: int, rank: int) -> None:
    where = out / str(world)
    _, samples, _, _ = CASES["cnn_batchnorm"]
    for engine in ("ddp", "fsdp2"):
        for name in FSDP2_CASES if engine == "fsdp2" else [c for c in CASES if c not in FSDP2_ONLY]:
            torch.save(ended(*run(name, world, engine)), where / f"{engine}-{name}.{rank}.pt")
        torch.save(ended(*run("gpt", world, engine)), where / f"{engine}-repeat.{rank}.pt")  # the same run again
        torch.save(ended(*run("cnn_batchnorm", world, engine, eval_data=samples[:5], eval_every=2)),
                   where / f"{engine}-eval.{rank}.pt")
        # stopped inside epoch 2 (update 5 of 8) and resumed at this world size: the loader's place, the
        # generators (dropout) and the optimizer's state from the checkpoint, as the straight run
        for kind in (engine, "ddp_unused") if engine == "ddp" and world == 3 else (engine,):
            torch.save(loader_resumed(kind, where), where / f"{kind}-loader.{rank}.pt")
    torch.save({"message": unused_refused()}, where / f"unused_refused.{rank}.pt")
    torch.save({"message": unfreeze_refused()}, where / f"unfreeze_refused.{rank}.pt")
    torch.save(fsdp2_refusals(), where / f"fsdp2_refusals.{rank}.pt")
    torch.save({"said": row_hint()}, where / f"row_hint.{rank}.pt")
    # loops in a row in one process (every engine): each loop's group torn down only when every rank is done
    loops_in_a_row(where, rank)
    # a resume: world 2 writes a checkpoint after 2 updates; world 3 continues it (the test: one process too)
    # fsdp2 -> "parameters" -> one process: world 2 writes a folder after 2 updates, world 3 continues it with
    # leantrain's parameter sharding to 3 (the test: one process to 4); world 3 continues DDP's file with fsdp2
    if world == 2:
        run("gpt", world, checkpoint_path=str(out / "after2.ckpt"), steps=2)
        run("gpt", world, "fsdp2", checkpoint_path=str(out / "after2_fsdp2"), steps=2)
    if world == 3:
        torch.save(ended(*run("gpt", world, resume_from=str(out / "after2.ckpt"))), where / f"resumed.{rank}.pt")
        run("gpt", world, "leantrain", sharding="parameters", resume_from=str(out / "after2_fsdp2"),
            checkpoint_path=str(out / "after3_parameters"), steps=3)
        torch.save(ended(*run("gpt", world, "fsdp2", resume_from=str(out / "after2.ckpt"))),
                   where / f"fsdp2-resumed.{rank}.pt")
        torch.save(ended(*run("gpt", world, "fsdp2", resume_from=str(out / "after2_fsdp2"))),  # each rank its ranges
                   where / f"fsdp2-resumed_folder.{rank}.pt")


def loader_run(engine: str, folder: Path, **more):
    """The tied GPT (dropout) over a shuffling loader of 3-item list batches, 2 epochs of 4
    updates, under ``engine``: (model, report)."""
    build, samples, loss, _ = CASES["gpt"]
    model = build()
    loader = lt.DataLoader(samples[:12], 3, shuffle=True, seed=3, collate=lt.collate.items)
    cfg = lt.LoaderTrainConfig(epochs=2, optimizer=lt.optim.adamw(0.01), seed=3, engine=engine, log_every=1,
                               checkpoint_path=str(folder / "loader.ckpt"), checkpoint_every=1, **more)
    report, _ = lt.train_loader(lt.Runner.from_module(model, loss), cfg, loader, log=None)
    return model, report


def loader_resumed(kind: str, where: Path) -> dict:
    """``loader_run`` straight, then stopped after update 5 of 8 and resumed (``kind``: an
    engine, or ``"ddp_unused"``: ``lt.DDP(find_unused_parameters=True)``): both ends, and
    what the resumed run warned."""
    import warnings

    engine = ENGINES.get(kind, kind)
    folder = where / kind
    folder.mkdir(exist_ok=True)
    straight = ended(*loader_run(engine, folder))
    loader_run(engine, folder, max_steps=5)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resumed = ended(*loader_run(engine, folder, resume_from=str(folder / "loader.ckpt")))
    return {"straight": straight, "resumed": resumed, "said": [str(w.message) for w in said]}


def loops_in_a_row(where: Path, rank: int) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 256, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(8)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    runner = lt.Runner.from_module(model, "cross_entropy")
    for engine in ("leantrain", "ddp", "fsdp2") * 3 + ("leantrain",):
        lt.train_samples(runner, lt.TrainConfig(steps=2, batch_size=4, optimizer=lt.optim.sgd(0.01), log_every=0,
                                                measure_loss=False, engine=engine), data, log=None)
    torch.save({"loops": 10}, where / f"loops.{rank}.pt")


def worker(rank: int, world: int, init_file: str, out: str) -> None:
    spawning.rank_of_a_table(rank, world, init_file, out, every_case)


def cuda_worker(rank: int, world: int, init_file: str, out: str, engine: str = "ddp") -> None:
    """``engine`` ("ddp" or "fsdp2") over NCCL, one CUDA device per rank (``test_engines.py``, ``-m cuda``)."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(ended(*cuda_run("gpt", torch.device("cuda", rank), engine=engine)), Path(out) / f"cuda.{rank}.pt")
    finally:
        dist.destroy_process_group()


def cuda_run(name: str, device: torch.device, **more):
    build, samples, loss, batch = CASES[name]
    model = build().to(device)
    runner = lt.Runner.from_module(model, loss)
    report = lt.train_samples(runner, config(name, batch, **more), samples, log=None)
    return model, report
