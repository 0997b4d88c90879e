"""The suite collects without any optional extra: a module that needs one skips with the reason, it
never aborts the collection of the others."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # collects the whole suite in a fresh process

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("ortools", "torch", "matplotlib", "yaml", "safetensors", "mkdocs", "mkdocstrings")


def test_the_suite_collects_with_no_optional_extra_installed():
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in EXTRAS)  # import then raises ImportError
    code = f"import sys; {blocked}; import pytest; sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider']))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "error" not in done.stdout.splitlines()[-1]
