"""Atomic writes touch only what they made: scratch folders are recognised by their exact
name (never a glob of the user's file name), live writers' scratch survives, long legal
names save, and a full disk is a CheckpointError with the old file intact."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import leantrain as lt
from leantrain.io.atomic import atomic_write_bytes, remove_stale_temporaries, scratch_key


def params():
    return lt.ParamList.of_pack([torch.ones(3)])


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def scratch(folder, name, pid):
    d = folder / f".leantrain-tmp-{scratch_key(folder / name)}-{pid}-123"
    d.mkdir()
    (d / name).write_bytes(b"half")
    return d


@pytest.mark.parametrize("name", ["*.ckpt", "[x].ckpt", "?.ckpt", "a*b.ckpt"])
def test_a_glob_like_name_removes_only_its_own_stale_scratch(tmp_path, name):
    others = [scratch(tmp_path, "x.ckpt", dead_pid()), scratch(tmp_path, "other.ckpt", dead_pid())]
    mine_stale = scratch(tmp_path, name, dead_pid())
    mine_live = scratch(tmp_path, name, os.getppid())  # another live writer of the same file
    user = [tmp_path / ".run.ckpt.tmp-notes", tmp_path / f".{name}.tmp-1-2"]
    for u in user:
        u.write_text("the user's")
    lt.save_checkpoint(tmp_path / name, params(), rng=False)
    assert all(d.is_dir() for d in others) and mine_live.is_dir()
    assert not mine_stale.exists()
    assert all(u.read_text() == "the user's" for u in user)
    lt.load_checkpoint(tmp_path / name, params())


def test_only_folders_with_the_exact_scratch_name_are_removed(tmp_path):
    target = tmp_path / "run.ckpt"
    key = scratch_key(target)
    lookalikes = [f".leantrain-tmp-{key}-{dead_pid()}-1x", f".leantrain-tmp-{key}-{dead_pid()}",
                  f"x.leantrain-tmp-{key}-{dead_pid()}-1", f".leantrain-tmp-{key.upper()}-{dead_pid()}-1"]
    for n in lookalikes:
        (tmp_path / n).mkdir()
    as_file = tmp_path / f".leantrain-tmp-{key}-{dead_pid()}-7"
    as_file.write_text("a file, not our folder")
    stale = scratch(tmp_path, "run.ckpt", dead_pid())
    assert remove_stale_temporaries(target) == [stale]
    assert all((tmp_path / n).is_dir() for n in lookalikes) and as_file.is_file()


@pytest.mark.parametrize("length", [200, 245, 255])
def test_long_legal_names_save_and_load(tmp_path, length):
    name = "w" * (length - 5) + ".ckpt"
    assert len(name.encode()) == length
    lt.save_checkpoint(tmp_path / name, params(), rng=False)
    lt.load_checkpoint(tmp_path / name, params())
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no scratch left behind


def test_a_non_ascii_name(tmp_path):
    name = "poids-é-权重.ckpt"
    lt.save_checkpoint(tmp_path / name, params(), rng=False)
    assert [p.name for p in tmp_path.iterdir()] == [name]


CHILD = textwrap.dedent("""
    import resource, signal, sys
    import torch
    import leantrain as lt
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG
    path, limit = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        lt.{call}
    except lt.LeantrainError as e:
        print(type(e).__name__, "|", e)
        sys.exit(3)
    """)


@pytest.mark.parametrize("call", [
    "save_checkpoint(path, lt.ParamList.of_pack([torch.ones(100_000)]), rng=False)",
    "weights.save_weights(path, lt.ParamList([lt.Param(torch.ones(100_000), name='w')]))",
])
def test_a_full_disk_is_a_checkpoint_error_and_keeps_the_old_file(tmp_path, call):
    path = tmp_path / "big.ckpt"
    lt.save_checkpoint(path, params(), rng=False)
    old = path.read_bytes()
    code = CHILD.replace("{call}", call)
    r = subprocess.run([sys.executable, "-c", code, str(path), "65536"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert r.stdout.startswith("CheckpointError | ") and str(path) in r.stdout
    assert "could not be written" in r.stdout and "large" in r.stdout.lower()  # the OS's reason (EFBIG)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["big.ckpt"]


def test_a_write_into_a_missing_or_blocked_folder(tmp_path):
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(lt.CheckpointError, match="could not be written"):
        atomic_write_bytes(tmp_path / "afile" / "x.bin", b"data")
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("dest, match", [("", "expected a file path"), (None, "expected a file path"),
                                         (".", "is a folder"), ("DIR", "is a folder")])
def test_save_checkpoint_to_no_file(tmp_path, monkeypatch, dest, match):
    monkeypatch.chdir(tmp_path)
    target = tmp_path if dest == "DIR" else dest
    with pytest.raises(lt.CheckpointError, match=match):
        lt.save_checkpoint(target, params(), rng=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("progress", [{"when": object()}, {"t": torch.ones(1)}, {1j: 2}, ["step", 1]])
def test_progress_that_is_not_json_data(tmp_path, progress):
    with pytest.raises(lt.CheckpointError, match="progress must be"):
        lt.save_checkpoint(tmp_path / "p.ckpt", params(), progress=progress, rng=False)
    assert list(tmp_path.iterdir()) == []
