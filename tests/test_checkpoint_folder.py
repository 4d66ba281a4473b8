"""A folder of checkpoints: each save a new file named by the template, the last K and
the best K by a metric kept, pruned only after the new file reads back whole, the record
of kept files resumed, ``load_best_at_end``, and ``resume_from="auto"`` taking the newest
whole file; a SIGKILL at each point of a save leaves a folder that resumes exactly."""

import multiprocessing as mp
import os

import pytest
import torch

import folder_child
import leantrain as lt
from models import class_batches, tiny_classifier
from leantrain import optim


def names(folder):
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


net, batches = tiny_classifier, class_batches


def config(tmp_path, **kw):
    base = dict(epochs=2, optimizer=optim.sgd(0.5), log_every=0, eval_data=batches(2, 9), eval_every=2,
                checkpoint_path=tmp_path / "ck" / "step{step}.ckpt")
    return lt.LoaderTrainConfig(**{**base, **kw})


def test_the_last_k_and_the_best_k_are_kept_and_the_rest_pruned(tmp_path):
    r = lt.Runner.from_module(net(), "cross_entropy")
    report, _ = lt.train_loader(r, config(tmp_path, keep_last=2, keep_best=1, checkpoint_every=1), batches(5, 1))
    losses = {step: res["loss"] for step, res in report.evals}
    best = min(losses, key=lambda s: (losses[s], s))
    assert names(tmp_path / "ck") == sorted({f"step{s}.ckpt" for s in (9, 10, best)})
    assert report.best_checkpoint == str(tmp_path / "ck" / f"step{best}.ckpt")
    for name in names(tmp_path / "ck"):  # every kept file is whole and knows what was kept with it
        progress = lt.read_checkpoint(tmp_path / "ck" / name)[0]["progress"]
        assert name in [e[0] for e in progress["checkpoints"]]


def test_mode_max_keeps_the_highest_and_the_metric_can_name_the_file(tmp_path):
    r = lt.Runner.from_module(net(), "cross_entropy")
    cfg = config(tmp_path, keep_best=2, monitor="accuracy", mode="max", eval_metrics={"accuracy": lt.metrics.accuracy},
                 checkpoint_path=tmp_path / "ck" / "step{step:03d}-acc{metric:.3f}.ckpt")
    report, _ = lt.train_loader(r, cfg, batches(5, 1))
    ranked = sorted(report.evals, key=lambda e: (-e[1]["accuracy"], e[0]))[:2]  # ties: the earlier update
    kept = {f"step{s:03d}-acc{res['accuracy']:.3f}.ckpt" for s, res in ranked + [report.evals[-1]]}
    assert names(tmp_path / "ck") == sorted(kept)  # the best two, and the newest (what a resume needs)


def test_load_best_at_end_puts_the_best_parameters_back(tmp_path):
    r = lt.Runner.from_module(net(), "cross_entropy")
    report, _ = lt.train_loader(r, config(tmp_path, keep_best=1, load_best_at_end=True), batches(5, 1))
    best = lt.Runner.from_module(net(), "cross_entropy")
    lt.load_checkpoint(report.best_checkpoint, best)
    assert all(torch.equal(a, b) for a, b in zip(r.module.parameters(), best.module.parameters()))
    step = int(report.best_checkpoint.rsplit("step", 1)[1].split(".")[0])
    assert lt.evaluate(r, batches(2, 9))["loss"] == dict(report.evals)[step]["loss"]
    assert report.after == pytest.approx(lt.evaluate(r, batches(5, 1))["loss"], rel=1e-6)


def test_without_rules_every_file_stays(tmp_path):
    r = lt.Runner.from_module(net(), "cross_entropy")
    lt.train_loader(r, config(tmp_path, checkpoint_every=3, eval_data=None), batches(5, 1))
    assert names(tmp_path / "ck") == ["step10.ckpt", "step3.ckpt", "step6.ckpt", "step9.ckpt"]


