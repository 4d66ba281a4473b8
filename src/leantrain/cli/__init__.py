"""The ``leantrain`` command (``leantrain.cli:main``)."""

from .main import main

__all__ = ["main"]
