"""leantrain on a CUDA device against what a GPU user has: nanoGPT's hand loop, torch's fused
AdamW, transformers' Trainer (#71). One process; each comparison interleaved (the order
alternating each round) after a warm-up, median and best of N; one table, also written as
JSON (``--out``).

* **GPT-2 124M, nanoGPT's loop**: the model nanoGPT's ``model.py`` writes (12 layers, 768
  wide, 12 heads, context 1024, vocabulary 50304, tied head, no dropout, causal SDPA),
  random tokens made on the device, bf16 autocast, ``AdamW(fused=True)``, betas (0.9,
  0.95), weight decay 0.1 on every tensor (both sides alike; nanoGPT decays matrices
  only), gradients clipped to norm 1.0, ``ACCUM`` micro-batches per update (micro-batch
  sized to the device's memory). leantrain: ``train_loader`` over the same micro-batches,
  each update a list of them (the 1/n mean of the accumulation contract, which is the
  hand loop's ``loss / accum``), ``measure_loss=False``, ``log_every=0``. Without and with
  ``torch.compile`` (``compile=True`` against ``torch.compile(model)``). Per side: time per
  update, tokens per second, MFU (nanoGPT's FLOPs per token, the device's dense bf16 peak
  from its name) and peak memory (each side built and run alone after the allocator's cache
  is emptied: its model, gradients, optimizer state and activations). Goals: <= 1.02 of the hand loop's time, <= 1.05 of its
  memory.
* **Host syncs**: updates 2..n of a leantrain run (``measure_loss=False``, a log line every
  ``n`` updates) under ``torch.cuda.set_sync_debug_mode("error")``; any sync is reported
  with the place it happened.
* **One AdamW step** over the 124M parameters' shapes against ``torch.optim.AdamW(fused=True)``
  (goal <= 1.02).
* **Hugging Face GPT-2** (``GPT2LMHeadModel`` from a config) fine-tuned, bf16, against
  ``transformers.Trainer`` on the same device and batches (``train_runtime`` per update
  against leantrain's wall time per update; goal <= 1.00).
* **Exact resume on the device**: the small GPT trained for ``n`` updates twice
  (determinism), and stopped at ``k`` then resumed in a fresh process: the resumed run's
  parameters and optimizer state against the uninterrupted run's, bit for bit.
* **``sharding="parameters"`` on one device** (world size 1): it must run on CUDA; its time
  per update against leantrain unsharded; ``engine="fsdp2"`` in one process (parameter
  sharding's one-rank plan) the same way.

``--smoke`` runs every one of these code paths on the CPU with a tiny model in well under a
minute (the suite runs it: ``tests/test_gpu_benchmark.py``), so the script cannot rot
between device loans; its numbers mean nothing.

Run: python benchmarks/gpu.py [--smoke] [--rounds 5] [--updates 8] [--out gpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import leantrain as lt

warnings.filterwarnings("ignore")
HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------ the model (nanoGPT's)
@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


SMOKE = GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32)


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def flops_per_token(model: GPT) -> float:
    """nanoGPT's ``estimate_mfu``: 6N + 12 L H Q T per token (forward and backward)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * c.block_size


PEAK_BF16 = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12),
             ("L4", 121e12), ("A10G", 70e12), ("RTX 4090", 165e12), ("V100", 125e12)]  # dense, no sparsity


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((f for key, f in PEAK_BF16 if key in name), None)


