"""A Hugging Face GPT-2 (built from its config: nothing downloaded) trained with leantrain
on token sequences of different lengths, then saved as a folder ``from_pretrained`` loads.

Run: .venv/bin/python examples/hf_gpt2.py  (about ten seconds on 2 CPU cores)
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import leantrain as lt

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128))
texts = [{"input_ids": torch.randint(0, 1000, (int(n),))} for n in torch.randint(16, 128, (160,))]
loader = lt.DataLoader(texts, batch_size=16, shuffle=True, seed=0, collate=lt.collate.pad_tokens)
runner = lt.Runner.from_module(model, "model")  # the model's own loss, on its labels
cfg = lt.LoaderTrainConfig(epochs=2, optimizer=lt.optim.adamw(3e-4, 0.1), log_every=4, schedule_per="step",
                           scheduler=lt.optim.warmup_cosine(3e-4, 3e-5, 2, 20))
report, _ = lt.train_loader(runner, cfg, loader)
lt.weights.save_weights("runs/gpt2", runner, pretrained=True)

# Everything is the user's as it was: the tie, the objects; the folder loads back.
assert model.lm_head.weight is model.transformer.wte.weight
back = GPT2LMHeadModel.from_pretrained("runs/gpt2")
print(f"loss {report.before:.3f} -> {report.after:.3f} in {report.steps} updates, {report.wall_time:.1f} s; "
      f"reloaded: {torch.equal(back.lm_head.weight, model.lm_head.weight)}")
