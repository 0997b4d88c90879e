"""What an engine gets when it installs and imports eplb: where compiled kernels go, what
``import eplb`` loads, and which dependencies it pulls in.

Each check runs in a fresh interpreter (Numba picks a kernel's cache folder when the kernel
module is imported, and ``sys.modules`` must start empty)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import eplb

pytestmark = pytest.mark.slow  # installs and compiles in fresh processes

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(eplb.__file__).resolve().parent


def run_python(code: str, env_update: dict[str, str | None], cwd: Path = ROOT) -> str:
    """Run ``code`` in a new interpreter; its last stdout line."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "EPLB_CACHE_DIR")}
    for key, value in env_update.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def numba_files(folder: Path) -> dict[str, tuple[float, int]]:
    """Numba cache files (index ``.nbi`` and data ``.nbc``) under ``folder``, with mtime and size."""
    out = {}
    for path in folder.rglob("*"):
        if path.suffix in (".nbi", ".nbc"):
            st = path.stat()
            out[str(path)] = (st.st_mtime_ns, st.st_size)
    return out


# A kernel no other test calls with these argument types: an int32 phy2log makes Numba compile a
# new specialisation, so the process must write a cache entry somewhere.
CALL_KERNEL = """
import json, numpy as np
from eplb.kernels.plumbing.layout import replica_counts
from eplb.kernels.plumbing._cache import cache_dir
counts = replica_counts(np.array([[0, 1, 1, 2]], dtype=np.int32), 3)
assert counts.tolist() == [[1, 2, 1]]
print(json.dumps({"stats": replica_counts.stats.cache_misses.__len__(),
                  "dir": cache_dir(replica_counts.py_func.__code__.co_filename)}))
"""


def test_kernel_caches_go_to_the_configured_folder_not_the_package(tmp_path):
    before = numba_files(PACKAGE)
    out = json.loads(run_python(CALL_KERNEL, {"EPLB_CACHE_DIR": str(tmp_path)}))
    assert numba_files(PACKAGE) == before, "a kernel call wrote Numba cache files inside the eplb package"
    written = numba_files(tmp_path)
    assert any("layout.replica_counts" in name and name.endswith(".nbc") for name in written), written
    assert Path(out["dir"]).is_relative_to(tmp_path)
    # a second process loads what the first compiled instead of compiling again
    again = run_python(CALL_KERNEL.replace('"stats": replica_counts.stats.cache_misses.__len__()',
                                           '"stats": len(replica_counts.stats.cache_hits)'),
                       {"EPLB_CACHE_DIR": str(tmp_path)})
    assert json.loads(again)["stats"] >= 1


def test_numba_cache_dir_is_honoured(tmp_path):
    """A user who moved every Numba cache with ``NUMBA_CACHE_DIR`` finds eplb's there too."""
    before = numba_files(PACKAGE)
    run_python(CALL_KERNEL, {"NUMBA_CACHE_DIR": str(tmp_path)})
    assert numba_files(PACKAGE) == before
    assert any(Path(name).is_relative_to(tmp_path / "eplb") for name in numba_files(tmp_path))


def test_unwritable_cache_folder_falls_back_to_a_temp_folder(tmp_path):
    """A read-only home (or a bad ``EPLB_CACHE_DIR``) still caches, in the temp folder, not in the package."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    temp = tmp_path / "tmp"
    temp.mkdir()
    before = numba_files(PACKAGE)
    out = json.loads(run_python(CALL_KERNEL, {"EPLB_CACHE_DIR": str(blocker / "cache"), "TMPDIR": str(temp)}))
    assert numba_files(PACKAGE) == before
    assert Path(out["dir"]).is_relative_to(temp)
    assert numba_files(temp)


def test_other_packages_keep_numbas_usual_cache(tmp_path):
    """The locator is eplb's only: another module's cached function still caches next to its source."""
    (tmp_path / "other_mod.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def twice(x):
            return 2 * x
    """))
    cache = tmp_path / "eplb-cache"
    run_python("import eplb, other_mod; print(other_mod.twice(3))",
               {"EPLB_CACHE_DIR": str(cache), "PYTHONPATH": str(tmp_path) + os.pathsep + str(ROOT)})
    assert any("other_mod.twice" in name for name in numba_files(tmp_path / "__pycache__"))
    assert not any("other_mod" in name for name in numba_files(cache))


def test_import_eplb_loads_no_heavy_optional_dependency():
    loaded = run_python("""
        import sys, json, eplb
        print(json.dumps(sorted(m for m in ("ortools", "torch", "matplotlib", "pandas") if m in sys.modules)))
    """, {})
    assert json.loads(loaded) == []


def test_dependencies_an_engine_can_live_with():
    """OR-Tools (with pandas and a pinned protobuf) is an extra, and the ``torch`` extra is a range
    that does not replace an engine's torch; the test extra pins what CI runs."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "ortools" not in core and "torch" not in core
    extras = project["optional-dependencies"]
    assert any(req.startswith("ortools") for req in extras["exact"])
    torch_req = [req for req in extras["torch"] if req.startswith("torch")]
    assert torch_req and "==" not in torch_req[0] and ">=" in torch_req[0]
    assert any(req.startswith("ortools") for req in extras["test"])