# ------------------------------------------------------------------ timing
class Setup:
    def __init__(self, smoke: bool, rounds: int, updates: int) -> None:
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.config = SMOKE if smoke else GPTConfig()
        self.rounds, self.updates = (2, 3) if smoke else (rounds, updates)
        self.accum = 2 if smoke else 4
        if smoke:
            self.micro = 2
        else:
            gib = torch.cuda.get_device_properties(self.device).total_memory / 2**30
            self.micro = 16 if gib >= 70 else 8 if gib >= 35 else 4

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # intentional: the timer reads the device's finished work

    def tokens(self, n: int, seed: int = 1) -> list:
        g = torch.Generator(device=self.device).manual_seed(seed)
        c = self.config
        return [(torch.randint(0, c.vocab_size, (self.micro, c.block_size), device=self.device, generator=g),
                 torch.randint(0, c.vocab_size, (self.micro, c.block_size), device=self.device, generator=g))
                for _ in range(n)]

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def interleaved(setup: Setup, sides: dict) -> dict:
    """Each side's seconds per update, round after round, the order alternating."""
    names = list(sides)
    times: dict = {n: [] for n in names}
    for r in range(setup.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            times[n].append(sides[n]())
    return {n: {"median": statistics.median(t), "best": min(t)} for n, t in times.items()}


def ratio(a: dict, b: dict) -> dict:
    return {"median": a["median"] / b["median"], "best": a["best"] / b["best"]}


# ------------------------------------------------------------------ 1. GPT-2 124M against nanoGPT's loop
def hand_loop(setup: Setup, model: nn.Module, call, data: list):
    """nanoGPT's ``train.py`` update: accumulate ``accum`` micro-batches (loss / accum),
    clip to 1.0, fused AdamW, ``zero_grad(set_to_none=True)``. Returns a timed runner."""
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def updates(n: int) -> None:
        for u in range(n):
            for m in range(setup.accum):
                x, y = data[(u * setup.accum + m) % len(data)]
                with setup.autocast():
                    loss = gpt_loss(call(x), y) / setup.accum
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def timed() -> float:
        updates(1)  # warm (and the first update's allocations)
        setup.sync()
        start = time.perf_counter()
        updates(setup.updates)
        setup.sync()
        return (time.perf_counter() - start) / setup.updates

    return timed, updates


def leantrain_side(setup: Setup, model: nn.Module, data: list, compiled: bool, **kw):
    runner = lt.Runner.from_module(model, gpt_loss)
    batches = [data[(u * setup.accum) % len(data):][:setup.accum] for u in range(setup.updates + 1)]

    def cfg(steps: int) -> lt.LoaderTrainConfig:
        return lt.LoaderTrainConfig(epochs=1, max_steps=steps, optimizer=lt.optim.adamw(6e-4, betas=(0.9, 0.95),
                                    weight_decay=0.1), clip_grad_norm=1.0, autocast="bfloat16", compile=compiled,
                                    measure_loss=False, log_every=0, eval_at_end=False, **kw)

    def updates(n: int) -> None:
        lt.train_loader(runner, cfg(n), batches[:n], log=None)

    def timed() -> float:
        marks = []

        def first(event) -> None:
            if event.step == 1:
                setup.sync()
                marks.append(time.perf_counter())  # after the first update: the loop's start left out
        lt.train_loader(runner, cfg(setup.updates + 1), batches, log=None, callback=first)
        setup.sync()
        return (time.perf_counter() - marks[0]) / setup.updates

    return timed, updates, runner


def peak_memory(setup: Setup, build) -> float | None:
    """(peak bytes, bytes held before the updates) of one side built and run alone: its
    model, gradients, optimizer state and activations, above what was allocated before it
    was built (the shared data and the template model)."""
    if setup.device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(setup.device)
    run = build()
    held = torch.cuda.memory_allocated(setup.device)
    torch.cuda.reset_peak_memory_stats(setup.device)
    run(3)
    setup.sync()
    peak = torch.cuda.max_memory_allocated(setup.device) - base
    del run
    gc.collect()
    return peak, held - base


def gpt_rows(setup: Setup, compiled: bool) -> list:
    torch.manual_seed(0)
    base = GPT(setup.config).to(setup.device)
    data = setup.tokens(2 * setup.accum)
    ours_model, theirs_model = copy.deepcopy(base), copy.deepcopy(base)
    theirs_call = torch.compile(theirs_model) if compiled else theirs_model
    theirs, theirs_updates = hand_loop(setup, theirs_model, theirs_call, data)
    ours, ours_updates, _ = leantrain_side(setup, ours_model, data, compiled)
    got = interleaved(setup, {"leantrain": ours, "hand loop": theirs})
    tokens = setup.accum * setup.micro * setup.config.block_size
    fpt, peak = flops_per_token(base), peak_flops(setup.device)
    del ours_model, theirs_model, theirs_call
    mem_ours = peak_memory(setup, lambda: leantrain_side(setup, copy.deepcopy(base), data, compiled)[1])
    mem_theirs = peak_memory(setup, lambda: hand_loop(setup, (m := copy.deepcopy(base)),
                                                      torch.compile(m) if compiled else m, data)[1])
    what = f"GPT-2 124M update ({setup.accum} x {setup.micro} x {setup.config.block_size} tokens, bf16" + \
        (", torch.compile)" if compiled else ")")
    if setup.smoke:
        what = what.replace("GPT-2 124M", "GPT (smoke)")
    row = {"what": what, "leantrain_s": got["leantrain"]["median"], "reference": "nanoGPT hand loop",
           "reference_s": got["hand loop"]["median"], **_ratios(got["leantrain"], got["hand loop"]), "goal": 1.02,
           "tokens_per_s": {k: tokens / v["median"] for k, v in got.items()},
           "mfu": {k: (fpt * tokens / v["median"] / peak if peak else None) for k, v in got.items()}}
    if mem_ours is not None:
        row["peak_memory_bytes"] = {"leantrain": mem_ours[0], "hand loop": mem_theirs[0]}
        row["memory_ratio"] = mem_ours[0] / mem_theirs[0]
        row["memory_goal"] = 1.05
    return [row]


def _ratios(a: dict, b: dict) -> dict:
    r = ratio(a, b)
    return {"ratio_median": r["median"], "ratio_best": r["best"]}


# ------------------------------------------------------------------ 2. host syncs
def sync_rows(setup: Setup) -> list:
    """Updates 2..n with any host sync an error (on the CPU: the same run, nothing checked)."""
    torch.manual_seed(0)
    model = GPT(SMOKE if setup.smoke else GPTConfig(n_layer=4)).to(setup.device)
    data = setup.tokens(2 * setup.accum)
    runner = lt.Runner.from_module(model, gpt_loss)
    n = 6
    batches = [data[:setup.accum]] * n
    cfg = lt.LoaderTrainConfig(epochs=1, max_steps=n, optimizer=lt.optim.adamw(6e-4, weight_decay=0.1),
                               clip_grad_norm=1.0, autocast="bfloat16", measure_loss=False, log_every=n,
                               eval_at_end=False)
    cuda = setup.device.type == "cuda"

    class Checked(lt.Callback):
        reads_only = True

        def on_step(self, event) -> None:
            if cuda:
                torch.cuda.set_sync_debug_mode("error" if event.step < n - 1 else "default")

    lt.train_loader(runner, cfg, batches, log=None)  # warm-up run
    found = None
    try:
        lt.train_loader(runner, cfg, batches, log=None, callbacks=[Checked()])
    except RuntimeError as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "leantrain" in f.filename]
        where = f"{frames[-1].filename.split('src/')[-1]}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
        found = f"{str(e).splitlines()[0]} at {where}"
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    return [{"what": f"host syncs in updates 2..{n - 2} (measure_loss=False, log every {n})",
             "syncs": None if not cuda else (0 if found is None else 1), "first_sync": found,
             "checked": cuda}]


