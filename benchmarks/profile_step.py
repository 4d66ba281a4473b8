"""Where a tiny step's microseconds go: cProfile of train_samples (MLP 32-64-64-1, batch
64, SGD, 3000 steps, one thread), grouped by where the time is spent, scaled to the
unprofiled time per step (cProfile inflates Python calls, so the shares are indicative).

Run: .venv/bin/python benchmarks/profile_step.py LABEL"""
import cProfile, pstats, sys, time, collections
import torch
from torch import nn
import leantrain as lt
from leantrain import optim
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
samples = [(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)) for _ in range(4)]
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
r = lt.Runner.from_module(model, "mse")
STEPS = 3000
cfg = lt.TrainConfig(steps=STEPS, optimizer=optim.sgd(0.01), log_every=0)
lt.train_samples(r, cfg, samples, log=lambda s: None)
t = time.perf_counter(); lt.train_samples(r, cfg, samples, log=lambda s: None); wall = (time.perf_counter() - t) / STEPS
pr = cProfile.Profile(); pr.enable(); lt.train_samples(r, cfg, samples, log=lambda s: None); pr.disable()
st = pstats.Stats(pr)
groups = collections.Counter()
for (file, line, fn), (cc, nc, tt, ct, callers) in st.stats.items():
    if "run_backward" in fn: key = "autograd backward (C++)"
    elif fn in ("linear", "relu", "mse_loss") or "_nn." in fn or "built-in method torch.relu" in fn: key = "forward kernels (C++)"
    elif "_foreach" in fn or "_fused" in fn: key = "optimizer kernels (C++)"
    elif "non_finite" in fn or "method 'item'" in fn: key = "non-finite check (kernel + flag read)"
    elif "leantrain" in file: key = "leantrain Python"
    elif "torch" in file: key = "torch Python (Module.__call__, autograd.grad)"
    else: key = "other"
    groups[key] += tt
total = sum(groups.values())
print(f"{sys.argv[1] if len(sys.argv) > 1 else 'leantrain'}: {wall * 1e6:.0f} us/step unprofiled; profiled shares:")
for k, v in groups.most_common():
    print(f"  {k:<48} {v / total * wall * 1e6:6.0f} us  ({v / total:5.1%})")
