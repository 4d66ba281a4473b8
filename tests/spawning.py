"""Rank processes for the distributed tests, forked from one server process.

``mp.spawn`` starts every rank as a fresh interpreter that imports torch and leantrain
again (about 2.5 s of CPU per rank on the CI's machine, some 80 ranks in the suite). The
ranks here are forked from multiprocessing's forkserver instead, which has those modules
and the case modules imported once (a clean interpreter of its own, started on first use:
no threads, nothing of the test process). What a rank computes is the same: it runs the
same function from the same fresh module state. Tests whose ranks read an environment
variable set by the test (``MALLOC_*`` for the memory measures) keep ``mp.spawn``: the
server's environment is the one it started with.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch.multiprocessing as mp

# Imported once by the server (a module that fails to import is skipped by it).
PRELOAD = ["torch", "torch.distributed", "leantrain", "safetensors.torch", "crash_child", "shard_crash_child",
           "shard_cases", "dist_cases", "rank_cases", "rank_data_cases", "rank_loader_cases", "token_cases",
           "folder_cases", "overlap_worker", "meta_cases",
           "item_seed_cases", "run_table_cases", "engine_cases"]


def context():
    """The forkserver context, its preload set (it takes effect when the server starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``mp.spawn(fn, args=args, nprocs=nprocs, join=True)`` with the ranks forked from the
    server: ``fn(rank, *args)`` in each, a rank's exception raised here."""
    context()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def rank_of_a_table(rank: int, world: int, init_file: str, out: str, every_case) -> None:
    """A rank of a case table: one thread, a gloo group of ``world`` ranks (none for one),
    ``every_case(out, world, rank)`` with ``{out}/{world}`` made, the group ended after."""
    import torch
    import torch.distributed as dist
    from pathlib import Path

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        (Path(out) / str(world)).mkdir(parents=True, exist_ok=True)
        every_case(Path(out), world, rank)
    finally:
        if world > 1:
            dist.destroy_process_group()


def rank_0_of_two(script, *args: str, timeout: float = 120) -> tuple:
    """Ranks 0 and 1 as two interpreters running ``script rank *args`` (one thread each):
    rank 0 waited for, rank 1 killed once it ends (a stopped process too). Returns rank 0's
    (return code, stdout, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=timeout)
    finally:
        procs[1].kill()  # SIGKILL ends a stopped process too
        procs[1].communicate(timeout=60)
    return procs[0].returncode, out, err
