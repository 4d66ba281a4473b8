"""Fine-tune a GPT-2 the way a transformers Trainer user does: warm-up and linear decay
over updates, token-weighted gradient accumulation, evaluation every 4 updates, the best
checkpoint kept (and loaded at the end), and a rerun that resumes where a killed run
stopped. The model is built from its config (nothing downloaded); the text is random
runs of consecutive tokens of different lengths (a rule the model can learn). Run: .venv/bin/python examples/gpt2_finetune.py
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import leantrain as lt

lt.seed_everything(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=500, n_positions=64))
texts = [{"input_ids": (s + torch.arange(n)) % 500} for s, n in zip(torch.randint(0, 500, (160,)).tolist(),
                                                                  torch.randint(8, 64, (160,)).tolist())]
train = lt.DataLoader(texts[:128], batch_size=8, shuffle=True, seed=0, collate=lt.collate.pad_tokens)
val = lt.DataLoader(texts[128:], batch_size=16, collate=lt.collate.pad_tokens)
runner = lt.Runner.from_module(model, "model")  # the model's loss, token-weighted across accumulation
cfg = lt.LoaderTrainConfig(
    epochs=3, accumulate=2, optimizer=lt.optim.adamw(5e-4, 0.01), log_every=4, seed=0,
    schedule_per="step", scheduler=lt.optim.linear(5e-4, 2, 24),
    eval_data=val, eval_every=4, checkpoint_path="runs/gpt2-ft/step{step}.ckpt", checkpoint_every=4,
    keep_last=1, keep_best=1, load_best_at_end=True, resume_from="auto")
report, _ = lt.train_loader(runner, cfg, train)
print(f"eval loss by update: {[(s, round(r['loss'], 3)) for s, r in report.evals]}; "
      f"best kept and loaded: {report.best_checkpoint}")
