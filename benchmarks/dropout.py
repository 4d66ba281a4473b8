"""What dropout costs on several processes: leantrain's modes against DDP, dropout on and off.

With the default settings every item draws, on any number of ranks, the random numbers it
draws in one process (``runner/draw_shift.py``): a rank runs its own items' forwards only
and moves the generators ahead over the other ranks' items by counting. This measures
what that costs against what dropout costs DDP, on two models with dropout 0.1 and 0.0:

* ``gpt``: a tied-head GPT, 4 blocks x 256 wide, vocabulary 4096, dropout on the
  embeddings, the attention weights and both residual branches (3.4M parameters), items
  of 2 sequences of 64 tokens;
* ``bert``: transformers' ``BertForSequenceClassification`` from a config (4 layers, 256
  wide, 4 heads, 1024 intermediate: the BERT layout at a size two cores can run), dropout
  in the embeddings, attention probabilities and hidden states (``hidden_dropout_prob``,
  ``attention_probs_dropout_prob``), items of 2 sequences of 128 tokens.

8 items per update, ``W`` gloo processes of one thread each. Contenders, interleaved round
after round (the order rotating): leantrain data parallel (the default all-reduce),
``exact_reduction=True``, ``sharding="gradients"`` and ``sharding="parameters"`` (all with
the default settings otherwise), and a hand-written ``DistributedDataParallel`` loop
(``no_sync`` for all but a rank's last item, ``AdamW(fused=True)``). Per update: the median
over the rounds of each round's median update time (a round's first update left out).
The cost of dropout is ``time(0.1) / time(0.0) - 1`` for each contender; leantrain's forwards
per rank per update are counted (the model's forward calls, the first update's counting
forward included, over the updates).

Run: .venv/bin/python benchmarks/dropout.py [--world 2 4] [--models gpt bert] [--rounds 5] [--steps 4]
[--only TEXT ...] (the contenders whose names contain one of the texts)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import leantrain as lt
from leantrain import optim

ITEMS, LR, WD = 8, 1e-3, 0.01
VOCAB, D, LAYERS, HEADS, T = 4096, 256, 4, 4, 64
BERT_T = 128


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList([Block(p) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def bert(p: float) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=4 * D, max_position_embeddings=BERT_T, num_labels=4,
                        hidden_dropout_prob=p, attention_probs_dropout_prob=p)
    return BertForSequenceClassification(config)


def gpt_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def bert_loss(out, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, y)


MODELS = {"gpt": (GPT, gpt_loss), "bert": (bert, bert_loss)}


def data(name: str) -> list:
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        return [(torch.randint(0, VOCAB, (2, T), generator=g), torch.randint(0, VOCAB, (2, T), generator=g))
                for _ in range(ITEMS)]
    return [(torch.randint(0, VOCAB, (2, BERT_T), generator=g), torch.randint(0, 4, (2,), generator=g))
            for _ in range(ITEMS)]


def build(name: str, p: float) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0](p)


def leantrain_round(name: str, p: float, steps: int, **kw) -> tuple[float, float]:
    """Median seconds per update (the first left out) and the model's forwards per update."""
    runner = lt.Runner.from_module(build(name, p), MODELS[name][1])
    calls = [0]
    hook = runner.module.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    cfg = lt.TrainConfig(steps=steps, batch_size=ITEMS, optimizer=optim.adamw(LR, WD), log_every=0,
                         measure_loss=False, replica_check=False, **kw)
    marks = []
    start = time.perf_counter()
    lt.train_samples(runner, cfg, data(name), log=None, callback=lambda event: marks.append(time.perf_counter()))
    hook.remove()
    times = [b - a for a, b in zip([start] + marks, marks)][1:]
    return statistics.median(times), calls[0] / steps


def ddp_round(name: str, p: float, steps: int) -> tuple[float, float]:
    net = DDP(build(name, p))
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, fused=True)
    loss_fn = MODELS[name][1]
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = data(name)[rank::world]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for j, (x, y) in enumerate(mine):
            with net.no_sync() if j < len(mine) - 1 else torch.enable_grad():
                (loss_fn(net(x), y) * (1.0 / ITEMS)).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), float(len(mine))


CONTENDERS = {
    "leantrain (default all-reduce)": lambda n, p, s: leantrain_round(n, p, s),
    "leantrain exact_reduction": lambda n, p, s: leantrain_round(n, p, s, exact_reduction=True),
    "leantrain sharding=gradients": lambda n, p, s: leantrain_round(n, p, s, sharding="gradients"),
    "leantrain sharding=parameters": lambda n, p, s: leantrain_round(n, p, s, sharding="parameters"),
    "DDP + AdamW(fused)": ddp_round,
}


def key(model: str, contender: str, p: float) -> str:
    return f"{model}|{contender}|{p}"


def worker(rank: int, world: int, init: str, models: list, contenders: list, rounds: int, steps: int,
           out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    runs = [(m, c, p) for m in models for c in contenders for p in (0.0, 0.1)]
    times: dict = {key(*k): [] for k in runs}
    calls: dict = {}
    for r in range(rounds):
        for run in runs[r % len(runs):] + runs[: r % len(runs)]:
            dist.barrier()
            t, f = CONTENDERS[run[1]](run[0], run[2], steps)
            times[key(*run)].append(t)
            calls[key(*run)] = f
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "calls": calls}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="+", default=None, help="the contenders whose names contain one of these")
    args = parser.parse_args()
    if args.only:
        for name in [n for n in CONTENDERS if not any(o in n for o in args.only)]:
            del CONTENDERS[name]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {ITEMS} items per update, gloo, 1 thread per rank; "
          f"median over {args.rounds} rounds of {args.steps} updates")
    for world in args.world:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            mp.spawn(worker, args=(world, os.path.join(tmp, "init"), args.models, list(CONTENDERS), args.rounds,
                                   args.steps, out),
                     nprocs=world, join=True)
            with open(out) as f:
                got = json.load(f)
        for model in args.models:
            print(f"\n{model}, W = {world}: ms per update (dropout 0.0 / 0.1), the cost of dropout, "
                  f"forwards per rank per update with dropout")
            costs = {}
            for name in CONTENDERS:
                off = statistics.median(got["times"][key(model, name, 0.0)])
                on = statistics.median(got["times"][key(model, name, 0.1)])
                costs[name] = on / off - 1
                forwards = got["calls"][key(model, name, 0.1)]
                print(f"  {name:32s} {off * 1e3:8.1f} {on * 1e3:8.1f}   {100 * costs[name]:+6.1f}%   {forwards:.2f}")
            ddp = costs["DDP + AdamW(fused)"]
            worst = max(v for k, v in costs.items() if k.startswith("leantrain"))
            print(f"  leantrain's largest dropout cost {100 * worst:+.1f}% against DDP's {100 * ddp:+.1f}%")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
