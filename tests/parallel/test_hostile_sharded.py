"""The third hostile round on sharded checkpoint folders (#39): an index naming files
outside its folder, malformed indexes, two writers saving into one folder at once, a
killed writer's leftovers, a folder of the user's own files, and unfreezing under
sharding. Each case asserts the typed error (or the one-line exit 2 of the command) and
that parameters, optimizer state and files are unchanged."""

import json
import os
import time

import pytest
import torch

import leantrain as lt
from leantrain.cli.main import main as cli_main
from leantrain.io import checkfile, sharded
import shard_cases as sc
from test_sharded_files import _bytes, _edit_index, _fresh, _run


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _refused(folder, needle, capsys):
    """load_checkpoint, inspect and export --consolidate all refuse the folder, and
    nothing is installed or written."""
    runner = _fresh()
    before, files = _bytes(runner), _files(folder)
    with pytest.raises(lt.CheckpointError, match=needle):
        lt.load_checkpoint(folder, runner)
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(runner)))
    for args in (["inspect", str(folder)], ["export", str(folder), "--consolidate", "-o", str(folder.parent / "c")]):
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (folder.parent / "c").exists() and _files(folder) == files


# ------------------------------------------------------------ files it names
@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/hostname", "sub/x.safetensors", ""])
def test_an_index_naming_a_file_outside_its_folder_is_refused_before_anything_is_read(tmp_path, capsys, name):
    folder, _ = _run(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes((folder / _first_shard(folder)).read_bytes())

    def point_out(index):
        index["files"][0]["name"] = name
    _edit_index(folder, point_out)
    _refused(folder, "not the shard name of its rank", capsys)


def _first_shard(folder):
    return sharded.read_index(folder, "test")["files"][0]["name"]


@pytest.mark.parametrize("edit, needle", [
    (lambda i: i.update(world=10**8), r"world: expected an integer in \[1, 99999\]"),
    (lambda i: i.update(world="1"), "world: expected an integer"),
    (lambda i: i.update(generation="../g"), "generation: expected a generation name"),
    (lambda i: i.update(files={"0": 1}), "not one per rank"),
    (lambda i: i["files"][0].update(bytes="27468"), "not one per rank"),
    (lambda i: i["files"][0].update(rank=True), "not one per rank"),
    (lambda i: i.update(pieces=[1]), "pieces: expected"),
    (lambda i: [p.update(start="0") for parts in i["pieces"].values() for p in parts], "pieces: expected"),
    (lambda i: [p.update(file="../x") for parts in i["pieces"].values() for p in parts], "pieces: expected"),
    (lambda i: i.update(manifest=7), "manifest: expected"),
])
def test_malformed_index_fields_are_refused_fast_and_typed(tmp_path, capsys, edit, needle):
    folder, _ = _run(tmp_path)
    _edit_index(folder, edit)
    started = time.perf_counter()
    _refused(folder, needle, capsys)
    assert time.perf_counter() - started < 30  # a world of 10**8 is not walked (it took 5 s per read)


def test_an_index_nested_too_deep_is_refused_as_corrupt(tmp_path, capsys):
    folder, _ = _run(tmp_path)
    (folder / "index.json").write_text(checkfile.seal("[" * 100000 + "]" * 100000))
    _refused(folder, "not valid JSON|not a leantrain", capsys)


def test_a_shape_the_pieces_do_not_cover_is_refused_before_any_allocation(tmp_path, monkeypatch):
    folder, _ = _run(tmp_path)
    index = sharded.read_index(folder, "test")
    manifest = json.loads(checkfile.unseal(index["manifest"]))
    slot = next(s for s in manifest["slots"] if s["requires_grad"])
    slot["shape"] = [2**20, 2**21]  # 8 TiB of float32 if allocated before comparing
    index["manifest"] = checkfile.seal(json.dumps(manifest, sort_keys=True))
    (folder / "index.json").write_text(checkfile.seal(json.dumps(index, sort_keys=True)))
    real_empty = torch.empty

    def small_only(*size, **kw):
        n = 1
        for d in (size[0] if size and isinstance(size[0], (tuple, list)) else size):
            n *= int(d)
        assert n < 2**31, "allocated for a shape before checking it"
        return real_empty(*size, **kw)
    monkeypatch.setattr(torch, "empty", small_only)
    with pytest.raises(lt.CheckpointError):
        lt.read_checkpoint(folder)


def test_a_symlinked_index_or_shard_is_refused(tmp_path, capsys):
    folder, _ = _run(tmp_path)
    shard = folder / _first_shard(folder)
    (tmp_path / "real.safetensors").write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(tmp_path / "real.safetensors")
    _refused(folder, "symbolic link", capsys)


# --------------------------------------------------------- writers and crashes
def _writer(folder, generation, manifest, tensors):
    """A save of ``tensors`` (all whole) as generation ``generation``, in two halves: the
    shard (returned entry), then the index."""
    entry = sharded.write_shard(folder, generation, 0, 1, tensors, {})
    return lambda: sharded.write_index(folder, manifest, 1, generation, [entry])


def _contents(folder):
    manifest, tensors, _ = sharded.read_folder(folder, "test")
    manifest = dict(manifest, checksums={n: checkfile.checksum(t) for n, t in tensors.items()})
    return manifest, tensors


@pytest.mark.parametrize("order", ["A shard, B shard, A index, B index", "A shard, B saves, A index"])
def test_two_writers_saving_into_one_folder_leave_a_folder_that_loads(tmp_path, order):
    folder, _ = _run(tmp_path)
    manifest, tensors = _contents(folder)
    with sharded.generation_marked(folder, "g00000010-aaaaaaaa"):
        finish_a = _writer(folder, "g00000010-aaaaaaaa", manifest, tensors)
        with sharded.generation_marked(folder, "g00000011-bbbbbbbb"):
            finish_b = _writer(folder, "g00000011-bbbbbbbb", manifest, tensors)
            if order.startswith("A shard, B shard"):
                finish_a()  # the old clean-up deleted B's shard here: B's index then named a deleted file
            finish_b()
        if order == "A shard, B saves, A index":
            finish_a()
    lt.load_checkpoint(folder, _fresh())  # whatever index won names files that exist
    winner = sharded.read_index(folder, "test")
    assert (folder / winner["files"][0]["name"]).is_file()


def test_a_killed_writers_scratch_and_unindexed_shards_go_at_the_next_save_and_a_live_ones_stay(tmp_path):
    folder, cfg = _run(tmp_path)
    dead = 2**22 + 12345  # no such process (above the default pid_max)
    scratch = folder / f".leantrain-tmp-{'0' * 16}-{dead}-1"
    scratch.mkdir()
    (scratch / "x.safetensors").write_bytes(b"0" * 1000)
    orphan = sharded.shard_name("g00000002-deadbeef", 0, 1)
    (folder / orphan).write_bytes(b"half a save")  # a shard whose index was never written
    (folder / f".leantrain-gen-g00000002-deadbeef-{dead}").touch()
    live = sharded.shard_name("g00000003-0123abcd", 0, 1)
    (folder / live).write_bytes(b"a concurrent writer's")
    (folder / f".leantrain-gen-g00000003-0123abcd-{os.getpid()}").touch()
    lt.train_samples(_fresh(), cfg, sc.wide_data(), log=None)  # saves into the folder again
    names = {p.name for p in folder.iterdir()}
    assert scratch.name not in names and orphan not in names and live in names
    lt.load_checkpoint(folder, _fresh())


def test_a_folder_of_the_users_own_files_is_refused_before_training(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    runner = _fresh()
    before = _bytes(runner)
    cfg = lt.TrainConfig(steps=2, batch_size=3, sharding="optimizer", optimizer=lt.optim.adamw(0.01),
                         checkpoint_path=tmp_path / "mine", log_every=0)
    with pytest.raises(lt.CheckpointError, match=r"holds files that are not a sharded checkpoint's \(notes.txt\)"):
        lt.train_samples(runner, cfg, sc.wide_data(), log=None)
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(runner)))
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_a_folder_named_like_an_old_shard_does_not_crash_the_clean_up(tmp_path):
    folder, cfg = _run(tmp_path)
    with pytest.raises(lt.CheckpointError, match="holds files that are not"):
        (folder / sharded.shard_name("g00000001-00000000", 0, 1)).mkdir()
        lt.train_samples(_fresh(), cfg, sc.wide_data(), log=None)


