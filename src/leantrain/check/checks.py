"""The eight checks of ``leantrain.check``, each a function of a ``Probe`` returning
``(passed, figure)``; ``passed`` is ``None`` when the check does not apply (an optimizer
torch.optim lacks has nothing to be compared with). A probe builds fresh runners from the user's factory with the same
seed, so every check starts from the same model."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ..params.packs import canonical_gradients
from ..training.loops.config import TrainConfig
from ..training.runner.runner import Runner
from ..training.loops.sample_loop import train_samples
from ..training.loops.calls import mean_gradients, step_batch
from .reference import fingerprint, reference_gradients, relative, torch_optimizer
from ..optim.rules import rule_for
from ..samples import LossSum, add_losses, call_model, loss_target, to_device

GRADIENT_TOLERANCE = 1e-5  # float32 sums in another order: ~1e-7 seen on the zoo
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "cpu")


@dataclass
class Probe:
    """The user's factory, data and configuration, and how much work each check does."""

    factory: Callable[[], Runner]
    samples: list
    cfg: TrainConfig
    seed: int = 0
    steps: int = 4
    max_ratio: float = 2.0
    speed_runs: int = 5

    def runner(self) -> Runner:
        torch.manual_seed(self.seed)
        r = self.factory()
        if not isinstance(r, Runner):
            raise TypeError(f"the runner factory returned a {type(r).__name__}, expected a leantrain Runner")
        return r

    def batch(self) -> list:
        return self.samples[: self.cfg.batch_size]

    def batches(self, n: int) -> list:
        k, items = self.cfg.batch_size, self.samples
        return [[items[(j * k + i) % len(items)] for i in range(k)] for j in range(n)]

    def run(self, **overrides):
        """A fresh runner trained for ``steps`` updates; returns (runner, report)."""
        r = self.runner()
        torch.manual_seed(self.seed)
        cfg = replace(self.cfg, steps=self.steps, log_every=1, **overrides)
        return r, train_samples(r, cfg, self.samples, log=lambda line: None)


def gradients(p: Probe) -> tuple[bool, str]:
    r = p.runner()
    ref = copy.deepcopy(r.module)
    batch = p.batch()
    torch.manual_seed(p.seed)
    grads = canonical_gradients(r.params.canonical_slot_indices(), mean_gradients(r, batch), allow_missing=True)
    torch.manual_seed(p.seed)
    reference_gradients(ref, r.loss_fn, batch)
    theirs = {n: q.grad for n, q in ref.named_parameters() if q.requires_grad}
    scale = sum(g.double().norm().item() ** 2 for g in theirs.values() if g is not None) ** 0.5
    worst, where = 0.0, "-"
    for i, c in enumerate(r.params.canonical_slot_indices()):
        if c != i:
            continue
        name = r.params[i].name
        got, want = grads[i], theirs.get(name)
        if got is None and want is None:
            continue  # neither has a gradient: the forward did not use it
        d = relative(torch.zeros_like(want) if got is None else got, torch.zeros_like(got) if want is None else want,
                     scale)
        if d > worst:
            worst, where = d, r.params.label(i)
    ties = sum(1 for i, c in enumerate(r.params.canonical_slot_indices()) if c is not None and c != i)
    figure = f"max relative difference {worst:.2g} (at {where}; {ties} tie(s), {len(r.buffer_slots)} buffer(s))"
    return worst <= GRADIENT_TOLERANCE, figure


def optimizer(p: Probe) -> tuple[bool, str]:
    """The update rule alone: both optimizers get the same gradients each step
    (leantrain's canonical sums), so only the rules' own rounding can differ (a loop
    comparison would let Adam turn rounding in a near-zero gradient into a step of lr)."""
    r = p.runner()
    ref = copy.deepcopy(r.module)
    by_name = dict(ref.named_parameters())
    opt = p.cfg.optimizer
    torch.manual_seed(p.seed)
    state = opt.init(r.params)
    topt = torch_optimizer(opt, ref, r.params)
    if topt is None:
        return None, f"{opt.kind} has no torch.optim equivalent: not compared"
    slots_map = r.params.canonical_slot_indices()
    for b in p.batches(3):
        grads = mean_gradients(r, b)
        sums = canonical_gradients(slots_map, grads, allow_missing=True)
        for i, c in enumerate(slots_map):
            if c == i:
                by_name[r.params[i].name].grad = None if sums[i] is None else sums[i].detach().clone()
        state = opt.step(state, r.params, grads)
        topt.step()
    ours, theirs = r.module.state_dict(), ref.state_dict()
    names = [n for n, q in ref.named_parameters() if q.requires_grad]
    exact = all(torch.equal(ours[n], theirs[n]) for n in names)
    worst = max((relative(ours[n], theirs[n]) for n in names), default=0.0)
    figure = "bit-identical" if exact else f"max relative difference {worst:.2g}"
    return exact or worst <= GRADIENT_TOLERANCE, f"3 steps of {opt.kind} vs torch.optim on the same gradients: {figure}"


