"""Bad input to the file operations (``load_checkpoint``, ``read_checkpoint``,
``save_checkpoint``, a resume, TorchLean's formats, state dicts): one table, then files
edited by someone who knows the format (the manifest resealed so its CRC passes, the
header relabelled, strays added), refused by the loader, a resume and ``leantrain
inspect`` alike before anything is installed or any tensor is read, and resumes that do
not fit the run."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import leantrain as lt
from leantrain import ParamList, optim
from leantrain.cli.main import main as run_cli
from leantrain.io import tensorfile
from leantrain.io.checkfile import checksum, seal
from leantrain.torchlean_io import read_torchlean_f32
from leantrain.weights import import_state_dict
from filetools import edit_header, edit_manifest, manifest_of
from inputs_table import check_row, g2, ids, truncated, version_bumped
from models import TiedNet, regression_batches

FILES = [
    ("checkpoint truncated", lambda c: lt.load_checkpoint(truncated(c), c.params), lt.CheckpointError, "not a readable checkpoint"),
    ("checkpoint missing", lambda c: lt.load_checkpoint(c.folder / "none.ckpt", c.params), lt.CheckpointError, "no such checkpoint file"),
    ("checkpoint alias map", lambda c: lt.load_checkpoint(c.ckpt, ParamList([c.params[0], c.params[1], c.params[2], c.params[1]])), lt.CheckpointError, "storage alias map"),
    ("checkpoint other optimizer", lambda c: lt.load_checkpoint(c.ckpt, c.params, optimizer=optim.adamw(0.1)), lt.CheckpointError, "destination uses adamw"),
    ("checkpoint state misfit", lambda c: lt.save_checkpoint(c.ckpt, c.params, state=c.rstate), lt.CheckpointError, "does not fit the 4 slots"),
    ("torchlean version", lambda c: read_torchlean_f32(version_bumped(c), c.params), lt.CheckpointError, "unsupported format version 3; expected 2"),
    ("state dict shape", lambda c: import_state_dict(c.params, {"w": g2, "b": g2, "f": torch.zeros(())}), lt.CheckpointError, r"slot 0 \('w'\): expected \(3,\) float32, got \(2,\)"),
]


@pytest.mark.parametrize("name, call, error, pattern", FILES, ids=ids(FILES))
def test_files_rejects_and_changes_nothing(name, call, error, pattern, tmp_path):
    check_row(call, error, pattern, tmp_path)


def trained(tmp_path, kind="loader"):
    torch.manual_seed(0)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    path = tmp_path / f"{kind}.ckpt"
    data = regression_batches(6, 3)
    if kind == "samples":
        lt.train_samples(r, lt.TrainConfig(steps=3, batch_size=2, log_every=0, optimizer=optim.adam(0.01),
                                           checkpoint_path=path), data)
    else:
        loader = lt.DataLoader(lt.Dataset(data), batch_size=2, shuffle=True, seed=1)
        lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, log_every=0, optimizer=optim.adam(0.01),
                                                checkpoint_path=path), loader)
    return path, data


def deep(n):
    return "[" * n + "]" * n


def with_text(text):
    return lambda m: text


def rec0(m):
    return m["optimizer"]["records"][min(m["optimizer"]["records"], key=int)]


MANIFEST_EDITS = {
    # structure
    "loader is a list": lambda m: m.__setitem__("loader", [1, 2]),
    "progress is a list": lambda m: m.__setitem__("progress", [1]),
    "optimizer is a string": lambda m: m.__setitem__("optimizer", "adam"),
    "records is a list": lambda m: m["optimizer"].__setitem__("records", [1]),
    "record without scalars": lambda m: rec0(m).pop("scalars"),
    "rng is null": lambda m: m.__setitem__("rng", None),
    "rng.torch is a string": lambda m: m["rng"].__setitem__("torch", "yes"),
    "rng.cuda negative": lambda m: m["rng"].__setitem__("cuda", -1),
    "checksum a string": lambda m: m["checksums"].__setitem__("storage.0", "abc"),
    "slot name a number": lambda m: m["slots"][0].__setitem__("name", 7),
    "slot shape negative": lambda m: m["slots"][0].__setitem__("shape", [-1]),
    "slot shape fractional": lambda m: m["slots"][0].__setitem__("shape", [2.5]),
    "slot dtype unknown": lambda m: m["slots"][0].__setitem__("dtype", "float33"),
    "slot storage skips": lambda m: m["slots"][0].__setitem__("storage", 5),
    "slot entry a list": lambda m: m["slots"].__setitem__(0, [1]),
    "alias map short": lambda m: m["representatives"].pop(),
    "alias map points ahead": lambda m: m["representatives"].__setitem__(0, 3),
    "record key not a slot": lambda m: m["optimizer"]["records"].__setitem__("0x", {}),
    "record key huge": lambda m: m["optimizer"]["records"].__setitem__("9" * 40, {}),
    "hyper a string": lambda m: m["optimizer"]["hyper"].__setitem__("beta1", "0.9"),
    "hyper a list": lambda m: m["optimizer"].__setitem__("hyper", [0.9]),
    "version a float": lambda m: m.__setitem__("version", 1.0),
    # ranges
    "steps infinite": lambda m: m["optimizer"].__setitem__("steps", math.inf),
    "steps fractional": lambda m: m["optimizer"].__setitem__("steps", 2.5),
    "steps a bool": lambda m: m["optimizer"].__setitem__("steps", True),
    "steps negative": lambda m: m["optimizer"].__setitem__("steps", -1),
    "steps past 64 bits": lambda m: m["optimizer"].__setitem__("steps", 2**70),
    "lr infinite": lambda m: m["optimizer"].__setitem__("lr", math.inf),
    "lr NaN": lambda m: m["optimizer"].__setitem__("lr", math.nan),
    "lr negative": lambda m: m["optimizer"].__setitem__("lr", -0.1),
    "beta1_power NaN": lambda m: rec0(m)["scalars"].__setitem__("beta1_power", math.nan),
    "beta1_power above 1": lambda m: rec0(m)["scalars"].__setitem__("beta1_power", 1.0 / 0.9),
    "beta2_power negative": lambda m: rec0(m)["scalars"].__setitem__("beta2_power", -0.5),
    "record step fractional": lambda m: rec0(m)["scalars"].__setitem__("step", 2.5),
    "record step a string": lambda m: rec0(m)["scalars"].__setitem__("step", "3"),
    "record extra scalar": lambda m: rec0(m)["scalars"].__setitem__("gamma", 1.0),
    # depth
    "nested thousands deep": with_text('{"progress": ' + deep(5000) + "}"),
    "nested in the slots": with_text('{"format": "leantrain.checkpoint", "version": 1, "slots": ' + deep(3000) + "}"),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_resealed_manifests_are_refused_before_installing(tmp_path, unchanged, edit, capsys):
    path, _ = trained(tmp_path)
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(edit_manifest(path.read_bytes(), MANIFEST_EDITS[edit]))
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    rng = torch.get_rng_state()
    with unchanged(r.params), pytest.raises(lt.CheckpointError, match="nothing was loaded|not valid JSON|unsupported"):
        lt.load_checkpoint(bad, r, optimizer=optim.adam(0.01))
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(lt.CheckpointError):
        lt.read_checkpoint(bad)
    assert run_cli(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: inspect: ") and err.count("\n") == 1 and "Traceback" not in err


PROGRESS_EDITS = {
    "progress without epoch": lambda p: p.pop("epoch"),
    "progress step a string": lambda p: p.__setitem__("step", "3"),
    "progress seen negative": lambda p: p.__setitem__("seen", -4),
    "progress losses not pairs": lambda p: p.__setitem__("losses", [1, 2]),
    "progress evals a dict": lambda p: p.__setitem__("evals", {"a": 1}),
    "progress before a string": lambda p: p.__setitem__("before", "low"),
    "progress past the run's epochs": lambda p: p.__setitem__("epoch", 5),  # the run resuming it has epochs=2
}


@pytest.mark.parametrize("edit", sorted(PROGRESS_EDITS))
def test_a_resume_from_bad_progress_is_refused_before_installing(tmp_path, unchanged, edit):
    path, data = trained(tmp_path)
    path.write_bytes(edit_manifest(path.read_bytes(), lambda m: PROGRESS_EDITS[edit](m["progress"])))
    torch.manual_seed(3)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    rng = torch.get_rng_state()
    loader = lt.DataLoader(lt.Dataset(data), batch_size=2, shuffle=True, seed=1)
    cfg = lt.LoaderTrainConfig(epochs=2, log_every=0, optimizer=optim.adam(0.01), resume_from=path)
    with unchanged(r.params), pytest.raises(lt.CheckpointError, match="progress"):
        lt.train_loader(r, cfg, loader)
    assert torch.equal(torch.get_rng_state(), rng)


def rewrite(path, tensors_edit=None, manifest_edit=None):
    """Re-save the file with changed tensors and a consistent, resealed manifest."""
    data = path.read_bytes()
    tensors = load_file(str(path))
    manifest = manifest_of(data)
    if tensors_edit:
        tensors_edit(tensors)
    if manifest_edit:
        manifest_edit(manifest)
    manifest["checksums"] = {k: checksum(t) for k, t in sorted(tensors.items())}
    save_file(tensors, str(path), metadata={"leantrain": seal(json.dumps(manifest, sort_keys=True))})


TENSOR_EDITS = {
    "rng state of another dtype": (lambda t: t.__setitem__("rng.torch", t["rng.torch"].to(torch.int16)), None),
    "rng state too short": (lambda t: t.__setitem__("rng.torch", t["rng.torch"][:100].clone()), None),
    "loader order of floats": (lambda t: t.__setitem__("loader.order", t["loader.order"].double()), None),
    "loader order 2-D": (lambda t: t.__setitem__("loader.order", t["loader.order"].reshape(1, -1).clone()), None),
    "state tensor of another shape": (lambda t: t.__setitem__("state.0.m", torch.zeros(1)), None),
    "a storage in float64": (lambda t: t.__setitem__("storage.0", t["storage.0"].double()), None),
    "a tensor the manifest forgot": (lambda t: t.__setitem__("extra", torch.zeros(2)), None),
}


@pytest.mark.parametrize("edit", sorted(TENSOR_EDITS))
def test_consistent_but_wrong_tensors_are_refused(tmp_path, unchanged, edit):
    path, _ = trained(tmp_path)
    rewrite(path, *TENSOR_EDITS[edit])
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    rng = torch.get_rng_state()
    with unchanged(r.params), pytest.raises(lt.CheckpointError, match="nothing was loaded") as e:
        lt.load_checkpoint(path, r, optimizer=optim.adam(0.01))
    assert "fails its checksum" not in str(e.value)  # refused for what it holds, not for damage
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("label", ["I32", "U8", "F16"])
def test_a_relabelled_dtype_fails_integrity_in_inspect_too(tmp_path, capsys, label):
    path, _ = trained(tmp_path)

    def relabel(header, body):
        e = header["storage.0"]
        size = {"I32": 4, "U8": 1, "F16": 2}[label]
        n = (e["data_offsets"][1] - e["data_offsets"][0]) // size
        e["dtype"], e["shape"] = label, [n]
        return body

    path.write_bytes(edit_header(path.read_bytes(), relabel))
    with pytest.raises(lt.CheckpointError, match="'storage.0' is .* in the file; the manifest says"):
        lt.load_checkpoint(path, lt.Runner.from_module(TiedNet(bn=True), "mse"))
    assert run_cli(["inspect", str(path)]) == 2
    out = capsys.readouterr()
    assert "integrity: OK" not in out.out and "storage.0" in out.err


@pytest.mark.parametrize("n, size", [(200_000, 0), (5_000, 4)])
def test_stray_tensors_are_refused_from_the_header_alone(tmp_path, monkeypatch, n, size):
    path, _ = trained(tmp_path)

    def strays(header, body):
        end = len(body)
        for k in range(n):
            header[f"stray.{k}"] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [end, end + size]}
            end += size
        return body + bytes(n * size)

    path.write_bytes(edit_header(path.read_bytes(), strays))
    reads = []
    monkeypatch.setattr(tensorfile.TensorFile, "read", lambda self, name: reads.append(name))
    with pytest.raises(lt.CheckpointError, match=f"(?s)unexpected tensor 'stray.0'.*{n - 20} more unexpected"):
        lt.read_checkpoint(path)
    assert reads == []  # no tensor byte was read


@pytest.mark.parametrize("damage", ["trailing bytes", "overlapping tensors", "a gap", "header past the end",
                                    "header not an object", "metadata not strings"])
def test_a_malformed_safetensors_layout_is_refused(tmp_path, damage):
    path, _ = trained(tmp_path)
    data = path.read_bytes()
    if damage == "trailing bytes":
        data += b"\0" * 8
    elif damage == "header past the end":
        data = (2**40).to_bytes(8, "little") + data[8:]
    else:
        def edit(header, body):
            names = sorted(k for k in header if k != "__metadata__")
            if damage == "overlapping tensors":
                header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
            elif damage == "a gap":
                return body + b"\0" * 4
            elif damage == "header not an object":
                header.clear()
                header["x"] = 1
            else:
                header["__metadata__"]["n"] = 5
            return body

        data = edit_header(data, edit)
    path.write_bytes(data)
    with pytest.raises(lt.CheckpointError, match="not a readable checkpoint"):
        lt.read_checkpoint(path)


def test_a_reader_racing_a_writer_reads_one_whole_file(tmp_path, monkeypatch):
    path, _ = trained(tmp_path)
    first, _ = lt.read_checkpoint(path)
    expected = load_file(str(path))
    r = lt.Runner.from_module(TiedNet(bn=False), "mse")  # another model: another header and data

    read_header = tensorfile.TensorFile._read_header
    replaced = []

    def header_then_a_writer(self):  # between the header and the data, a concurrent atomic writer
        read_header(self)
        lt.save_checkpoint(self.path, r, rng=False)  # renames a new file over the path
        replaced.append(self.path)

    monkeypatch.setattr(tensorfile.TensorFile, "_read_header", header_then_a_writer)
    manifest, tensors = lt.read_checkpoint(path)
    assert replaced and manifest == first
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    monkeypatch.setattr(tensorfile.TensorFile, "_read_header", read_header)
    assert lt.read_checkpoint(path)[0]["slots"] != first["slots"]  # the new file is there now


def test_reading_a_folder_or_a_missing_file(tmp_path):
    with pytest.raises(lt.CheckpointError, match="a folder without index.json: not a checkpoint"):
        lt.read_checkpoint(tmp_path)  # a folder is read as a sharded checkpoint: it needs its index
    with pytest.raises(lt.CheckpointError, match="no such checkpoint file"):
        lt.read_checkpoint(tmp_path / "nope.ckpt")


def _ema_fp16_run(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "e.ckpt"
    cfg = lt.TrainConfig(steps=3, batch_size=2, log_every=0, optimizer=optim.adam(0.01), ema_decay=0.9,
                         autocast="float16", checkpoint_path=path)
    lt.train_samples(lt.Runner.from_module(TiedNet(bn=True), "mse"), cfg, regression_batches(6, 3))
    return path, cfg


def _drop_last_ema(tensors):
    del tensors[max((k for k in tensors if k.startswith("ema.")), key=lambda k: int(k.split(".")[1]))]


RESUME_EDITS = {  # every value checked in the dtype it will be used in, before anything is installed
    "an EMA list missing a storage": (_drop_last_ema, lambda m: m["ema"]["storages"].pop()),
    "an EMA count of 0 with values": (None, lambda m: m["ema"].__setitem__("count", 0)),
    "a loss scale past float32": (None, lambda m: m["progress"].__setitem__("loss_scale", 1e39)),
    "a loss scale that is 0 in float32": (None, lambda m: m["progress"].__setitem__("loss_scale", 1e-46)),
    "a scale tracker past int32": (None, lambda m: m["progress"].__setitem__("scale_tracker", 2**31)),
}


@pytest.mark.parametrize("edit", sorted(RESUME_EDITS))
def test_resealed_values_that_would_poison_a_resume_are_refused(tmp_path, unchanged, edit):
    path, cfg = _ema_fp16_run(tmp_path)
    rewrite(path, *RESUME_EDITS[edit])
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    rng = torch.get_rng_state()
    with unchanged(r.params), pytest.raises(lt.CheckpointError, match="nothing was loaded"):
        lt.train_samples(r, lt.TrainConfig(**{**cfg.__dict__, "steps": 5, "resume_from": path}), regression_batches(6, 3))
    assert torch.equal(torch.get_rng_state(), rng) and r.ema is None


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, capsys):
    import os

    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    with pytest.raises(lt.CheckpointError, match="not a regular file"):
        lt.load_checkpoint(fifo, r)
    assert run_cli(["inspect", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    with pytest.raises(lt.CheckpointError, match="not a regular file"):
        lt.torchlean_io.load(fifo, r)


def saved(tmp_path, kind):
    torch.manual_seed(0)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    path = tmp_path / f"{kind}.ckpt"
    data = regression_batches(6, 3)
    if kind == "samples":
        lt.train_samples(r, lt.TrainConfig(steps=3, batch_size=2, log_every=0, checkpoint_path=path), data)
    else:
        loader = lt.DataLoader(lt.Dataset(data), batch_size=2, shuffle=True, seed=1)
        lt.train_loader(r, lt.LoaderTrainConfig(epochs=1, log_every=0, checkpoint_path=path), loader)
    return path, data


@pytest.mark.parametrize("case, match", [
    ("another batch_size", "batch_size: checkpoint has 2, this run has 3"),
    ("a loader checkpoint into train_samples", "not a samples training checkpoint"),
    ("another loader batch size", "loader batch_size: checkpoint has 2, this loader has 3"),
    ("a samples checkpoint into train_loader", "not a loader training checkpoint"),
])
def test_an_incompatible_resume_changes_nothing(tmp_path, unchanged, case, match):
    source = "loader" if "loader batch size" in case or "loader checkpoint" in case else "samples"
    path, data = saved(tmp_path, source)
    torch.manual_seed(1)
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    rng = torch.get_rng_state()
    with unchanged(r.params), pytest.raises(lt.CheckpointError, match=match):
        if case == "another batch_size":
            lt.train_samples(r, lt.TrainConfig(steps=5, batch_size=3, resume_from=path), data)
        elif case == "a loader checkpoint into train_samples":
            lt.train_samples(r, lt.TrainConfig(steps=5, batch_size=2, resume_from=path), data)
        elif case == "another loader batch size":
            loader = lt.DataLoader(lt.Dataset(data), batch_size=3, shuffle=True, seed=1)
            lt.train_loader(r, lt.LoaderTrainConfig(epochs=2, resume_from=path), loader)
        else:
            loader = lt.DataLoader(lt.Dataset(data), batch_size=2, shuffle=True, seed=1)
            lt.train_loader(r, lt.LoaderTrainConfig(epochs=2, resume_from=path), loader)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_fitting_resume_still_installs(tmp_path):
    path, data = saved(tmp_path, "samples")
    r = lt.Runner.from_module(TiedNet(bn=True), "mse")
    report = lt.train_samples(r, lt.TrainConfig(steps=5, batch_size=2, log_every=0, resume_from=path), data)
    assert report.steps == 5


@pytest.mark.parametrize("tensor", ["loader.generator.0", "loader.global", "rng.torch"])
def test_a_generator_state_torch_refuses_is_a_checkpoint_error_before_anything_is_installed(tmp_path, tensor):
    """An all-zero Mersenne Twister state (a sound file, its checksums recomputed) used to
    raise torch's raw "Invalid mt19937 state" after the parameters were installed."""
    from filetools import forged_loader_run

    def zeroed(manifest, tensors):
        tensors[tensor] = torch.zeros_like(tensors[tensor])

    runner, loader, cfg = forged_loader_run(tmp_path, zeroed)
    before = [p.detach().clone() for p in runner.module.parameters()]
    rng = torch.get_rng_state()
    with pytest.raises(lt.CheckpointError, match="cannot be restored|is not a generator state torch takes"):
        lt.train_loader(runner, cfg, loader)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.module.parameters()))
    assert torch.equal(rng, torch.get_rng_state())