# ---------------------------------------------------------------- unfreezing
def test_an_unfreeze_under_sharding_never_saves_a_checkpoint_that_cannot_load(tmp_path):
    torch.manual_seed(1)
    model = sc.Wide()
    first = next(model.parameters())
    first.requires_grad_(False)

    class Unfreeze(lt.Callback):
        def on_step(self, event):
            if event.step == 2:
                first.requires_grad_(True)

    cfg = lt.TrainConfig(steps=4, batch_size=3, sharding="optimizer", optimizer=lt.optim.adamw(0.01),
                         checkpoint_path=tmp_path / "ck", checkpoint_every=1, log_every=0)
    with pytest.raises(lt.ConfigError, match=r"requires_grad was turned on during a sharded run"):
        lt.train_samples(lt.Runner.from_module(model, "mse"), cfg, sc.wide_data(), log=None, callbacks=[Unfreeze()])
    manifest, _ = lt.read_checkpoint(tmp_path / "ck")
    assert manifest["progress"]["step"] == 1 and manifest["slots"][0]["requires_grad"] is False
    again = sc.Wide()
    next(again.parameters()).requires_grad_(False)
    from dataclasses import replace
    report = lt.train_samples(lt.Runner.from_module(again, "mse"), replace(cfg, resume_from=tmp_path / "ck"),
                              sc.wide_data(), log=None)
    assert report.steps == 4


