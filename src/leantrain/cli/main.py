"""The ``leantrain`` command: quickstart-mlp, train, check, inspect, export, find-lr, find-batch-size, plot.

A user error (bad flag or value, missing or corrupt file, a resume into another
model) prints one line and exits with status 2; Ctrl-C during training saves a
checkpoint and exits with status 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..errors import LeantrainError
from ..errors import CheckpointError
from ..io.atomic import path_problem
from ..io.regular import read_regular
from ..io.torchlean import detect_format
from .check import cmd_check
from .managed import describe_kept, kept_folder
from .torchlean import cmd_export, inspect_torchlean
from .train import cmd_train
from .runconfig import add_flags
from .usage import EXIT_USER, OneLineParser, UserError, positive, seed

def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="leantrain", description="The TorchLean trainer runtime on PyTorch.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    q = sub.add_parser("quickstart-mlp", help="the TorchLean quickstart: a 2-8-1 MLP on a 5x5 grid")
    q.add_argument("--steps", type=positive, default=200, help="optimizer steps (default 200)")
    q.add_argument("--seed", type=seed, default=0, help="model initialisation seed (default 0)")
    q.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    t = sub.add_parser("train", help="train a preset on the bundled digits data, or your own model")
    t.add_argument("config", nargs="?", help="a TOML file with the same keys as the flags")
    add_flags(t, "train")  # every setting: one row of runconfig.FIELDS
    t.add_argument("--overwrite", action="store_true",
                   help="replace the earlier run in --out (its files are replaced as the new run writes)")
    t.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR exactly "
                   "('auto': the --out folder's run if it has one, else start fresh)")
    i = sub.add_parser("inspect", help="show a checkpoint's slots, optimizer, progress and integrity")
    i.add_argument("checkpoint", help="a checkpoint file, a sharded checkpoint folder, a run folder (the one "
                   "checkpoint, or the kept ones listed and the best or newest shown), or a TorchLean file")
    c = sub.add_parser("check", help="verify leantrain's guarantees on a preset or your own model")
    c.add_argument("config", nargs="?", help="a TOML file with the same keys as train")
    add_flags(c, "check")
    c.add_argument("--max-ratio", type=float, default=2.0, help="slowest step time accepted vs a hand loop (2.0)")
    c.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    e = sub.add_parser("export", help="export a checkpoint's weights (safetensors) or in TorchLean's formats")
    e.add_argument("checkpoint")
    e.add_argument("--torchlean", action="store_true",
                   help="TLPF32B parameters at -o FILE, Adam/AdamW state as TLADAMF at FILE.adam")
    e.add_argument("--weights", action="store_true", help="a safetensors weights file (leantrain.weights)")
    e.add_argument("--consolidate", action="store_true",
                   help="one checkpoint file from a sharded checkpoint folder (what an unsharded run writes)")
    e.add_argument("--dcp", action="store_true", help="a torch.distributed.checkpoint folder at -o DIR of the "
                   "model's state dict, the plain module's names (what torchtitan and Lightning's FSDP read)")
    e.add_argument("--ema", action="store_true", help="the moving average of the weights (trained with --ema)")
    e.add_argument("--step", type=positive, help="of a run keeping a folder of checkpoints: the one of update N "
                   "(default: the best with --keep-best, else the newest)")
    e.add_argument("--config", metavar="FILE", help="with --weights: a Hugging Face config.json to write beside the "
                   "weights (default: the one the checkpoint keeps, for a model that has one)")
    e.add_argument("-o", "--output", required=True, help="the parameter file to write")
    f = sub.add_parser("find-lr", help="the learning-rate range test on the job train would run (a plot and a "
                       "suggested --lr)")
    f.add_argument("config", nargs="?", help="a TOML file with the same keys as train")
    add_flags(f, "train")
    f.add_argument("--start-lr", type=float, default=1e-7, help="the sweep's first rate (default 1e-7)")
    f.add_argument("--end-lr", type=float, default=10.0, help="the sweep's last rate (default 10)")
    f.add_argument("--steps", type=positive, default=100, help="updates in the sweep (default 100)")
    b = sub.add_parser("find-batch-size", help="the largest --batch-size that fits (doubling, on a copy of the "
                       "model, with the optimizer and accumulation the run will have)")
    b.add_argument("config", nargs="?", help="a TOML file with the same keys as train")
    add_flags(b, "train")
    b.add_argument("--memory-budget", type=positive, metavar="MIB", help="MiB the process's peak resident memory "
                   "may reach (required on CPU; on CUDA default: the device's free memory)")
    b.add_argument("--max-batch-size", type=positive, help="stop doubling there")
    b.add_argument("--steps", type=positive, default=2, help="updates per trial (default 2)")
    r = sub.add_parser("predict", help="a trained run's outputs on data (its test split, or --data), as one "
                       "tensor in a .pt file")
    r.add_argument("run", help="the run folder (its config.json names the model; its best, else newest, checkpoint)")
    r.add_argument("--data", metavar="PKG.MOD:FN", help="a function returning the samples to predict (default: the "
                   "run's test split)")
    r.add_argument("--split", choices=["test", "train"], default="test", help="without --data: which split of the "
                   "run's data (default test)")
    r.add_argument("--step", type=positive, help="of a run keeping a folder of checkpoints: the one of update N")
    r.add_argument("--batch-size", type=positive, default=512, help="samples per forward (default 512)")
    r.add_argument("-o", "--output", required=True, help="the .pt file to write (torch.load reads it back)")
    p = sub.add_parser("plot", help="plot a metrics.jsonl file")
    p.add_argument("metrics")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
        if args.command is None:
            ap.print_help()
            return EXIT_USER
        for name in ("checkpoint", "metrics", "output"):  # the paths a subcommand reads or writes
            problem = path_problem(getattr(args, name, None))
            if problem is not None:
                raise UserError(f"{args.command}: {getattr(args, name)!r:.80}: {problem}")
        if args.command == "quickstart-mlp":
            return cmd_quickstart(args)
        if args.command == "train":
            return cmd_train(args)
        if args.command == "predict":
            from .predict import cmd_predict

            return cmd_predict(args)
        if args.command == "inspect":
            return cmd_inspect(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "check":
            return cmd_check(args)
        if args.command == "find-lr":
            from .find_lr import cmd_find_lr

            return cmd_find_lr(args)
        if args.command == "find-batch-size":
            from .find_lr import cmd_find_batch_size

            return cmd_find_batch_size(args)
        return cmd_plot(args)
    except BrokenPipeError:  # output piped into a closed reader (e.g. `| head`)
        sys.stderr.close()
        return 0
    except UserError as e:
        print(printable(f"error: {e}"), file=sys.stderr)
        return EXIT_USER
    except OSError as e:  # a path the OS refused where no check knew it would
        where = f": {e.filename!r:.80}" if e.filename else ""
        print(printable(f"error: {args.command}{where}: {e.strerror or e}"), file=sys.stderr)
        return EXIT_USER
    except LeantrainError as e:
        lines = str(e).splitlines()
        extra = f" {lines[1].strip()}" if len(lines) > 1 else ""
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        print(printable(f"error: {lines[0]}{extra}{more}"), file=sys.stderr)
        return EXIT_USER


def cmd_quickstart(args) -> int:
    from .. import Runner, TrainConfig, optim, train_samples
    from .quickstart import HELDOUT, grid, mlp

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda requested but no CUDA device is available")
    data = grid()
    runner = Runner.from_module(mlp(args.seed), "mse")
    if args.device == "cuda":
        runner.to("cuda")
    heldout = torch.tensor(HELDOUT)
    print(f"dataset size = {len(data)}")
    print("target(heldout) = [0.200000]")
    print(f"untrained(heldout) = [{runner.predict(heldout).item():.6f}]")
    print(f"mean_loss(before training) = {runner.eval().mean_loss(data):.6f}")
    report = train_samples(runner, TrainConfig(steps=args.steps, optimizer=optim.adam(0.03), log_every=25), data)
    print(f"mean_loss(after training) = {runner.eval().mean_loss(data):.6f}")
    print(f"steps: {report.steps}, wall time: {report.wall_time:.2f} s")
    print(f"trained(heldout) = [{runner.predict(heldout).item():.6f}]")
    return 0


def cmd_inspect(args) -> int:
    from ..io.checkpoint import read_checkpoint

    path = Path(args.checkpoint)
    fmt = _torchlean_format(path)
    if fmt is not None:
        inspect_torchlean(path, fmt)
        return 0
    if path.is_dir() and (path / "checkpoint.ckpt").exists():
        path = path / "checkpoint.ckpt"  # a run folder: its checkpoint
    elif kept_folder(path) is not None:  # a run keeping a folder of checkpoints: the files, then one of them
        path = describe_kept(path, kept_folder(path))
    # The loader's own checks: format, the manifest's schema, tensor names, dtypes, shapes, CRCs.
    manifest, tensors = read_checkpoint(path, "inspect")
    slots, reps = manifest["slots"], manifest["representatives"]
    if path.is_dir():
        from ..io.sharded import describe_folder

        print(f"{path}: {manifest['format']} v{manifest['version']}, {describe_folder(path)}")
    else:
        print(f"{path}: {manifest['format']} v{manifest['version']}, {path.stat().st_size:,} bytes")
    kind = "CRC-32" if manifest["version"] == 1 else "CRC-32C"
    print(f"integrity: OK ({len(tensors)} tensors, every {kind} verified)")
    print(f"{'slot':>4}  {'name':<28} {'shape':<16} {'dtype':<8} {'trainable':<9} representative")
    for i, s in enumerate(slots):
        rep = "-" if reps[i] is None else ("self" if reps[i] == i else f"slot {reps[i]} (alias)")
        print(f"{i:>4}  {printable(str(s['name'])):<28} {str(tuple(s['shape'])):<16} {s['dtype']:<8} "
              f"{'yes' if s['requires_grad'] else 'no':<9} {rep}")
    aliases = sum(1 for i, r in enumerate(reps) if r is not None and r != i)
    frozen = sum(1 for s in slots if not s["requires_grad"])
    print(f"slots: {len(slots)}, storages: {len({s['storage'] for s in slots})}, aliases: {aliases}, frozen: {frozen}")
    opt = manifest.get("optimizer")
    if opt:
        hyper = printable(", ".join(f"{k}={v}" for k, v in opt["hyper"].items()))
        print(f"optimizer: {opt['kind']}({hyper}), path {opt['path']}, steps {opt['steps']}, "
              f"lr {opt['lr']:.6g}, histories {len(opt['records'])}")
    else:
        print("optimizer: none saved")
    ema = manifest.get("ema")
    if ema is not None:
        print(f"moving average: decay {ema['decay']}, {ema['count']} updates, {len(ema['storages'])} storages")
    progress = {k: v for k, v in manifest.get("progress", {}).items() if k not in ("losses", "grad_norms")}
    print(f"progress: {json.dumps(progress, sort_keys=True)}")
    return 0


def printable(text: str) -> str:
    """``text`` with every control or non-printing character escaped (``\\n``, ``\\x1b``),
    so a name from a file cannot move the cursor, colour the terminal or forge a line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _torchlean_format(path: Path):
    """The TorchLean format of ``path`` (by magic or JSON tag), or ``None``."""
    try:
        return detect_format(path)
    except CheckpointError:
        if path.is_file() and read_regular("inspect", path, 64).lstrip()[:1] == b"{":
            raise  # a JSON file, unreadable as one: say why, not that it is no checkpoint
        return None
    except OSError:
        return None


def cmd_plot(args) -> int:
    from .plotting import plot_metrics

    out = plot_metrics(args.metrics, args.output)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
