"""Editing checkpoint files the way a hostile user would: the manifest (resealed so its
CRC passes, or not) and the safetensors header (dtype labels, extra entries)."""

import json

from leantrain.io.checkfile import seal, unseal


def split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8: 8 + n]), data[8 + n:]


def join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + body


def manifest_of(data: bytes) -> dict:
    return json.loads(unseal(split(data)[0]["__metadata__"]["leantrain"]))


def edit_manifest(data: bytes, edit, reseal: bool = True) -> bytes:
    """``edit(manifest)`` changes the dict in place, or returns JSON text to store instead."""
    header, body = split(data)
    manifest = manifest_of(data)
    text = edit(manifest)
    new = text if isinstance(text, str) else json.dumps(manifest, sort_keys=True)
    header["__metadata__"]["leantrain"] = seal(new) if reseal else header["__metadata__"]["leantrain"][:9] + new
    return join(header, body)


def edit_header(data: bytes, edit) -> bytes:
    """``edit(header, body)`` changes the header in place and returns the new body."""
    header, body = split(data)
    body = edit(header, body)
    return join(header, body)


def forged_loader_run(tmp_path, edit):
    """A loader run's checkpoint (3 updates of a ``Linear(3, 2)`` over a shuffled torch
    DataLoader, checkpointing every update) with ``edit(manifest, tensors)`` applied and
    every checksum recomputed (a sound file), and a fresh ``(runner, loader, cfg)`` that
    resumes it."""
    import torch
    from safetensors.torch import save_file

    import leantrain as lt
    from leantrain.io.checkfile import checksum

    x, y = torch.randn(16, 3), torch.randn(16, 2)

    def job(resume=None):
        torch.manual_seed(0)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True,
                                             generator=torch.Generator().manual_seed(1))
        runner = lt.Runner.from_module(torch.nn.Linear(3, 2), "mse")
        cfg = lt.LoaderTrainConfig(epochs=2, log_every=0, max_steps=None if resume else 3, resume_from=resume,
                                   checkpoint_path=tmp_path / "c.ckpt", checkpoint_every=1)
        return runner, loader, cfg

    runner, loader, cfg = job()
    lt.train_loader(runner, cfg, loader)
    manifest, tensors = lt.read_checkpoint(tmp_path / "c.ckpt")
    edit(manifest, tensors)
    for name in tensors:
        manifest["checksums"][name] = checksum(tensors[name])
    save_file(tensors, str(tmp_path / "c.ckpt"), metadata={"leantrain": seal(json.dumps(manifest, sort_keys=True))})
    return job(resume=tmp_path / "c.ckpt")
