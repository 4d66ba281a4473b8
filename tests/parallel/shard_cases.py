"""Sharded training (ZeRO 1 and 2) runs shared by ``test_sharding_dist.py`` and its
spawned workers: every optimizer family x {exact, default} x {optimizer, gradients} on
a tied model with BatchNorm and a frozen bias whose slots are cut across the ranks
(sizes not multiples of 64), and on the tied token model of ``token_cases`` (a mask
buffer, dict samples, LossSum, clipping, a collated batch cut into pieces)."""

import json
from dataclasses import replace
from pathlib import Path

import sys

import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt
import token_cases as tc
from leantrain.training.parallel import overlap
from leantrain.training.parallel.sharding import comm as shard_comm, overlap as shard_overlap
from optimizer_table import SHARDABLE, TABLE

sys.path.insert(0, str(Path(__file__).parent.parent / "zoo"))
import zoo_models  # noqa: E402  (the model zoo: a tied GPT with a mask buffer, BatchNorm CNN, LSTM, frozen backbone)

STOP = 3


class Wide(nn.Module):
    """Slots of 180, 1296 (tied twice) and 108 elements, BatchNorm, dropout, a frozen bias:
    every table over it (world sizes, resumes across them, kills) runs a model that draws
    random numbers, with the default settings."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 36, bias=False)
        self.norm = nn.BatchNorm1d(36)
        self.drop = nn.Dropout(0.1)
        self.b = nn.Linear(36, 36)
        self.c = nn.Linear(36, 36)
        self.c.weight = self.b.weight
        self.head = nn.Linear(36, 3)
        self.head.bias.requires_grad_(False)

    def forward(self, x):
        h = self.drop(torch.tanh(self.norm(self.a(x))))
        return self.head(torch.tanh(self.c(torch.tanh(self.b(h)))))


def wide_data():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(7)]


# model-optimizer-reduction-sharding
CASES = [f"wide-{o}-{red}-{sh}" for o in SHARDABLE for red in ("exact", "default") for sh in ("optimizer", "gradients")]
CASES += [f"lm-{o}-{red}-{sh}" for o in ("adamw", "momentum") for red in ("exact", "default")
          for sh in ("optimizer", "gradients")]
# with a moving average of the weights, evaluated with it every step (eval_ema)
CASES += [f"wide-adamw-{red}-{sh}-ema" for red in ("exact", "default") for sh in ("optimizer", "gradients")]
# whole slots per rank (shard_by="slot"): clipping under gradient sharding has clip_grad_norm_'s bits
CASES += ["lm-adamw-exact-gradients-slot", "lm-adamw-default-gradients-slot", "wide-adam-exact-gradients-slot"]
# the model zoo, against the unsharded run (bits) and plain PyTorch on a deep copy (rounding)
ZOO = ["gpt_persistent_mask", "cnn_batchnorm", "lstm", "frozen_backbone"]
CASES += [f"zoo.{name}-adamw-{red}-gradients" for name in ZOO for red in ("exact", "default")]
# all-gathers in runs of 128 elements (GATHER_BYTES made small): many per step, ranges of one run from
# several slots; the parameters, the moving average and (clipping under "optimizer") the whole gradient;
# with the default reduction also one bucket in flight at a time (IN_FLIGHT made small)
CASES += ["wide-adamw-exact-gradients-ema-chunks", "lm-adamw-exact-optimizer-chunks", "wide-adamw-default-gradients-chunks"]
# the reduce-scatter's ranges of 256 bytes or more sent alone (``DIRECT``; 64 KiB in a run, which
# these models' ranges never reach), the smaller ones of the same bucket concatenated
CASES += ["wide-adamw-default-gradients-direct"]
# vectorized accumulation: each rank's items in one stacked backward, the sums reduce-scattered
# after it (not under the backward)
CASES += [f"zoo.shared_twice-adamw-default-{sh}-vec" for sh in ("optimizer", "gradients")]
RESUME_CASES = ["wide-adam-exact-gradients", "wide-momentum-exact-optimizer", "lm-adamw-exact-gradients",
                "wide-adamw-exact-gradients-ema",
                # the tied GPT with dropout 0.1, the defaults: stopped on 2 ranks, resumed on 1 and 3
                "zoo.gpt_persistent_mask-adamw-exact-gradients"]


def make(case, sharding="auto"):
    model, o, red, sh, *extra = case.split("-")
    sharding = sh if sharding == "auto" else sharding
    # the default settings: dropout draws the plain loop's numbers on any world, as the one-process
    # runs and the plain PyTorch references do
    common = dict(optimizer=TABLE[o].make(), log_every=1, exact_reduction=red == "exact", sharding=sharding,
                  shard_by="slot" if "slot" in extra else "range")
    if sh == "parameters":  # no before/after passes: the loss is watched only inside the loop's updates
        common.update(measure_loss=False)
    if "ema" in extra:
        common.update(ema_decay=0.9, eval_data=wide_data()[:2], eval_ema=True)
    if "vec" in extra:
        common.update(accumulation="vectorized")
    if "eval" in extra:  # evaluated every other update (every rank evaluates, as data parallel does)
        common.update(eval_data=wide_data()[:2], eval_every=2)
    torch.manual_seed(1)
    if model.startswith("zoo."):
        entry = zoo_models.BY_NAME[model[4:]]
        module = entry.model(0)
        if "frozen" in extra:  # a frozen slot among the trained ones (the GPT's final norm's bias)
            module.ln_f.bias.requires_grad_(False)
        runner = lt.Runner.from_module(module, entry.loss)
        cfg = lt.TrainConfig(steps=5, batch_size=3, **common)
        return runner, cfg, lambda c, cb: lt.train_samples(runner, c, entry.samples(7), log=None, callback=cb)
    if model == "hf.gpt2":  # Hugging Face GPT-2 from its config: a tied head, dropout, dict samples
        import hf_models
        runner = lt.Runner.from_module(hf_models.gpt2(dropout=0.1), "model")
        cfg = lt.TrainConfig(steps=5, batch_size=3, **common)
        return runner, cfg, lambda c, cb: lt.train_samples(runner, c, hf_models.lm_samples(7), log=None, callback=cb)
    if model == "wide":
        runner = lt.Runner.from_module(Wide(), "mse")
        cfg = lt.TrainConfig(steps=6, batch_size=3, **common)
        return runner, cfg, lambda c, cb: lt.train_samples(runner, c, wide_data(), log=None, callback=cb)
    runner = lt.Runner.from_module(tc.TinyLM(), "model")
    loader = torch.utils.data.DataLoader(tc.sequences(18, 4), batch_size=6, shuffle=True,
                                         collate_fn=lt.collate.pad_tokens, generator=torch.Generator().manual_seed(1))
    cfg = lt.LoaderTrainConfig(epochs=2, pieces=4, clip_grad_norm=0.5, **common)
    return runner, cfg, lambda c, cb: lt.train_loader(runner, c, loader, log=None, callback=cb)[0]


def state_elements(state) -> int:
    return sum(t.numel() for r in state.records().values() for t in r.tensors().values())


def tie_kept(module) -> bool:
    """Whether a tied model's head is still its embedding's Parameter (True untied)."""
    if hasattr(module, "tok_emb"):
        return module.lm_head.weight is module.tok_emb.weight
    if hasattr(module, "transformer"):  # Hugging Face GPT-2
        return module.lm_head.weight is module.transformer.wte.weight
    return True


def run(case, out: Path, tag: str, sharding="auto", stop=False, resume=False):
    """Train; rank 0 writes the checkpoint (``<case>.<tag>``) and every rank its state size."""
    runner, cfg, go = make(case, sharding)
    path = out / f"{case}.{tag}"
    cfg = replace(cfg, checkpoint_path=path)
    if stop:
        cfg = replace(cfg, checkpoint_path=out / f"{case}.stopped")
    if resume:
        cfg = replace(cfg, resume_from=out / f"{case}.stopped")
    seen = {"loss_held": [], "callback_whole": True}
    module = runner.module
    uses: dict = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    seen["tied"] = [n for n, p in module.named_parameters() if uses[id(p)] > 1]  # used by several modules
    trained = [p for p in module.parameters() if p.requires_grad]
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    objects = [id(p) for p in module.parameters()]
    if cfg.sharding == "parameters":  # what the trained parameters hold while the loss is computed
        loss_fn = runner.loss_fn

        def watched(*args):
            held = [n for n, p in zip(names, trained) if p.untyped_storage().nbytes()]
            seen["loss_held"] = max(seen["loss_held"], held, key=len)
            return loss_fn(*args)

        runner.loss_fn = watched

    def callback(event):
        seen["elements"] = state_elements(event.state)
        seen["callback_whole"] &= all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in trained)
        return stop and event.step == STOP

    limits = (shard_comm.GATHER_BYTES, shard_overlap.IN_FLIGHT, overlap.FIRST_BUCKET_BYTES, overlap.BUCKET_BYTES,
              shard_overlap.DIRECT)
    if "chunks" in case.split("-"):  # buckets of a slot or two, each awaited before the next is sent
        shard_comm.GATHER_BYTES, shard_overlap.IN_FLIGHT, overlap.FIRST_BUCKET_BYTES, overlap.BUCKET_BYTES = 512, 1, 1, 1
    if "direct" in case.split("-"):  # the reduce-scatter sends ranges of 256 bytes or more alone, beside
        shard_overlap.DIRECT = 256  # the smaller ones concatenated (both kinds in one bucket)
    try:
        go(cfg, callback)
    finally:
        (shard_comm.GATHER_BYTES, shard_overlap.IN_FLIGHT, overlap.FIRST_BUCKET_BYTES, overlap.BUCKET_BYTES,
         shard_overlap.DIRECT) = limits
    rank = dist.get_rank() if dist.is_initialized() else 0
    (out / f"{case}.{tag}.elements{rank}").write_text(str(seen["elements"]))
    seen.update(objects_kept=objects == [id(p) for p in module.parameters()], tie_kept=tie_kept(module),
                whole_after=all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in trained),
                trained_bytes=sum(p.numel() * p.element_size() for p in trained))
    (out / f"{case}.{tag}.seen{rank}").write_text(json.dumps({k: v for k, v in seen.items() if k != "elements"}))


def contents(path):
    """A checkpoint's tensors, logged losses and manifest (a file or a sharded folder)."""
    manifest, tensors = lt.read_checkpoint(path)
    kept = {k: t for k, t in tensors.items() if k.startswith(("storage.", "state.", "ema."))}
    evals = [[step, results["loss"]] for step, results in manifest["progress"]["evals"]]  # eval_ema's losses
    return kept, manifest["progress"]["losses"] + evals, manifest