def test_a_peer_lost_inside_a_save_is_a_collective_error_naming_the_update_and_the_last_checkpoint(tmp_path,
                                                                                                  monkeypatch):
    """A save's collective failing (a peer died while the ranks wrote their shards) goes
    through the strategy's failure path: ``CollectiveError`` with the rank, the update and
    the checkpoint that survives, not gloo's raw error."""
    from dataclasses import replace

    import dist_cases as dc
    from leantrain.training.loops import session
    from leantrain.training.parallel import distributed
    from leantrain.training.parallel.data_parallel import DataParallelStrategy
    from leantrain.training.parallel.strategy import Strategy

    runner, cfg, go = dc.make("samples-sgd-f64")
    cfg = replace(cfg, checkpoint_path=tmp_path / "run.ckpt", checkpoint_every=2, log_every=0)

    class RankOneOfTwo(Strategy):  # one process's updates, failures reported as data parallel's
        failed = DataParallelStrategy.failed

        def save(self, path, runner, state, progress, loader_state, ema, identity=None):
            if progress["step"] == 4:
                monkeypatch.setattr(distributed, "rank_world", lambda: (1, 2))
                raise torch.distributed.DistBackendError("Connection closed by peer")  # what gloo raises
            super().save(path, runner, state, progress, loader_state, ema, identity)

    monkeypatch.setattr(session, "choose", lambda cfg, local=False: RankOneOfTwo())
    with pytest.raises(distributed.CollectiveError,
                       match=r"rank 1 of 2, saving the checkpoint of update 4: a collective operation failed "
                             r"\(Connection closed by peer\); last good checkpoint: .*run.ckpt \(step 2\)"):
        go(cfg)
    assert lt.read_checkpoint(tmp_path / "run.ckpt")[0]["progress"]["step"] == 2
