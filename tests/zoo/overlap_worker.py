"""Spawned by test_zoo_overlap.py: leantrain's overlapped data-parallel gradients against
the plain schedule (each rank folds its items left to right, one all-reduce of the sum,
times 1/n), on model-zoo models, with DDP-sized and with tiny buckets."""

from pathlib import Path

import torch
import torch.distributed as dist

import leantrain as lt
from leantrain.training.parallel import distributed, overlap
from zoo_models import BY_NAME

MODELS = ["gpt", "gpt_persistent_mask", "cnn_batchnorm", "lstm", "shared_twice", "frozen_backbone", "weight_norm"]
SIZES = [1, 2, 3, 5]  # items per batch: on 2 ranks, 1 leaves rank 1 without items


def plain_reference(runner, batch, rank, world, monkeypatch_active):
    """Per-item gradients computed one process-locally, folded, all-reduced as one flat."""
    mine = batch[rank::world]
    with monkeypatch_active():
        packs = [lt.mean_gradients(runner, [item]) for item in mine]
    leaves = [g is not None for g in packs[0]] if packs else None
    if not packs:  # no items: zeros (the trained slots are the ones with gradients elsewhere)
        with monkeypatch_active():
            shape_pack = lt.mean_gradients(runner, [batch[0]])
        total = [None if g is None else torch.zeros_like(g) for g in shape_pack]
    elif len(packs) == 1:
        total = packs[0]
    else:
        total = [None if g is None else g + h for g, h in zip(packs[0], packs[1])]
        for pack in packs[2:]:
            for g, h in zip(total, pack):
                if g is not None:
                    g.add_(h)
    del leaves
    present = [g for g in total if g is not None]
    flat = torch.cat([g.reshape(-1) for g in present])
    dist.all_reduce(flat)
    out, offset = [], 0
    for g in total:
        if g is None:
            out.append(None)
            continue
        out.append(flat[offset: offset + g.numel()].view(g.shape).mul_(1.0 / len(batch)))
        offset += g.numel()
    return out


def worker(rank, world, init_file, out, tiny):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if tiny:  # many buckets: completion out of order, launches held back for order
        overlap.FIRST_BUCKET_BYTES, overlap.BUCKET_BYTES = 64, 512
    real_active = distributed.active

    class local:
        def __enter__(self):
            distributed.active = lambda: None

        def __exit__(self, *exc):
            distributed.active = real_active

    early = []  # per reduction: how many buckets were on the wire before the backward ended
    real_finish = overlap.Reducer.finish

    def finish(self, grads, loss):
        early.append(len(self.works))
        return real_finish(self, grads, loss)

    overlap.Reducer.finish = finish
    lines = []
    try:
        for name in MODELS:
            entry = BY_NAME[name]
            for n in SIZES:
                runner = lt.Runner.from_module(entry.model(), entry.loss).eval()  # eval: no dropout draws
                batch = entry.samples(n, seed=n)
                got_loss, got = lt.mean_loss_and_gradients(runner, batch)
                want = plain_reference(runner, batch, rank, world, local)
                for i, (a, b) in enumerate(zip(got, want)):
                    assert (a is None) == (b is None), (name, n, i)
                    if a is None:
                        continue
                    same = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                    close = torch.allclose(a, b, rtol=1e-6, atol=1e-7)
                    lines.append(f"{name} n={n} slot={i} same={same} close={close}")
                if name in ("shared_twice", "weight_norm") and n > 1:  # vectorised: one stacked backward, hooked
                    vec = lt.mean_gradients(runner, batch, accumulation="vectorized")
                    close = all(a is None or torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(vec, got))
                    lines.append(f"{name} n={n} vectorized close={close}")
                # every rank holds the same bits
                flat = torch.cat([g.reshape(-1) for g in got if g is not None])
                gathered = [torch.empty_like(flat) for _ in range(world)]
                dist.all_gather(gathered, flat)
                lines.append(f"{name} n={n} ranks_agree={all(torch.equal(gathered[0], x) for x in gathered)}")
                assert isinstance(got_loss, float)
        for name in ["gpt", "cnn_batchnorm"]:  # a loop (buckets and partial sums reused) == single steps
            entry = BY_NAME[name]
            samples = entry.samples(5, seed=9)
            looped = lt.Runner.from_module(entry.model(), entry.loss)
            torch.manual_seed(11)  # train mode (the loops set it): the same dropout draws on both sides
            cfg = lt.TrainConfig(steps=3, batch_size=5, optimizer=lt.optim.adam(1e-2), log_every=0, measure_loss=False)
            lt.train_samples(looped, cfg, samples, log=lambda s: None)
            stepped = lt.Runner.from_module(entry.model(), entry.loss)
            torch.manual_seed(11)
            opt = lt.optim.adam(1e-2)
            state = opt.init(stepped.params)
            for _ in range(3):
                state = lt.step_batch(stepped, opt, state, False, samples)
            same = all(torch.equal(a, b) for a, b in zip(looped.params.values(), stepped.params.values()))
            lines.append(f"{name} loop same={same}")
        lines.append(f"early={max(early)}")
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}-{'tiny' if tiny else 'ddp'}.txt").write_text("\n".join(lines))
