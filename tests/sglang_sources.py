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


LOADER = "sglang/srt/eplb/expert_location.py"


def load_expert_location(monkeypatch, settings, parallel):
    """SGLang's ``expert_location`` module, executed on its own from :func:`sglang_file` with its
    runtime context (``sglang.srt.runtime_context``: the server's arguments ``settings`` and
    process groups ``parallel``, plain namespaces) replaced by plain values; ``monkeypatch``
    undoes the stand-in modules after the test. ``None`` without SGLang's files."""
    import sys
    import types
    from types import SimpleNamespace

    source = sglang_file(LOADER)
    if source is None:
        return None
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_exec = lambda: settings
    context.get_parallel = lambda: parallel
    context.get_device = lambda: SimpleNamespace(device="cpu")
    context.get_resources = lambda: SimpleNamespace(expert_location_metadata=None)
    elastic = types.ModuleType("sglang.srt.elastic_ep.elastic_ep")
    elastic.elastic_expanded_world_enabled = lambda: False
    for name in ("sglang", "sglang.srt", "sglang.srt.elastic_ep"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, context.__name__, context)
    monkeypatch.setitem(sys.modules, elastic.__name__, elastic)
    module = types.ModuleType("sglang_expert_location_under_test")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(source, LOADER, "exec"), module.__dict__)
    return module
