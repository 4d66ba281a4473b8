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
    # after: the first batch of a measuring pass (measure_batches=1), read with the best parameters back
    assert report.after == pytest.approx(lt.evaluate(r, batches(5, 1)[:1])["loss"], rel=1e-6)


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


# ------------------------------------------------------------------ another run's files
def _bytes_of(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


def test_a_resume_into_another_runs_folder_deletes_none_of_its_files(tmp_path):
    """Resuming a's checkpoint (kept record: a's files) into b/, where another run keeps
    its own step files, used to delete b's files at the first save. Now the start is
    refused, naming the other run's files, and nothing in either folder changes."""
    data = batches(5, 1)
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"),
                    config(tmp_path / "a", keep_last=2, checkpoint_every=1, eval_data=None, epochs=1), data)
    lt.train_loader(lt.Runner.from_module(net(1), "cross_entropy"),
                    config(tmp_path / "b", checkpoint_every=2, eval_data=None, epochs=1), data)
    a, b = _bytes_of(tmp_path / "a" / "ck"), _bytes_of(tmp_path / "b" / "ck")
    assert sorted(b) == ["step2.ckpt", "step4.ckpt", "step5.ckpt"]
    cfg = config(tmp_path / "b", keep_last=1, checkpoint_every=1, eval_data=None,
                 resume_from=tmp_path / "a" / "ck" / "step5.ckpt")
    with pytest.raises(lt.CheckpointError, match=r"holds checkpoints of another run \(step2.ckpt \(run "):
        lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), cfg, data)
    assert _bytes_of(tmp_path / "a" / "ck") == a and _bytes_of(tmp_path / "b" / "ck") == b


def test_a_record_of_another_folder_is_not_taken_back(tmp_path):
    """A resume into another folder starts its own record: nothing a/ kept is deleted or
    ranked there, not even copies of a's files kept in b/ (the same run's bytes)."""
    import shutil

    data = batches(5, 1)
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"),
                    config(tmp_path / "a", keep_last=2, checkpoint_every=1, eval_data=None, epochs=1), data)
    a = _bytes_of(tmp_path / "a" / "ck")
    shutil.copytree(tmp_path / "a" / "ck", tmp_path / "b" / "ck")  # the user's copies
    cfg = config(tmp_path / "b", keep_last=1, checkpoint_every=1, eval_data=None,
                 resume_from=tmp_path / "a" / "ck" / "step5.ckpt")
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), cfg, data)
    assert _bytes_of(tmp_path / "a" / "ck") == a
    assert names(tmp_path / "b" / "ck") == ["step10.ckpt", "step4.ckpt", "step5.ckpt"]  # the copies stay
    entries = lt.read_checkpoint(tmp_path / "b" / "ck" / "step10.ckpt")[0]["progress"]["checkpoints"]
    assert [e[0] for e in entries] == ["step9.ckpt", "step10.ckpt"]  # b's own (step9 pruned after this save)