# ------------------------------------------------------------------ 3. one AdamW step
def adamw_rows(setup: Setup) -> list:
    shapes = [tuple(p.shape) for p in GPT(setup.config).parameters()]
    g = torch.Generator(device=setup.device).manual_seed(0)
    init = [torch.randn(s, device=setup.device, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=setup.device, generator=g) * 1e-3 for s in shapes]
    params = lt.ParamList.of_pack([t.clone() for t in init])
    opt = lt.optim.adamw(6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    state = [opt.init(params)]
    tparams = [nn.Parameter(t.clone()) for t in init]
    for p, gr in zip(tparams, grads):
        p.grad = gr
    topt = torch.optim.AdamW(tparams, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    reps = 2 if setup.smoke else 20

    def ours() -> float:
        setup.sync()
        start = time.perf_counter()
        for _ in range(reps):
            state[0] = opt.step(state[0], params, grads)
        setup.sync()
        return (time.perf_counter() - start) / reps

    def theirs() -> float:
        setup.sync()
        start = time.perf_counter()
        for _ in range(reps):
            topt.step()
        setup.sync()
        return (time.perf_counter() - start) / reps

    ours(), theirs()  # warm: state allocated
    got = interleaved(setup, {"leantrain": ours, "torch": theirs})
    n = sum(math.prod(s) for s in shapes)
    return [{"what": f"one AdamW step, {n / 1e6:.1f}M parameters", "leantrain_s": got["leantrain"]["median"],
             "reference": "torch.optim.AdamW(fused=True)", "reference_s": got["torch"]["median"],
             **_ratios(got["leantrain"], got["torch"]), "goal": 1.02}]


# ------------------------------------------------------------------ 4. Hugging Face GPT-2 against Trainer
def hf_rows(setup: Setup) -> list:
    try:
        import transformers
    except ImportError:
        return [{"what": "Hugging Face GPT-2 fine-tune", "skipped": "transformers is not installed"}]
    transformers.logging.set_verbosity_error()
    layers, width, t = (2, 32, 32) if setup.smoke else (12, 768, 512)
    conf = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=2 if setup.smoke else 12, vocab_size=50257
                                   if not setup.smoke else 256, n_positions=t, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(conf)
    rows_n, batch = (4, 2) if setup.smoke else (24, 8)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": (ids := torch.randint(1, conf.vocab_size, (t,), generator=g)), "labels": ids.clone(),
             "attention_mask": torch.ones(t, dtype=torch.long)} for _ in range(rows_n * batch)]
    stack = lambda rs: {k: torch.stack([r[k] for r in rs]) for k in rs[0]}  # noqa: E731
    batches = [stack(rows[i:i + batch]) for i in range(0, len(rows), batch)]

    def ours() -> float:
        model = copy.deepcopy(base).to(setup.device)
        runner = lt.Runner.from_module(model, "model")
        cfg = lt.LoaderTrainConfig(epochs=1, optimizer=lt.optim.adamw(5e-5, weight_decay=0.0), measure_loss=False,
                                   log_every=0, autocast="bfloat16", eval_at_end=False)
        on_device = [{k: v.to(setup.device) for k, v in b.items()} for b in batches]
        setup.sync()
        start = time.perf_counter()
        report, _ = lt.train_loader(runner, cfg, on_device, log=None)
        setup.sync()
        return (time.perf_counter() - start) / report.steps

    def theirs() -> float:
        model = copy.deepcopy(base)
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                out, max_steps=len(batches), per_device_train_batch_size=batch, learning_rate=5e-5,
                weight_decay=0.0, optim="adamw_torch_fused", lr_scheduler_type="constant", report_to=[],
                save_strategy="no", logging_strategy="no", use_cpu=setup.smoke, bf16=True,
                dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
            with contextlib.redirect_stdout(open(os.devnull, "w")):  # its closing metrics line
                got = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=stack).train()
        return got.metrics["train_runtime"] / len(batches)

    got = interleaved(setup, {"leantrain": ours, "Trainer": theirs})
    return [{"what": f"Hugging Face GPT-2 ({layers} x {width}) fine-tune, {batch} x {t} tokens, bf16, whole run",
             "leantrain_s": got["leantrain"]["median"], "reference": "transformers Trainer",
             "reference_s": got["Trainer"]["median"], **_ratios(got["leantrain"], got["Trainer"]), "goal": 1.00}]


