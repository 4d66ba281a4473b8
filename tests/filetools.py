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