def test_a_file_replaced_under_a_kept_name_is_never_pruned(tmp_path):
    """The record names step3.ckpt; another job writes its own file under that name: this
    run's pruning leaves it (its manifest names another run)."""
    other = tmp_path / "other.ckpt"
    lt.save_checkpoint(other, lt.Runner.from_module(net(1), "cross_entropy"))

    class Replace(lt.Callback):
        def on_step(self, event):
            if event.step == 4:
                os.replace(other, tmp_path / "ck" / "step3.ckpt")

    r = lt.Runner.from_module(net(), "cross_entropy")
    lt.train_loader(r, config(tmp_path, keep_last=1, checkpoint_every=1, eval_data=None), batches(5, 1),
                    callbacks=[Replace()])
    assert names(tmp_path / "ck") == ["step10.ckpt", "step3.ckpt"]  # the other job's file stays


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_a_best_that_is_no_longer_this_runs_is_an_error_not_a_silent_load(tmp_path, how):
    """Another job in the folder writes (or prunes) the file named as this run's best: the
    next save says so, before training goes on to its end, and the model never gets the
    other job's parameters."""
    other = lt.Runner.from_module(net(1), "cross_entropy")

    class SecondJob(lt.Callback):
        def on_step(self, event):
            if event.step == 5:
                for p in (tmp_path / "ck").glob("step*.ckpt"):
                    if how == "replaced":
                        lt.save_checkpoint(p, other)
                    else:
                        p.unlink()

    r = lt.Runner.from_module(net(), "cross_entropy")
    cfg = config(tmp_path, keep_best=1, load_best_at_end=True)
    with pytest.raises(lt.CheckpointError, match="the best checkpoint kept: .*(is not the file this run wrote|is gone)"):
        lt.train_loader(r, cfg, batches(5, 1), callbacks=[SecondJob()])
    mine, theirs = list(r.module.parameters()), list(other.module.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_a_second_run_writing_the_same_folder_is_refused_at_its_start_naming_both(tmp_path):
    """Two jobs in one folder, without threads: the second starts from the first one's
    callback. It is refused before it reads or writes anything there; the first finishes,
    and the folder is free again after it."""
    data = batches(5, 1)
    caught = []

    class StartAnother(lt.Callback):
        def on_step(self, event):
            if event.step == 2:
                second = lt.Runner.from_module(net(1), "cross_entropy")
                before = _bytes_of(tmp_path / "ck")
                with pytest.raises(lt.CheckpointError) as e:
                    lt.train_loader(second, config(tmp_path, keep_last=2, checkpoint_every=1, eval_data=None), data)
                caught.append(str(e.value))
                assert _bytes_of(tmp_path / "ck") == before

    first = config(tmp_path, keep_last=2, checkpoint_every=1, eval_data=None)
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), first, data, callbacks=[StartAnother()])
    assert len(caught) == 1
    assert f"another run writes the checkpoints of {tmp_path / 'ck'}: run " in caught[0]
    assert f"process {os.getpid()}" in caught[0] and "; this run is " in caught[0]
    assert not (tmp_path / "ck" / ".leantrain-run.json").exists()  # given back at the end
    again = config(tmp_path, keep_last=2, checkpoint_every=1, eval_data=None, resume_from="auto", epochs=3)
    report, _ = lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), again, data)
    assert report.resumed_from == str(tmp_path / "ck" / "step10.ckpt") and report.steps == 15


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    import json
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "ck").mkdir()
    lock = tmp_path / "ck" / ".leantrain-run.json"
    lock.write_text(json.dumps({"run": "x", "pid": int(dead.stdout), "host": __import__("socket").gethostname()}))
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"),
                    config(tmp_path, keep_last=1, checkpoint_every=1, eval_data=None), batches(5, 1))
    assert names(tmp_path / "ck") == ["step10.ckpt"] and not lock.exists()


@pytest.mark.parametrize("spec", ["{step:+}", "{step:x}", "{step:4d}", "{step:.1e}", "{step:,}", "{step:s}",
                                  "{step:b}", "{step:_}", "{step}{epoch}"])
def test_a_step_format_the_folder_cannot_read_back_is_refused_when_the_config_is_built(tmp_path, spec):
    with pytest.raises(lt.ConfigError, match="does not (read back|format)"):
        config(tmp_path, keep_last=1, checkpoint_path=tmp_path / "ck" / f"s{spec}.ckpt")


@pytest.mark.parametrize("spec", ["{step}", "{step:06d}", "{step:d}", "{step}-{epoch}", "{step:03d}-{metric:.3f}"])
def test_step_formats_that_read_back_are_taken(tmp_path, spec):
    config(tmp_path, keep_last=1, checkpoint_path=tmp_path / "ck" / f"s{spec}.ckpt")


def test_a_killed_saves_scratch_folder_is_removed_when_the_next_run_starts(tmp_path):
    """A save killed after its rename leaves its scratch folder; the kept files each have
    their own name, so no later save of that file cleans it: the next run's start does
    (only folders named as leantrain's scratch whose writer is gone)."""
    import subprocess
    import sys

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    r = lt.Runner.from_module(net(), "cross_entropy")
    lt.train_loader(r, config(tmp_path, keep_last=1, checkpoint_every=1, eval_data=None, epochs=1), batches(5, 1))
    leaked = tmp_path / "ck" / f".leantrain-tmp-{'0' * 16}-{dead}-123"
    live = tmp_path / "ck" / f".leantrain-tmp-{'0' * 16}-{os.getpid()}-456"
    mine = tmp_path / "ck" / ".leantrain-tmp-notes"
    for p in (leaked, live, mine):
        p.mkdir()
    again = config(tmp_path, keep_last=1, checkpoint_every=1, eval_data=None, resume_from="auto")
    lt.train_loader(lt.Runner.from_module(net(), "cross_entropy"), again, batches(5, 1))
    assert not leaked.exists() and live.exists() and mine.exists()


def test_load_best_at_end_with_a_monitor_never_finite_says_the_model_keeps_its_final_weights(tmp_path):
    import warnings

    never = {"nanm": lambda out, target: torch.full((1,), float("nan"))}
    cfg = config(tmp_path, keep_best=1, load_best_at_end=True, monitor="nanm", eval_metrics=never)
    r = lt.Runner.from_module(net(), "cross_entropy")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        report, _ = lt.train_loader(r, cfg, batches(5, 1))
    assert report.best_checkpoint is None
    assert any("no evaluation gave a finite 'nanm'" in str(w.message) for w in said)