# ------------------------------------------------------------------ 5. exact resume, 6. parameter sharding
RESUME_CONFIG = GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64)


def resume_child(phase: str, folder: str, smoke: bool) -> None:
    """One phase in a fresh process: ``full``/``again`` (8 updates), ``stop`` (4), ``resume`` (4 -> 8)."""
    setup = Setup(smoke, 1, 1)
    torch.manual_seed(0)
    model = GPT(RESUME_CONFIG).to(setup.device)
    setup.config = RESUME_CONFIG
    data = setup.tokens(16)
    runner = lt.Runner.from_module(model, gpt_loss)
    batches = [data[2 * u:2 * u + 2] for u in range(8)]
    steps = 4 if phase == "stop" else 8
    cfg = lt.LoaderTrainConfig(epochs=1, max_steps=steps, optimizer=lt.optim.adamw(1e-3, weight_decay=0.1),
                               clip_grad_norm=1.0, autocast="bfloat16", measure_loss=False, log_every=0,
                               eval_at_end=False, checkpoint_path=os.path.join(folder, f"{phase}.ckpt"),
                               resume_from=os.path.join(folder, "stop.ckpt") if phase == "resume" else None)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the math kernel: flash attention's backward adds in no fixed order
        lt.train_loader(runner, cfg, batches, log=None)