def test_files_this_run_did_not_write_are_never_deleted(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    (tmp_path / "ck" / "step1000.ckpt.bak").write_text("mine too")
    r = lt.Runner.from_module(net(), "cross_entropy")
    lt.train_loader(r, config(tmp_path, keep_last=1, checkpoint_every=1, eval_data=None), batches(5, 1))
    assert names(tmp_path / "ck") == ["notes.txt", "step10.ckpt", "step1000.ckpt.bak"]


def test_resume_auto_takes_the_newest_whole_file_says_which_and_keeps_the_best_so_far(tmp_path):
    data = batches(5, 1)
    straight = lt.Runner.from_module(net(), "cross_entropy")
    ref, _ = lt.train_loader(straight, config(tmp_path / "a", keep_last=1, keep_best=1, checkpoint_every=1), data)

    class Stop(lt.Callback):
        def on_step(self, event):
            return event.step == 7

    first = lt.Runner.from_module(net(), "cross_entropy")
    cfg = config(tmp_path / "b", keep_last=1, keep_best=1, checkpoint_every=1, resume_from="auto")
    lt.train_loader(first, cfg, data, callbacks=[Stop()])
    (tmp_path / "b" / "ck" / "step8.ckpt").write_bytes(b"torn by a crash")  # newer, but not whole
    lines = []
    again = lt.Runner.from_module(net(), "cross_entropy")
    with pytest.warns(UserWarning, match="passes over .*step8.ckpt"):
        report, _ = lt.train_loader(again, cfg, data, log=lines.append)
    assert lines[0] == f"train_loader: resuming from {tmp_path / 'b' / 'ck' / 'step7.ckpt'}"
    assert report.resumed_from == str(tmp_path / "b" / "ck" / "step7.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(again.module.parameters(), straight.module.parameters()))
    assert report.evals == ref.evals
    assert names(tmp_path / "b" / "ck") == names(tmp_path / "a" / "ck")  # the same two files kept
    assert report.best_checkpoint.replace(str(tmp_path / "b"), "") == ref.best_checkpoint.replace(
        str(tmp_path / "a"), "")


@pytest.mark.parametrize("kw, message", [
    (dict(keep_last=2, checkpoint_path="run.ckpt"), r"give checkpoint_path a name with \{step\}"),
    (dict(checkpoint_path="ck/epoch{epoch}.ckpt"), r"takes \{step\} \(required\)"),
    (dict(checkpoint_path="ck/step{step}-{loss}.ckpt"), r"takes \{step\} \(required\)"),
    (dict(checkpoint_path="ck{step}/a{step}.ckpt"), "only the file name may hold fields"),
    (dict(keep_best=1, eval_data=None), "keep_best and load_best_at_end choose by an evaluation"),
    (dict(keep_best=1, monitor="accuracy"), "keep_best monitors 'accuracy'"),
    (dict(load_best_at_end=True), "load_best_at_end loads the best checkpoint kept: set keep_best"),
    (dict(keep_last=0), "keep_last must be an integer >= 1"),
    (dict(mode="lowest"), "mode must be one of"),
    (dict(sharding="optimizer"), "not kept for sharded runs"),
])
def test_folder_options_that_do_not_fit_are_refused_when_the_config_is_built(tmp_path, kw, message):
    base = dict(epochs=1, eval_data=batches(1, 2), checkpoint_path="ck/step{step}.ckpt")
    with pytest.raises(lt.ConfigError, match=message):
        lt.LoaderTrainConfig(**{**base, **kw})


def test_a_malformed_record_of_kept_files_is_refused_before_anything_is_installed(tmp_path):
    from filetools import edit_manifest

    r = lt.Runner.from_module(net(), "cross_entropy")
    cfg = config(tmp_path, keep_last=1, checkpoint_every=1, resume_from="auto")

    class Stop(lt.Callback):
        def on_step(self, event):
            return event.step == 3

    lt.train_loader(r, cfg, batches(5, 1), callbacks=[Stop()])
    path = tmp_path / "ck" / "step3.ckpt"

    def edit(m):
        m["progress"]["checkpoints"] = [["../../etc/passwd", 1, None]]

    path.write_bytes(edit_manifest(path.read_bytes(), edit))
    fresh = lt.Runner.from_module(net(1), "cross_entropy")
    before = [p.detach().clone() for p in fresh.module.parameters()]
    with pytest.raises(lt.CheckpointError, match="progress.checkpoints: expected"):
        lt.train_loader(fresh, cfg, batches(5, 1))
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.module.parameters()))


# ------------------------------------------------------------------ crashes
@pytest.fixture(scope="module")
def ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "leantrain", "folder_child"])
    return ctx


@pytest.mark.parametrize("stage", folder_child.STAGES)
def test_a_sigkill_inside_a_folder_save_leaves_a_folder_that_resumes_exactly(tmp_path, ctx, stage):
    ref_values, ref = folder_child.straight(str(tmp_path / "ref"))
    folder = tmp_path / "run"
    p = ctx.Process(target=folder_child.train_and_die, args=(str(folder), 7, stage))
    p.start()
    p.join()
    assert p.exitcode == -9, "the child was to die at its injection point"
    values, report = folder_child.run(str(folder))  # resume_from="auto": the newest whole file
    expected = 7 if stage in ("before-prune", "mid-prune") else 6
    assert report.resumed_from == str(folder / f"step{expected}.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(values, ref_values))
    assert report.losses == ref.losses and report.evals == ref.evals
    assert names(folder) == names(tmp_path / "ref")  # the same files kept; the dead writer's scratch cleaned
    assert os.path.basename(report.best_checkpoint) == os.path.basename(ref.best_checkpoint)
