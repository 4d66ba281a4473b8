"""``leantrain predict RUN -o FILE.pt``: a trained run's outputs on data, as ``lt.predict``
gives them. The model is the run's own (its ``config.json``: a preset, or the model, data,
loss and collate references it names, imported as ``--resume`` imports them: a run folder
is code you trust), its weights the run's checkpoint (the best kept with ``--keep-best``,
else the newest; ``--step N`` of a kept folder). The data: the run's test split (its
preset's, or its ``--data``'s second part), its training split with ``--split train``, or
``--data PKG.MOD:FN``, a function returning a list of samples (``(x, y)`` pairs, or dicts
of token tensors), batched as the run batched its test split. The file is one tensor, the
outputs in the data's order stacked along dimension 0 (a Hugging Face output's
``logits``), written atomically with ``torch.save``; ``torch.load(FILE)`` reads it back.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from ..io.atomic import atomic_write_bytes
from ..training.loops.evaluation import predict
from ..training.runner.runner import Runner
from .managed import run_checkpoint
from .usage import UserError


def cmd_predict(args) -> int:
    from ..io.loading import load_checkpoint
    from .runconfig import RunConfig
    from .usermodel import build_task, call_user, checked_samples, collate_for, resolve

    run, out = Path(args.run), Path(args.output)
    if out.suffix != ".pt":
        raise UserError(f"predict: -o {out}: the outputs are written with torch.save: give a .pt file")
    saved = run / "config.json"
    if not saved.is_file():
        raise UserError(f"predict: {run}: not a run folder (no config.json: the run's model is named there)")
    try:
        settings = json.loads(saved.read_text())
        cfg = RunConfig(**settings) if isinstance(settings, dict) else None
    except (ValueError, TypeError, RecursionError) as e:
        raise UserError(f"predict: {saved}: not the settings of a run ({str(e).splitlines()[0]})") from None
    if cfg is None:
        raise UserError(f"predict: {saved}: not a JSON object of settings")
    checkpoint = run_checkpoint(run, args.step)
    if not checkpoint.exists():
        raise UserError(f"predict: {run}: holds no checkpoint to predict with")
    factory, loss, train, test = build_task(cfg)
    samples = {"test": test, "train": train}[args.split]
    if args.data is not None:
        samples = checked_samples(call_user(resolve(args.data, "data"), args.data, "data"), args.data, "prediction",
                           cfg.collate is None)
    runner = Runner.from_module(factory(), loss)
    load_checkpoint(checkpoint, runner, restore_rng=False)  # the trained weights, nothing else of the run
    batches = collate_for(cfg, samples)(args.batch_size)(samples)
    outputs = [_tensor(o) for o in predict(runner, batches, to="cpu")]
    stacked = torch.cat(outputs) if all(o.dim() > 0 for o in outputs) else torch.stack(outputs)
    buffer = io.BytesIO()
    torch.save(stacked, buffer)
    atomic_write_bytes(out, buffer.getvalue(), "predict")
    print(f"predicted {len(samples)} samples with {checkpoint}: outputs {tuple(stacked.shape)} "
          f"{str(stacked.dtype).removeprefix('torch.')} -> {out}")
    return 0


def _tensor(output) -> torch.Tensor:
    """A model's output as one tensor: itself, or a Hugging Face output's ``logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if hasattr(output, "get") else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise UserError(f"predict: the model returns a {type(output).__name__}, not a tensor (nor an output with "
                    f"logits): use lt.predict in Python for outputs of other shapes")
