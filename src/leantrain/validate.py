"""The argument checks every module shares, written once.

Python's ``bool`` is an ``int``: ``True`` is never accepted where a count or a number
is meant. Each check raises ``ConfigError`` naming the operation, the argument, the
rule and the value.
"""

from __future__ import annotations

from typing import Sequence

from .errors import ConfigError


def is_int(value: object) -> bool:
    """An integer, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_count(op: str, name: str, value: object, minimum: int) -> int:
    """An integer >= ``minimum``."""
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{op}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_choice(op: str, name: str, value: object, choices: Sequence[str]) -> str:
    """One of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{op}: {name} must be one of {tuple(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_bool(op: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{op}: {name} must be a bool, got {value!r}")
    return value
