"""Sharded checkpoint folders: what survives a crash at each point of a save (SIGKILL at
explicit injection points), the generations a folder holds, and hostile folders (a
truncated, missing or corrupted shard, pieces that overlap or leave a gap, a wrong world
size, a stray file) refused with nothing installed; ``export --consolidate``."""

import json
from dataclasses import replace

import pytest
import torch

import leantrain as lt
from leantrain.cli.main import main as cli_main
from leantrain.io import checkfile, sharded
import spawning
import shard_cases as sc
import shard_crash_child as child
from optimizer_table import TABLE


@pytest.fixture(scope="module")
def ctx():
    return spawning.context()  # the forkserver the distributed tests share, these modules loaded


@pytest.fixture(scope="module")
def reference():
    return child.straight()


@pytest.mark.slow
@pytest.mark.parametrize("stage", child.STAGES)
@pytest.mark.parametrize("kill_step", [2, 4])
def test_a_crash_inside_a_sharded_save_leaves_a_checkpoint_that_resumes_exactly(tmp_path, ctx, reference,
                                                                               kill_step, stage):
    path = tmp_path / "run"
    p = ctx.Process(target=child.train_and_checkpoint, args=(str(path), kill_step, stage))
    p.start()
    p.join()
    assert p.exitcode == -9, "the child was to die at its injection point"
    expected = kill_step if stage == "before-cleanup" else kill_step - 1  # the index decides
    manifest, _ = lt.read_checkpoint(path)
    assert manifest["progress"]["step"] == expected
    values, losses = child.resume(str(path))
    ref_values, ref_losses = reference
    assert all(torch.equal(a, b) for a, b in zip(values, ref_values)), "the resumed run differs"
    assert losses == ref_losses
    index = sharded.read_index(path, "test")
    assert sorted(f.name for f in path.iterdir()) == sorted([f["name"] for f in index["files"]] + ["index.json"])


def _run(tmp_path, steps=3):
    torch.manual_seed(1)
    runner = lt.Runner.from_module(sc.Wide(), "mse")
    cfg = lt.TrainConfig(steps=steps, batch_size=3, sharding="optimizer", optimizer=TABLE["adamw"].make(),
                         checkpoint_path=tmp_path / "ck")
    lt.train_samples(runner, cfg, sc.wide_data(), log=None)
    return tmp_path / "ck", cfg


def _fresh():
    torch.manual_seed(5)
    return lt.Runner.from_module(sc.Wide(), "mse")


def _bytes(runner):
    return [v.storage.host.clone() for v in runner.params]


def _edit_index(folder, change):
    index = sharded.read_index(folder, "test")
    change(index)
    (folder / "index.json").write_text(checkfile.seal(json.dumps(index, sort_keys=True)))


def _shard(folder):
    return folder / sharded.read_index(folder, "test")["files"][0]["name"]


def _flip(folder):
    p = _shard(folder)
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x10
    p.write_bytes(bytes(data))


def _truncate(folder):
    p = _shard(folder)
    p.write_bytes(p.read_bytes()[:-100])


def _overlap(index):
    name = next(n for n, parts in index["pieces"].items() if len(parts) >= 1 and parts[0]["stop"] > 64)
    index["pieces"][name][0]["start"] = 64


def _gap(index):
    name = next(iter(index["pieces"]))
    index["pieces"][name] = index["pieces"][name][:-1] if len(index["pieces"][name]) > 1 else []


HOSTILE = {
    "truncated shard": (_truncate, "is .* bytes, the index says"),
    "missing shard": (lambda f: _shard(f).unlink(), "missing file"),
    "flipped bits": (_flip, "fails its checksum"),
    "overlapping ranges": (lambda f: _edit_index(f, _overlap), "gap or overlap|missing or of the wrong size"),
    "missing ranges": (lambda f: _edit_index(f, _gap), "cover 0 of its|cover .* of its"),
    "wrong world size": (lambda f: _edit_index(f, lambda i: i.update(world=2)), "not one per rank of its world size"),
    "stray file": (lambda f: (f / "notes.txt").write_text("x"), "stray file 'notes.txt'"),
    "no index": (lambda f: (f / "index.json").unlink(), "without index.json"),
    "corrupt index": (lambda f: (f / "index.json").write_text("0 {}"), "index fails its checksum"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_folder_is_refused_with_nothing_installed(tmp_path, case):
    folder, _ = _run(tmp_path)
    damage, message = HOSTILE[case]
    damage(folder)
    runner = _fresh()
    before = _bytes(runner)
    with pytest.raises(lt.CheckpointError, match=message):
        lt.io.loading.load_checkpoint(folder, runner, optimizer=TABLE["adamw"].make())
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(runner)))


def test_a_folder_keeps_one_generation_and_reads_as_its_index_says(tmp_path):
    folder, cfg = _run(tmp_path)
    first = sharded.read_index(folder, "test")
    lt.train_samples(_fresh(), replace(cfg, steps=5, resume_from=folder), sc.wide_data(), log=None)
    second = sharded.read_index(folder, "test")
    assert first["generation"] != second["generation"]
    assert sorted(p.name for p in folder.iterdir()) == sorted([f["name"] for f in second["files"]] + ["index.json"])
    assert lt.read_checkpoint(folder)[0]["progress"]["step"] == 5


def test_consolidate_writes_the_one_file_an_unsharded_run_resumes(tmp_path, capsys):
    folder, cfg = _run(tmp_path)
    assert cli_main(["export", str(folder), "--consolidate", "-o", str(tmp_path / "one.ckpt")]) == 0
    a, b = lt.read_checkpoint(folder), lt.read_checkpoint(tmp_path / "one.ckpt")
    assert sorted(a[1]) == sorted(b[1]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert a[0]["progress"] == b[0]["progress"]
    resumed = _fresh()
    lt.train_samples(resumed, replace(cfg, steps=5, sharding=None, resume_from=tmp_path / "one.ckpt",
                                      checkpoint_path=None), sc.wide_data(), log=None)
    torch.manual_seed(1)
    straight = lt.Runner.from_module(sc.Wide(), "mse")
    lt.train_samples(straight, replace(cfg, steps=5, sharding=None, checkpoint_path=None), sc.wide_data(), log=None)
    assert all(torch.equal(x, y) for x, y in zip(resumed.params.values(), straight.params.values()))
    assert cli_main(["inspect", str(folder)]) == 0
    assert "sharded over 1 rank(s)" in capsys.readouterr().out


def test_a_sharded_run_refuses_a_file_as_its_checkpoint_path(tmp_path):
    (tmp_path / "file.ckpt").write_text("x")
    cfg = lt.TrainConfig(steps=1, sharding="optimizer", checkpoint_path=tmp_path / "file.ckpt")
    with pytest.raises(lt.CheckpointError, match="is a file; a sharded run saves a folder"):
        lt.train_samples(_fresh(), cfg, sc.wide_data(), log=None)
