"""``eplb compare``: methods side by side on counts (the command is built by
:mod:`eplb.method_comparison`, with this package's one-line errors)."""

from __future__ import annotations

from ..method_comparison import build_command
from .shared import friendly_errors

compare = build_command(friendly_errors)
