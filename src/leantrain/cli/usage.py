"""What every subcommand shares: the user-error type, exit statuses, the one-line
argument parser and the argument types."""

from __future__ import annotations

import argparse

EXIT_USER, EXIT_INTERRUPTED = 2, 130


class UserError(Exception):
    """A mistake in how the command was called: one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + error
        raise UserError(f"{self.prog}: {message}")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a natural number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def natural(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a natural number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def seed(text: str) -> int:
    """A random seed: an integer in torch's range, ``[0, 2**64)``."""
    value = natural(text)
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"expected a seed below 2**64 (torch's range), got {value}")
    return value