def resume_rows(setup: Setup) -> list:
    with tempfile.TemporaryDirectory() as folder:
        for phase in ("full", "again", "stop", "resume"):
            subprocess.run([sys.executable, HERE, "--resume-child", phase, folder] + (["--smoke"] if setup.smoke
                           else []), check=True)

        def kept(phase: str) -> dict:
            _, tensors = lt.read_checkpoint(os.path.join(folder, f"{phase}.ckpt"))
            return {k: t for k, t in tensors.items() if k.startswith(("storage.", "state."))}

        full, again, resumed = kept("full"), kept("again"), kept("resume")
        repeat = [k for k in full if not torch.equal(full[k], again[k])]
        differ = [k for k in full if not torch.equal(full[k], resumed[k])]
    return [{"what": "exact resume: stopped at update 4 of 8, resumed in a fresh process",
             "tensors": len(full), "differ_repeat": len(repeat), "differ_resume": len(differ),
             "exact": not repeat and not differ}]


def sharding_rows(setup: Setup) -> list:
    """``sharding="parameters"`` and ``engine="fsdp2"`` in one process on the device: the
    latter is the former's one-rank plan (nothing to shard with one rank; its checkpoint a
    folder), so both are timed against leantrain unsharded. Two or more devices
    (``fully_shard`` over NCCL) are ``tests/parallel/test_engines.py``'s CUDA test."""
    torch.manual_seed(0)
    conf = SMOKE if setup.smoke else GPTConfig(n_layer=4)
    base = GPT(conf).to(setup.device)
    saved = setup.config
    setup.config = conf
    data = setup.tokens(2 * setup.accum)
    plain = leantrain_side(setup, copy.deepcopy(base), data, False)[0]
    sharded = leantrain_side(setup, copy.deepcopy(base), data, False, sharding="parameters")[0]
    fsdp2 = leantrain_side(setup, copy.deepcopy(base), data, False, engine="fsdp2")[0]
    got = interleaved(setup, {"parameters": sharded, "fsdp2": fsdp2, "unsharded": plain})
    setup.config = saved
    return [{"what": f"{what}, world size 1 ({conf.n_layer} layers)", "leantrain_s": got[side]["median"],
             "reference": "leantrain unsharded", "reference_s": got["unsharded"]["median"],
             **_ratios(got[side], got["unsharded"])}
            for side, what in (("parameters", "sharding='parameters'"), ("fsdp2", "engine='fsdp2'"))]


