import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # the published-greedy reference lives in bench/
# The tests mirror the package's layers, one folder each (and project/ for the repository's own
# checks); the helper modules (brute force, strategies, the CLI runner, engine sources) sit in
# tests/ itself, and a test module may borrow a fixture-like helper from another folder's module.
TESTS = Path(__file__).resolve().parent
for folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]:
    sys.path.insert(1, str(folder))

settings.register_profile(
    "default", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def traces_dir() -> Path:
    """The shared real traces (``EPLB_TRACES`` overrides the location)."""
    return Path(os.environ.get("EPLB_TRACES", ROOT.parent / "shared" / "data" / "traces"))


@pytest.fixture
def trace_counts():
    """Load ``counts [T, L, E]`` of a real trace by file name, or skip when the traces are absent."""
    import numpy as np

    def load(name: str):
        path = traces_dir() / name
        if not path.exists():
            pytest.skip(f"real trace {path} is absent (set EPLB_TRACES to its folder)")
        with np.load(path, allow_pickle=False) as data:
            return data["counts"].astype(np.float64)

    return load
