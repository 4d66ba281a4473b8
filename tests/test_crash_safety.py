"""SIGKILL a checkpointing run at random moments: the newest complete checkpoint always
loads and verifies, and resuming from it reproduces the uninterrupted run exactly."""

import multiprocessing as mp
import random
import time

import torch

import crash_child
from leantrain.io.checkpoint import read_checkpoint

TRIALS = 50


def test_sigkill_during_checkpoint_writes(tmp_path):
    torch.set_num_threads(1)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "leantrain", "crash_child"])
    reference = crash_child.straight()
    # how long an uninterrupted child takes, start-up included
    start = time.perf_counter()
    p = ctx.Process(target=crash_child.train_and_checkpoint, args=(str(tmp_path / "timing.ckpt"),))
    p.start()
    p.join()
    duration = time.perf_counter() - start
    assert p.exitcode == 0
    rng = random.Random(20261129)
    resumed = leftovers = 0
    for trial in range(TRIALS):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        path = folder / "run.ckpt"
        p = ctx.Process(target=crash_child.train_and_checkpoint, args=(str(path),))
        p.start()
        time.sleep(rng.uniform(0.1, 1.0) * duration)
        p.kill()
        p.join()
        leftovers += sum(1 for f in folder.iterdir() if f.name != "run.ckpt")
        if not path.exists():
            continue  # killed before the first checkpoint was complete: nothing to verify
        read_checkpoint(path)  # complete and intact: every checksum verifies
        values = crash_child.resume(str(path))
        for a, b in zip(values, reference):
            assert torch.equal(a, b), f"trial {trial}: the resumed run differs"
        assert [f.name for f in folder.iterdir()] == ["run.ckpt"], "stale temporaries were not cleaned up"
        resumed += 1
    print(f"{TRIALS} kills: {resumed} resumed exactly, {leftovers} temporaries left by killed writers")
    assert resumed >= TRIALS // 2
