"""Errors of the file readers and writers, and the optional dependencies they need."""

from __future__ import annotations

import importlib
from pathlib import Path

from ...model._validation import MissingExtraError  # noqa: F401  (raised by require, caught by the CLI)


class FormatError(ValueError):
    """A file could not be read or written: names the file and what is wrong with it."""

    def __init__(self, path, problem: str):
        self.path = Path(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)


def require(module: str, extra: str, purpose: str):
    """Import an optional module or raise :class:`MissingExtraError` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(module.split(".")[0], extra, purpose) from None