# ------------------------------------------------------------------ the table
def table(rows: list) -> str:
    lines = [f"{'what':72s} {'leantrain':>10s} {'reference':>10s} {'median':>7s} {'best':>7s} {'goal':>5s}"]
    for r in rows:
        if "leantrain_s" in r:
            lines.append(f"{r['what'][:72]:72s} {r['leantrain_s'] * 1e3:8.2f}ms {r['reference_s'] * 1e3:8.2f}ms "
                         f"{r['ratio_median']:7.3f} {r['ratio_best']:7.3f} {r.get('goal', ''):>5}")
            lines.append(f"{'':4s}against {r['reference']}")
            if "tokens_per_s" in r:
                tok, mfu = r["tokens_per_s"], r["mfu"]
                lines.append(f"{'':4s}tokens/s {tok['leantrain']:,.0f} vs {tok['hand loop']:,.0f}; MFU "
                             + (f"{mfu['leantrain']:.1%} vs {mfu['hand loop']:.1%}" if mfu["leantrain"] else "n/a"))
            if "peak_memory_bytes" in r:
                m = r["peak_memory_bytes"]
                lines.append(f"{'':4s}peak memory {m['leantrain'] / 2**30:.2f} GiB vs {m['hand loop'] / 2**30:.2f} GiB "
                             f"({r['memory_ratio']:.3f}, goal {r['memory_goal']})")
        elif "syncs" in r:
            lines.append(f"{r['what']}: " + ("not checked on the CPU" if not r["checked"] else
                                             f"{r['syncs']} ({r['first_sync'] or 'none'})"))
        elif "exact" in r:
            lines.append(f"{r['what']}: {'exact' if r['exact'] else 'NOT exact'} ({r['tensors']} tensors; "
                         f"{r['differ_repeat']} differ between two uninterrupted runs, {r['differ_resume']} after "
                         f"the resume)")
        else:
            lines.append(f"{r['what']}: {r.get('error') or r.get('skipped') or 'ran'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every code path on the CPU with a tiny model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--out", default="gpu.json")
    parser.add_argument("--only", nargs="*", default=None, help="sections: gpt compiled syncs adamw hf resume sharding")
    parser.add_argument("--resume-child", nargs=2, metavar=("PHASE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume_child:
        return resume_child(*args.resume_child, args.smoke)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: no CUDA device (run with --smoke for the CPU code paths)")
    setup = Setup(args.smoke, args.rounds, args.updates)
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(setup.device)
    head = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "micro_batch": setup.micro,
            "accum": setup.accum, "rounds": setup.rounds, "updates": setup.updates}
    try:
        head["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(HERE)).stdout.strip()
    except OSError:
        head["commit"] = None
    print(" ".join(f"{k}={v}" for k, v in head.items()), flush=True)
    sections = {"gpt": lambda: gpt_rows(setup, False), "compiled": lambda: gpt_rows(setup, True),
                "syncs": lambda: sync_rows(setup), "adamw": lambda: adamw_rows(setup), "hf": lambda: hf_rows(setup),
                "resume": lambda: resume_rows(setup), "sharding": lambda: sharding_rows(setup)}
    rows = []
    for name, section in sections.items():
        if args.only is not None and name not in args.only:
            continue
        if args.smoke and name == "compiled":
            continue  # torch.compile's first compile alone outlasts the smoke's minute
        start = time.perf_counter()
        try:
            got = section()
        except Exception as e:  # one section's failure is a row, the others still run
            got = [{"what": name, "error": f"{type(e).__name__}: {e}"[:500]}]
        for r in got:
            r["section"], r["seconds"] = name, time.perf_counter() - start
        rows += got
        with open(args.out, "w") as f:  # after every section: a device run cut short keeps what it measured
            json.dump({**head, "rows": rows}, f, indent=1, default=str)
        print(table(got), flush=True)
    print("\n" + table(rows))


if __name__ == "__main__":
    main()
