"""Nested state (a loader's or a dataset's ``state_dict()``) as JSON plus named tensors.

A checkpoint holds no pickle: the structure goes into the manifest as JSON, every tensor
in it is stored as its own entry of the tensor file and referenced by name. Tuples come
back as lists; dict keys that are not strings are kept with their type.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError

_TENSOR, _ITEMS, _TUPLE = "__tensor__", "__items__", "__tuple__"


def encode(obj: Any, tensors: dict, path: str = "t") -> Any:
    """JSON data for ``obj``; its tensors are added to ``tensors`` (name -> CPU tensor)."""
    if isinstance(obj, torch.Tensor):
        name = f"{path}.{len(tensors)}"
        tensors[name] = obj.detach().to("cpu").contiguous()
        return {_TENSOR: name}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not ({_TENSOR, _ITEMS, _TUPLE} & set(obj)):
            return {k: encode(v, tensors, path) for k, v in obj.items()}
        return {_ITEMS: [[encode(k, tensors, path), encode(v, tensors, path)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [encode(v, tensors, path) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, tensors, path) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(
        f"save_checkpoint: loader state: cannot store a {type(obj).__name__} (tensors, numbers, strings, "
        f"lists, tuples and dicts can be stored)"
    )


def decode(obj: Any, tensors: dict) -> Any:
    """The structure ``encode`` wrote, with its tensors from ``tensors``."""
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if set(obj) == {_TENSOR}:
        return tensors[obj[_TENSOR]]
    if set(obj) == {_TUPLE}:
        return tuple(decode(v, tensors) for v in obj[_TUPLE])
    if set(obj) == {_ITEMS}:
        return {_key(decode(k, tensors)): decode(v, tensors) for k, v in obj[_ITEMS]}
    return {k: decode(v, tensors) for k, v in obj.items()}


def _key(k: Any) -> Any:
    return tuple(_key(x) for x in k) if isinstance(k, list) else k


def references(obj: Any) -> set:
    """The tensor names a stored structure refers to."""
    if isinstance(obj, list):
        return set().union(*(references(v) for v in obj)) if obj else set()
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR} and isinstance(obj[_TENSOR], str):
            return {obj[_TENSOR]}
        return set().union(*(references(v) for v in obj.values())) if obj else set()
    return set()