def accumulation(p: Probe) -> tuple[bool, str]:
    """A list batch's gradient against the mean of its items' gradients: the plain mean,
    or for a token-weighted loss (``LossSum``) each item weighted by its count, ``sum(count_i
    * g_i) / sum(count_i)``, the window mean the batch's ``sum(totals) / sum(counts)`` is."""
    r = p.runner().eval()  # buffers hold still in eval mode: items are independent
    batch = p.batch()
    together = mean_gradients(r, batch)
    singles = [mean_gradients(r, [item]) for item in batch]
    weights, token = [1.0] * len(batch), False
    with torch.no_grad(), r.binding("check.accumulation") as bound, bound.scratch_buffers():
        for k, item in enumerate(batch):
            sample = to_device(item, r.device)
            loss = r.loss_fn(call_model(r.module, sample), loss_target(sample))
            if isinstance(loss, LossSum):
                weights[k], token = float(loss.count), True  # intentional read: a diagnostic
    worst = 0.0
    for i, g in enumerate(together):
        if g is None:
            continue
        mean = sum(w * s[i].double() for w, s in zip(weights, singles) if s[i] is not None) / sum(weights)
        worst = max(worst, relative(g, mean))
    what = "the token-weighted mean" if token else "the mean"
    return worst <= 1e-6, (f"list batch of {len(batch)} vs {what} of {len(batch)} single items: max relative "
                           f"difference {worst:.2g}")


def resume_run(factory, samples: list, cfg: TrainConfig, path: str, seed: int, threads: int):
    """Build the model afresh and resume ``path`` to the end: (values, logged losses).
    Run in a spawned process when the factory can travel there."""
    torch.set_num_threads(threads)  # the same reductions as the first half
    torch.manual_seed(seed)
    r = factory()
    torch.manual_seed(seed + 12345)  # the checkpoint must restore the generators itself
    report = train_samples(r, replace(cfg, resume_from=path), samples, log=lambda line: None)
    return r.params.values(), report.losses


def _picklable(obj) -> bool:
    try:
        pickle.dumps(obj)
        return True
    except Exception:  # lambdas, closures, local classes
        return False


