"""SGLang's own files for the tests that run SGLang's code against eplb's (loader, recorder).

Files come from ``EPLB_SGLANG_SOURCES`` (a sglang wheel or an unpacked tree) or an installed
sglang; without either, :func:`sglang_file` gives ``None`` and the tests skip with :data:`SKIP_REASON`.
"""

from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path

SKIP_REASON = ("no SGLang files: set EPLB_SGLANG_SOURCES to a sglang wheel (pip download sglang --no-deps) "
               "or install sglang")


def sglang_file(name: str) -> str | None:
    """The text of ``name`` (a path inside SGLang's package tree, e.g.
    ``sglang/srt/eplb/expert_location.py``), or ``None`` when no SGLang files are at hand."""
    path = os.environ.get("EPLB_SGLANG_SOURCES")
    if path:
        path = Path(path)
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as wheel:
                return wheel.read(name).decode()
        return (path / name).read_text()
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.origin:
        file = Path(spec.origin).parent.parent / name
        return file.read_text() if file.is_file() else None
    return None