def worker(rank, world, init_file, out, plan):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for case, tag, stop, resume in plan:
            run(case, Path(out), tag, stop=stop, resume=resume)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a, b):
    """Two runs' checkpoints hold the same bits and logged the same losses."""
    ta, la, _ = contents(a)
    tb, lb, _ = contents(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert torch.equal(bits(ta[k]), bits(tb[k])), k
    assert la == lb and len(la) >= 4


def against_plain_pytorch(name: str, checkpoint) -> None:
    """A zoo run's checkpoint (AdamW of the table, 5 updates of 3 items) against plain
    PyTorch on a fresh copy: each item's loss backward into ``.grad`` (ties summed by
    autograd), the sum times 1/n, ``AdamW(fused=True)``; buffers advanced once per item.
    Agreement to rounding (leantrain's fold and torch's ``.grad`` accumulation differ)."""
    from leantrain.io.exporting import params_from_checkpoint

    entry = zoo_models.BY_NAME[name]
    model, data = entry.model(0), entry.samples(7)
    h = TABLE["adamw"].hyper
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, betas=(h["beta1"], h["beta2"]),
                            eps=h["eps"], weight_decay=h["weight_decay"], fused=True)
    loss_fn = entry.loss_fn()
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        for k in range(3):
            x, y = data[(step * 3 + k) % len(data)]
            loss_fn(model(x), y).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / 3)
        opt.step()
    ours = params_from_checkpoint(checkpoint)
    theirs = dict(model.state_dict())
    assert {s.name for s in ours} <= set(theirs) and len(ours) >= 4
    for slot in ours:
        torch.testing.assert_close(slot.storage.host, theirs[slot.name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} {slot.name}: {m}")
