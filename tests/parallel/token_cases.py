"""Token-weighted (``LossSum``) training under data parallel: runs shared by
``test_dist_tokens.py`` and its spawned workers. A tiny tied language model takes dict
samples (``model(**sample)``) and returns its own loss as a ``LossSum`` over the tokens
whose label is not -100, so items of different lengths weigh by their tokens."""

import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import leantrain as lt
from leantrain import optim

VOCAB = 13


class TinyLM(nn.Module):
    """Embedding, one mixing layer, a head tied to the embedding, a causal-mask buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.tril(torch.ones(16, 16)))

    def forward(self, input_ids, attention_mask, labels):
        h = self.emb(input_ids)
        t = input_ids.shape[1]
        weights = self.mask[:t, :t] * attention_mask[:, None, :].to(h.dtype)
        h = torch.tanh(self.mix(weights @ h / weights.sum(-1, keepdim=True).clamp(min=1)))
        logits = self.head(h)
        targets = labels[:, 1:]
        total = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100,
                                reduction="sum")
        return {"logits": logits, "loss": lt.LossSum(total, (targets != -100).sum())}


def sequences(n, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (n,), generator=g)
    return [torch.randint(0, VOCAB, (int(k),), generator=g) for k in lengths]


def dict_items(n):
    """``n`` dict items of 2 padded sequences each (token counts differ item to item)."""
    seqs = sequences(2 * n, 3)
    return [lt.collate.pad_tokens(seqs[2 * i: 2 * i + 2]) for i in range(n)]


# (loop, batch size or pieces, reduction): samples-5 gives 3 ranks 2/2/1 items; samples-2
# leaves rank 2 of 3 without items; loader-4 cuts each collated batch of 6 into 4 pieces.
# loader-0 does not cut: one collated item per update, so rank 0 computes alone (and warns).
CASES = [f"{loop}-{k}-{red}" for loop, k in (("samples", 5), ("samples", 2), ("loader", 4))
         for red in ("exact", "default")] + ["loader-0-default"]


def make(case):
    loop, k, red = case.split("-")
    k = int(k)
    torch.manual_seed(0)
    runner = lt.Runner.from_module(TinyLM(), "model")
    common = dict(optimizer=optim.adamw(0.05, weight_decay=0.01), log_every=2, exact_reduction=red == "exact",
                  measure_loss=True)
    if loop == "samples":
        cfg = lt.TrainConfig(steps=4, batch_size=k, **common)
        items = dict_items(7)
        return cfg, lambda c: lt.train_samples(runner, c, items, log=None), runner
    data = sequences(18, 4)
    loader = torch.utils.data.DataLoader(data, batch_size=6, shuffle=True, collate_fn=lt.collate.pad_tokens,
                                         generator=torch.Generator().manual_seed(1))
    cfg = lt.LoaderTrainConfig(epochs=2, pieces=None if k == 0 else k, **common)
    return cfg, lambda c: lt.train_loader(runner, c, loader, log=None)[0], runner


def run(case, out: Path, tag: str, **changes):
    cfg, go, runner = make(case)
    report = go(replace(cfg, **changes))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    values = {f"w.{k}": v.detach().clone() for k, v in runner.module.state_dict().items()}
    values["losses"] = torch.tensor([loss for _, loss in report.losses], dtype=torch.float64)
    values["before_after"] = torch.tensor([report.before, report.after], dtype=torch.float64)
    values["buffer_passes"] = torch.tensor([runner.stats.buffer_passes, report.steps])
    save_file(values, str(out / f"{case}.{tag}.safetensors"))


def worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for case in CASES:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                run(case, Path(out), f"w{world}")
            if rank == 0:
                said = [str(w.message) for w in seen if "some ranks compute nothing" in str(w.message)]
                (Path(out) / f"{case}.w{world}.warned").write_text("\n".join(said))
            dist.barrier()
    finally:
        dist.destroy_process_group()
