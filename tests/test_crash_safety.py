"""SIGKILL a checkpointing run at explicit points, between steps and inside each stage
of a checkpoint write: the newest complete checkpoint always verifies, holds the step it
should, and resuming from it reproduces the uninterrupted run exactly (parameters,
BatchNorm buffers and logged losses). Every trial must resume."""


import pytest
import torch

import spawning
import crash_child
from leantrain.io.checkpoint import read_checkpoint

KILL_STEPS = (1, 2, 7, crash_child.STEPS)


@pytest.fixture(scope="module")
def ctx():
    return spawning.context()  # the forkserver the distributed tests share, these modules loaded


@pytest.fixture(scope="module")
def reference():
    return crash_child.straight()


@pytest.mark.slow
@pytest.mark.parametrize("stage", crash_child.STAGES)
@pytest.mark.parametrize("kill_step", KILL_STEPS)
def test_sigkill_at_a_point_resumes_exactly(tmp_path, ctx, reference, kill_step, stage):
    path = tmp_path / "run.ckpt"
    p = ctx.Process(target=crash_child.train_and_checkpoint, args=(str(path), kill_step, stage))
    p.start()
    p.join()
    assert p.exitcode == -9, "the child was to die at its injection point"
    # the checkpoint of step k exists only once its rename happened
    expected = kill_step if stage == "after-rename" else kill_step - 1
    if expected == 0:
        assert not path.exists()
        return
    manifest, _ = read_checkpoint(path)  # complete and intact: every checksum verifies
    assert manifest["progress"]["step"] == expected
    values, losses = crash_child.resume(str(path))
    ref_values, ref_losses = reference
    for a, b in zip(values, ref_values):
        assert torch.equal(a, b), "the resumed run differs"
    assert losses == ref_losses
    if expected < crash_child.STEPS:  # the resumed run saved: that removed the killed writer's scratch
        assert [f.name for f in tmp_path.iterdir()] == ["run.ckpt"]
