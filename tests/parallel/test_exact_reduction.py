"""exact_reduction=True: 1, 2 and 3 processes (gloo) give the same bits: parameters,
optimizer state, BatchNorm buffers and logged losses, with a tie and an odd item count
(batches of 3 over 7 items: ranks get 2/1, 1/1/1 and sometimes nothing)."""

import json

import pytest
import torch
from safetensors import safe_open

import spawning
import dist_cases as dc
import leantrain as lt

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def contents(path):
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(("storage.", "state."))}
        manifest = json.loads(lt.io.checkfile.unseal(f.metadata()["leantrain"]))
    return tensors, manifest["progress"]["losses"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exact")
    torch.set_num_threads(1)
    for world in (2, 3):
        plan = [(c, f"w{world}", False, False) for c in dc.EXACT_CASES]
        spawning.spawn(dc.worker, (world, str(tmp / f"init-{world}"), str(tmp), plan), world)
    for case in dc.EXACT_CASES:
        dc.run(case, tmp, "w1")
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("case", dc.EXACT_CASES)
@pytest.mark.parametrize("world", [2, 3])
def test_any_world_size_gives_the_one_process_bits(runs, case, world):
    one, one_losses = contents(runs / f"{case}.w1")
    many, many_losses = contents(runs / f"{case}.w{world}")
    assert sorted(one) == sorted(many)
    for k in one:
        assert torch.equal(one[k].reshape(-1).view(torch.uint8), many[k].reshape(-1).view(torch.uint8)), k
    assert one_losses == many_losses and len(one_losses) > 3


def test_exact_reduction_needs_exact_accumulation():
    with pytest.raises(lt.ConfigError, match="exact_reduction folds items one by one"):
        lt.TrainConfig(steps=1, exact_reduction=True, accumulation="vectorized")


def test_resume_auto_starts_fresh_then_continues_exactly(tmp_path):
    """resume_from='auto': no checkpoint yet -> a fresh run; one there -> resumed."""
    runner, cfg, go = dc.make("samples-sgd-f64")
    straight = dc.make("samples-sgd-f64")
    straight[2](straight[1])
    from dataclasses import replace

    path = tmp_path / "run.ckpt"
    auto = replace(cfg, checkpoint_path=path, resume_from="auto")
    go(auto, lambda ev: ev.step == dc.STOP)  # a first attempt that stops (as a killed job would)
    again, _, go2 = dc.make("samples-sgd-f64")
    report = go2(auto)  # the restarted job: picks the run up
    assert report.steps == cfg.steps
    for a, b in zip(again.params.values(), straight[0].params.values()):
        assert torch.equal(a, b)
    with pytest.raises(lt.ConfigError, match="resume_from='auto' resumes from checkpoint_path"):
        lt.TrainConfig(steps=1, resume_from="auto")


def test_the_command_resume_auto(tmp_path, capsys):
    from leantrain.cli import main

    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--out", str(out), "--resume", "auto"]) == 0  # fresh
    assert "resuming" not in capsys.readouterr().out
    assert main(["train", "--epochs", "2", "--out", str(out), "--resume", "auto"]) == 0  # continues
    assert "resuming at step 45" in capsys.readouterr().out


def test_a_failed_collective_names_the_rank_the_step_and_the_last_checkpoint(tmp_path, monkeypatch):
    from leantrain.training.parallel import distributed
    from leantrain.training.parallel.data_parallel import DataParallelStrategy
    from leantrain.training.loops import session
    from leantrain.training.parallel.strategy import Strategy

    runner, cfg, go = dc.make("samples-sgd-f64")
    from dataclasses import replace

    cfg = replace(cfg, checkpoint_path=tmp_path / "run.ckpt", checkpoint_every=2, log_every=0)
    real = session.update

    class RankOneOfTwo(Strategy):  # one process's updates, failures reported as data parallel's
        failed = DataParallelStrategy.failed

    def flaky(op, runner, opt, state, *rest):
        if state.steps == 5:  # the sixth update: its all-reduce fails, as when a peer dies
            monkeypatch.setattr(distributed, "rank_world", lambda: (1, 2))
            raise torch.distributed.DistBackendError("Connection closed by peer")  # what a backend raises
        return real(op, runner, opt, state, *rest)

    monkeypatch.setattr(session, "choose", lambda cfg, local=False: RankOneOfTwo())
    monkeypatch.setattr(session, "update", flaky)
    with pytest.raises(distributed.CollectiveError,
                       match=r"rank 1 of 2, update 6: a collective operation failed \(Connection closed by peer\); "
                             r"last good checkpoint: .*run.ckpt \(step 4\)"):
        go(cfg)


def test_resume_auto_restarts_only_its_own_partial_start(tmp_path, capsys):
    """A job killed before its first checkpoint leaves config.json and metrics: the same
    command starts it again. Another run's files (other settings, or a finished run's
    report) are refused, as without --resume auto."""
    from leantrain.cli import main

    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--out", str(out)]) == 0
    (out / "checkpoint.ckpt").unlink()  # a finished run whose checkpoint is gone
    kept = {name: (out / name).read_bytes() for name in ("config.json", "metrics.jsonl", "report.json")}
    assert main(["train", "--epochs", "1", "--out", str(out), "--resume", "auto"]) == 2
    assert "holds an earlier run" in capsys.readouterr().err
    (out / "report.json").unlink()
    assert main(["train", "--epochs", "2", "--out", str(out), "--resume", "auto"]) == 2  # other settings
    assert all((out / n).read_bytes() == b for n, b in kept.items() if n != "report.json")
    assert main(["train", "--epochs", "1", "--out", str(out), "--resume", "auto"]) == 0  # its own start
    assert (out / "checkpoint.ckpt").is_file()
