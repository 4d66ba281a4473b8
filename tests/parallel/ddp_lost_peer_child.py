"""A rank of a two-rank ``engine="ddp"`` (or ``"fsdp2"``) run whose rank 1 dies (SIGKILL) as
update 4 begins, at an explicit point: rank 0 meets the loss inside DDP's gradient
all-reduce (FSDP2's all-gather) (``test_engines.py``). Arguments: rank, the rendezvous
file, the output folder, the engine."""
import os, signal, sys
import torch, torch.distributed as dist, torch.nn as nn
import leantrain as lt
from leantrain.training.loops import session
rank, init, out, engine = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
update = session.Session.update
def dying(self, state, batch, step):
    if step == 4 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dead before update 4: rank 0 meets it in DDP's all-reduce
    return update(self, state, batch, step)
session.Session.update = dying
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
torch.manual_seed(0)
runner = lt.Runner.from_module(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), "mse")
g = torch.Generator().manual_seed(1)
data = [(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(8)]
cfg = lt.TrainConfig(steps=10, batch_size=4, log_every=0, checkpoint_every=3, collective_timeout=3, engine=engine,
                     checkpoint_path=os.path.join(out, "run.ckpt"))
try:
    lt.train_samples(runner, cfg, data)
except lt.LeantrainError as e:
    print(type(e).__name__, "|", e, flush=True)
    os._exit(3)
print("finished", flush=True)