def exact_resume(p: Probe) -> tuple[bool, str]:
    straight, report = p.run()
    half = max(1, p.steps // 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "check.ckpt"
        first = p.runner()
        torch.manual_seed(p.seed)
        cfg = replace(p.cfg, steps=p.steps, log_every=1, checkpoint_path=path)
        train_samples(first, cfg, p.samples, log=lambda line: None,
                      callback=lambda event: event.step == half)  # stop at `half`: saved there
        args = (p.factory, p.samples, cfg, str(path), p.seed, torch.get_num_threads())
        if _picklable(args):
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                values, losses = pool.apply(resume_run, args)
            where = "a fresh process"
        else:
            values, losses = resume_run(*args)
            where = "a fresh runner (this process: the factory cannot be sent to another)"
    for i, (a, b) in enumerate(zip(straight.params.values(), values)):
        if not torch.equal(a, b):
            return False, f"{p.steps} steps straight vs {half} + checkpoint + {p.steps - half}: first differing {straight.params.label(i)}"
    if tuple(losses) != report.losses:
        return False, "parameters agree but the logged losses differ"
    return True, f"{p.steps} steps straight vs {half} + checkpoint + {p.steps - half} in {where}: bit-identical"


def determinism(p: Probe) -> tuple[bool, str]:
    first, a = p.run()
    second, b = p.run()
    for i, (x, y) in enumerate(zip(first.params.values(), second.params.values())):
        if not torch.equal(x, y):
            name = first.params[i].name or ""
            module = name.rpartition(".")[0] or "(the top-level module)"
            return False, f"two identical runs differ at {first.params.label(i)} (module {module!r}): a nondeterministic op or unseeded randomness"
    if a.losses != b.losses:
        return False, "two identical runs log different losses"
    return True, f"two runs of {p.steps} steps: bit-identical"


def module_intact(p: Probe) -> tuple[bool, str]:
    r = p.runner()
    before = fingerprint(r.module)
    torch.manual_seed(p.seed)
    train_samples(r, replace(p.cfg, steps=p.steps, log_every=0), p.samples, log=lambda line: None)
    after = fingerprint(r.module)
    changed = [k for k in before if before[k] != after[k]]
    if changed:
        return False, f"the module changed after training: {', '.join(changed)}"
    return True, "same Parameter objects, ties and state_dict keys after training"


class _ReadCounter:
    """Counts host reads (``HOST_READS`` on any tensor; on CUDA also the sync debug mode's
    warnings) made inside the block; the counters are removed afterwards."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.reads, self.on = cuda, 0, True

    def __enter__(self) -> "_ReadCounter":
        self.originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

        def counting(orig):
            def read(tensor, *a, **k):
                # an optimizer's host counter (torch.optim's step kept on the host) is not a device read
                self.reads += self.on and not (getattr(tensor, "host_counter", False) and tensor.device.type == "cpu")
                return orig(tensor, *a, **k)
            return read

        for name, orig in self.originals.items():
            setattr(torch.Tensor, name, counting(orig))
        self.caught = warnings.catch_warnings(record=True)
        self.seen = self.caught.__enter__()
        warnings.simplefilter("always")
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self.caught.__exit__(*exc)
        for name, orig in self.originals.items():
            setattr(torch.Tensor, name, orig)
        if self.cuda:
            self.reads += sum("synchroniz" in str(w.message) for w in self.seen)


def host_syncs(p: Probe) -> tuple[bool, str]:
    """Reads in steps that ask for no loss: none but the model's own. The model's forward
    may read (a Hugging Face model checking its attention mask): those are counted on a
    plain forward and backward of each item and reported beside; the loss function's
    and leantrain's reads are charged."""
    r = p.runner()
    opt = p.cfg.optimizer
    state = opt.init(r.params)
    batches = p.batches(p.steps + 1)
    state = step_batch(r, opt, state, False, batches[0], nonfinite="skip")  # warm-up
    cuda = r.device.type == "cuda"
    with _ReadCounter(cuda) as ours:
        for b in batches[1:]:
            state = step_batch(r, opt, state, False, b, nonfinite="skip")
    hand = copy.deepcopy(r.module)
    with _ReadCounter(cuda) as model:  # the model's own: one forward and backward per item
        for b in batches[1:]:
            for sample in b:
                sample = to_device(sample, r.device)
                out = call_model(hand, sample)
                model.on = False  # the loss function's reads are not the model's
                loss = r.loss_fn(out, loss_target(sample))
                model.on = True
                (loss.total if isinstance(loss, LossSum) else loss).backward()
    # an optimizer whose torch form reads by design (Adafactor's norms) declares it: charged to it, said
    declared = getattr(rule_for(opt.hyper), "host_reads", 0) * len(state.records()) * p.steps
    extra = max(0, ours.reads - model.reads - declared)
    own = f" (the model's own code: {model.reads / p.steps:g} per step)" if model.reads else ""
    if declared:
        own += f" (besides {declared / p.steps:g} per step that {opt.kind}'s torch form reads by design)"
    return extra == 0, (f"{extra / p.steps:g} device-to-host reads per step with logging off ({extra} in "
                        f"{p.steps} steps){own}")


def speed(p: Probe) -> tuple[bool, str]:
    r = p.runner()
    hand = copy.deepcopy(r.module)
    opt = p.cfg.optimizer
    state = [opt.init(r.params)]
    topt = torch_optimizer(opt, hand, r.params)
    if topt is None:
        return None, f"{opt.kind} has no torch.optim equivalent: no hand-written loop to time against"
    batches = p.batches(8)

    def ours():
        for b in batches:
            state[0] = step_batch(r, opt, state[0], False, b, nonfinite=p.cfg.nonfinite)

    def theirs():
        for b in batches:
            topt.zero_grad(set_to_none=True)
            total = None
            for sample in b:
                sample = to_device(sample, r.device)
                loss = r.loss_fn(call_model(hand, sample), loss_target(sample))
                total = loss if total is None else add_losses(total, loss)
            if isinstance(total, LossSum):
                (total.total * (1.0 / int(total.count))).backward()
            else:
                (total * (1.0 / len(b))).backward()
            topt.step()

    ours(), theirs()  # warm-up
    best = {"ours": float("inf"), "theirs": float("inf")}
    for _ in range(p.speed_runs):  # interleaved, best of N
        for key, fn in (("ours", ours), ("theirs", theirs)):
            if r.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if r.device.type == "cuda":
                torch.cuda.synchronize()
            best[key] = min(best[key], time.perf_counter() - t0)
    ratio = best["ours"] / best["theirs"]
    figure = f"step time {ratio:.2f}x a hand-written torch.optim loop (best of {p.speed_runs}; limit {p.max_ratio:g}x)"
    return ratio <= p.max_ratio, figure


CHECKS = (
    ("gradients", gradients),
    ("optimizer", optimizer),
    ("accumulation", accumulation),
    ("exact resume", exact_resume),
    ("determinism", determinism),
    ("module intact", module_intact),
    ("host syncs", host_syncs),
    ("speed", speed),
)
