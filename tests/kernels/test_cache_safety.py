"""The code the kernel cache runs is this user's and this source's (:mod:`eplb.kernels.plumbing._cache`).

Numba's cache files are pickles, so a cache folder another user can write runs that user's code;
an entry stamped by its own file only runs stale helpers after an upgrade; a corrupt entry must be
a miss, not an error on every later call. The end-to-end checks run a fresh interpreter with its
own ``EPLB_CACHE_DIR`` / ``HOME`` / ``TMPDIR`` calling one small kernel; the folder rules are also
checked in process on folders made for each test. No wall-clock assertion."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eplb.kernels.plumbing import _cache

# Marked slow test by test (each compiles kernels in fresh processes and cache folders); the
# unmarked tests check this module in the fast tier (pytest -m "not slow").

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 65534  # "nobody": a user other than this one
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_posix_owners = pytest.mark.skipif(not hasattr(os, "geteuid"), reason="no POSIX file owners on this platform")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="giving a folder to another user (chown) needs root")
WARNING = "cannot use the kernel cache folder"

# A fresh interpreter calling one small kernel: its answer, whether it compiled or loaded, where it
# cached, and whether a planted pickle ran.
CHILD = """
import json, os, numpy as np
from eplb.kernels.plumbing.layout import replica_counts
from eplb.kernels.plumbing._cache import cache_dir
counts = replica_counts(np.array([[0, 1, 1, 2]], dtype=np.int64), 3)
print(json.dumps({"counts": counts.tolist(), "misses": len(replica_counts.stats.cache_misses),
                  "hits": len(replica_counts.stats.cache_hits),
                  "dir": cache_dir(replica_counts.py_func.__code__.co_filename)}))
"""
RIGHT = [[1, 2, 1]]


def child_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """This environment without any cache setting, a private temp dir, then ``settings``."""
    env = {k: v for k, v in os.environ.items() if k not in ("EPLB_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir(mode=0o700, exist_ok=True)
    env.update(TMPDIR=str(tmpdir), **settings)
    return env


def run_child(env: dict[str, str], code: str = CHILD, cwd: Path | None = None) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


class Planted:
    """A pickle that, when unpickled, writes a marker file (what an attacker's index would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def plant(folder: Path, marker: Path) -> None:
    """Replace every cache file in ``folder`` (recursively) by a planted pickle."""
    payload = pickle.dumps(Planted(marker))
    for path in folder.rglob("*"):
        if path.suffix in (".nbi", ".nbc"):
            path.write_bytes(payload)


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    """A cache folder holding the child's kernel, compiled once for the tests that copy it."""
    tmp = tmp_path_factory.mktemp("filled")
    cache = tmp / "cache"
    out, _ = run_child(child_env(tmp, EPLB_CACHE_DIR=str(cache)))
    assert out["misses"] == 1 and out["counts"] == RIGHT
    return cache


def entry_files(cache: Path) -> tuple[Path, Path]:
    """The index and data file of the child's kernel in ``cache``."""
    (index,) = cache.rglob("layout.replica_counts-*.nbi")
    (data,) = cache.rglob("layout.replica_counts-*.nbc")
    return index, data


def copy_cache(filled: Path, to: Path) -> Path:
    shutil.copytree(filled, to)
    return to


# ---------------------------------------------------------------------------------------------
# 8. Planted pickles never run


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize("given", ["configured folder", "kernel folder"])
def test_a_folder_of_another_user_is_never_loaded(filled, tmp_path, given):
    """A planted index in a cache folder another user owns does not run; the kernel compiles and
    caches in a private fallback, and one warning names the configured folder and the reason."""
    cache = copy_cache(filled, tmp_path / "cache")
    marker = tmp_path / "planted-ran"
    plant(cache, marker)
    index, _ = entry_files(cache)
    foreign = cache if given == "configured folder" else index.parent
    os.chown(foreign, OTHER_UID, OTHER_UID)
    out, stderr = run_child(child_env(tmp_path, EPLB_CACHE_DIR=str(cache)))
    assert not marker.exists(), "a pickle in another user's folder was loaded"
    assert out["counts"] == RIGHT and out["misses"] == 1
    assert Path(out["dir"]).is_relative_to(tmp_path / "tmpdir" / f"eplb-cache-{os.geteuid()}")
    assert stderr.count(WARNING) == 1, stderr
    assert f"{WARNING} {cache} (from EPLB_CACHE_DIR)" in stderr
    assert f"{foreign} is owned by uid {OTHER_UID}" in stderr and str(out["dir"]) in stderr


@pytest.mark.slow
@needs_posix_owners
@pytest.mark.parametrize("given, bits", [("configured folder", 0o002), ("configured folder", 0o020),
                                         ("numba folder", 0o002), ("kernel folder", 0o020)])
def test_a_folder_group_or_others_can_write_is_never_loaded(filled, tmp_path, given, bits):
    cache = copy_cache(filled, tmp_path / "cache")
    marker = tmp_path / "planted-ran"
    plant(cache, marker)
    index, _ = entry_files(cache)
    folder = {"configured folder": cache, "numba folder": index.parent.parent, "kernel folder": index.parent}[given]
    folder.chmod(stat.S_IMODE(folder.stat().st_mode) | bits)
    out, stderr = run_child(child_env(tmp_path, EPLB_CACHE_DIR=str(cache)))
    assert not marker.exists(), "a pickle in a folder others can write was loaded"
    assert out["counts"] == RIGHT and out["misses"] == 1 and not Path(out["dir"]).is_relative_to(cache)
    assert f"{folder} is writable by group or others" in stderr and stderr.count(WARNING) == 1


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize("planted_as", ["folder", "link"])
def test_a_temp_fallback_another_user_made_first_is_never_loaded(filled, tmp_path, planted_as):
    """The configured folder is a file, and another user created the predictable fallback
    ``<tmp>/eplb-cache-<uid>`` first (a folder of planted pickles, or a link to one): nothing there
    is loaded; the kernel is compiled in memory and the warning says so."""
    env = child_env(tmp_path, EPLB_CACHE_DIR=str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a folder")
    attacker = copy_cache(filled, tmp_path / "attacker")
    marker = tmp_path / "planted-ran"
    plant(attacker, marker)
    for path in [attacker, *attacker.rglob("*")]:
        os.chown(path, OTHER_UID, OTHER_UID)
    fallback = Path(env["TMPDIR"]) / f"eplb-cache-{os.geteuid()}"
    if planted_as == "folder":
        attacker.rename(fallback)
    else:
        fallback.symlink_to(attacker)
        os.lchown(fallback, OTHER_UID, OTHER_UID)
    out, stderr = run_child(env)
    assert not marker.exists(), "a pickle in another user's fallback folder was loaded"
    assert out["counts"] == RIGHT and out["misses"] == 1 and out["dir"] is None
    assert f"{WARNING} {tmp_path / 'a-file'} (from EPLB_CACHE_DIR): {tmp_path / 'a-file'} is not a folder" in stderr
    assert "compiling kernels in memory" in stderr and stderr.count(WARNING) == 1


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, a folder nothing can be created in")
def test_a_read_only_home_warns_once_and_caches_in_a_private_temp_folder(tmp_path):
    """``HOME`` where nothing can be created (``/proc``: read-only even for root): one warning naming
    ``~/.cache/eplb`` and why; the kernels cache in ``<tmp>/eplb-cache-<uid>``, made mode 0700, and
    a second process loads them."""
    env = child_env(tmp_path, HOME="/proc")
    out, stderr = run_child(env)
    assert out["counts"] == RIGHT and out["misses"] == 1
    assert stderr.count(WARNING) == 1 and f"{WARNING} /proc/.cache/eplb (from HOME): cannot create /proc/.cache" in stderr
    fallback = Path(env["TMPDIR"]) / f"eplb-cache-{os.geteuid() if hasattr(os, 'geteuid') else 'user'}"
    assert Path(out["dir"]).is_relative_to(fallback) and f"caching compiled kernels in {out['dir']} instead" in stderr
    again, _ = run_child(env)
    assert again["hits"] == 1 and again["counts"] == RIGHT


@pytest.mark.slow
@needs_posix_owners
def test_folders_eplb_makes_are_private_and_so_are_its_files(tmp_path):
    cache = tmp_path / "new" / "cache"
    out, stderr = run_child(child_env(tmp_path, EPLB_CACHE_DIR=str(cache)))
    assert WARNING not in stderr and Path(out["dir"]).is_relative_to(cache)
    made = [tmp_path / "new", cache, *[p for p in cache.rglob("*") if p.is_dir()]]
    assert len(made) == 4 and all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in made)
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in files)


@pytest.mark.slow
@needs_posix_owners
def test_a_linked_cache_folder_this_user_owns_is_used(tmp_path):
    """A cache folder that is a link (a home too small, the cache on scratch) to a private folder
    works: the rules refuse others' folders, not links."""
    real = tmp_path / "scratch" / "cache"
    real.mkdir(parents=True, mode=0o700)
    (tmp_path / "link").symlink_to(real)
    env = child_env(tmp_path, EPLB_CACHE_DIR=str(tmp_path / "link"))
    out, stderr = run_child(env)
    assert WARNING not in stderr and out["misses"] == 1
    assert run_child(env)[0]["hits"] == 1 and list(real.rglob("*.nbi"))


@needs_posix_owners
def test_folder_rules(tmp_path):
    """In process: which folders :func:`eplb.kernels.plumbing._cache.folder_problem` accepts."""
    def problem(folder: Path, root: Path) -> str | None:
        return _cache.folder_problem(str(folder), str(root))

    assert problem(tmp_path / "a" / "b", tmp_path / "a") is None  # made, private
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    sticky = tmp_path / "shared"  # like /tmp: others can write it, nobody can rename what is inside
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert problem(sticky / "c" / "d", sticky / "c") is None
    open_above = tmp_path / "open"
    open_above.mkdir()
    open_above.chmod(0o777)
    assert "writable by other users and not sticky" in problem(open_above / "c" / "d", open_above / "c")
    assert not (open_above / "c").exists(), "a folder was made under an unsafe one"
    (tmp_path / "file").write_text("")
    assert "is not a folder" in problem(tmp_path / "file" / "d", tmp_path / "file")
    out_of_root = tmp_path / "root2"
    out_of_root.mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (out_of_root / "d").symlink_to(tmp_path / "elsewhere")
    assert "outside the cache folder" in problem(out_of_root / "d", out_of_root)
    if IS_ROOT:
        given = tmp_path / "given"
        given.mkdir(mode=0o700)
        os.chown(given, OTHER_UID, OTHER_UID)
        assert f"owned by uid {OTHER_UID}" in problem(given / "d", given)
        link_root = tmp_path / "link-root"
        link_root.mkdir(mode=0o700)
        (link_root / "d").symlink_to(tmp_path / "a")
        os.lchown(link_root / "d", OTHER_UID, OTHER_UID)
        assert f"owned by uid {OTHER_UID}" in problem(link_root / "d", link_root)


# ---------------------------------------------------------------------------------------------
# 9. Stale code never runs

PROBE_HELPER = """
from numba import njit

@njit(cache=True)
def helper(x):
    return x + {step}
"""
PROBE = """
from numba import njit
from .probe_helper import helper

@njit(cache=True)
def probe(x):
    return helper(x) * 10
"""
CALL_PROBE = """
import json
from eplb.kernels.probe import probe
print(json.dumps({"value": probe(1), "misses": len(probe.stats.cache_misses), "hits": len(probe.stats.cache_hits)}))
"""


@pytest.mark.slow
def test_a_changed_helper_in_another_kernel_file_recompiles_its_callers(tmp_path):
    """An upgrade in place that changes only the file of a helper (as ``kernels/plumbing/common.py`` for
    ``linked_placement``): the caller, whose own file is unchanged, runs the new helper."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "eplb", site / "eplb", ignore=shutil.ignore_patterns("__pycache__", "_precompiled"))
    kernels = site / "eplb" / "kernels"
    (kernels / "probe_helper.py").write_text(PROBE_HELPER.format(step=1))
    (kernels / "probe.py").write_text(PROBE)
    env = child_env(tmp_path, EPLB_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(site))
    first, _ = run_child(env, CALL_PROBE, cwd=site)
    assert first == {"value": 20, "misses": 1, "hits": 0}
    assert run_child(env, CALL_PROBE, cwd=site)[0] == {"value": 20, "misses": 0, "hits": 1}  # cached
    (kernels / "probe_helper.py").write_text(PROBE_HELPER.format(step=2))  # the upgrade
    assert run_child(env, CALL_PROBE, cwd=site)[0] == {"value": 30, "misses": 1, "hits": 0}
    assert run_child(env, CALL_PROBE, cwd=site)[0] == {"value": 30, "misses": 0, "hits": 1}


def test_the_stamp_covers_every_kernel_source_and_no_other_file_is_jitted():
    """The stamp hashes ``eplb/kernels/**/*.py``: complete only while jitted code lives there and
    kernel modules import nothing of eplb outside ``eplb.kernels``."""
    sources = {os.path.relpath(p, _cache.PACKAGE_DIR) for p in _cache.kernel_sources()}
    assert {"kernels/plumbing/common.py", "kernels/search/linked.py", "kernels/__init__.py"} <= sources
    compilers = {"njit", "jit", "vectorize", "guvectorize", "cfunc", "jitclass", "stencil", "generated_jit"}
    for path in (ROOT / "eplb").rglob("*.py"):
        tree = ast.parse(path.read_text())
        in_kernels = path.is_relative_to(ROOT / "eplb" / "kernels")
        # a relative import climbs at most to eplb.kernels: one level from its root, two from a sub-package
        top = len(path.relative_to(ROOT / "eplb" / "kernels").parts) if in_kernels else 0
        for node in ast.walk(tree):
            if not in_kernels:  # numba.njit / from numba import njit: jitted code outside the stamp
                jits = (isinstance(node, ast.Attribute) and node.attr in compilers
                        and isinstance(node.value, ast.Name) and node.value.id in ("numba", "nb"))
                jits |= (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("numba")
                         and any(alias.name in compilers for alias in node.names))
                assert not jits, f"{path} compiles with Numba: the cache stamp does not cover it"
            if in_kernels and isinstance(node, ast.ImportFrom):
                assert 0 <= node.level <= top, f"{path} imports from outside eplb.kernels"
                assert node.level >= 1 or not (node.module or "").startswith("eplb"), f"{path}: {node.module}"
            if in_kernels and isinstance(node, ast.Import):
                assert not any(alias.name.startswith("eplb") for alias in node.names), path


# ---------------------------------------------------------------------------------------------
# 10. A corrupt entry is a miss, replaced


def corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.unlink()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    else:  # a folder in its place, not empty
        path.mkdir()
        (path / "inside").write_text("x")


@pytest.mark.slow
@pytest.mark.parametrize("file", ["nbi", "nbc"])
@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "folder"])
def test_a_corrupt_entry_recompiles_and_later_calls_load_the_replacement(filled, tmp_path, file, how):
    cache = copy_cache(filled, tmp_path / "cache")
    index, data = entry_files(cache)
    corrupt(index if file == "nbi" else data, how)
    env = child_env(tmp_path, EPLB_CACHE_DIR=str(cache))
    out, stderr = run_child(env)
    assert out["counts"] == RIGHT and out["misses"] == 1 and WARNING not in stderr
    again, _ = run_child(env)  # the entry was replaced: loaded, not compiled
    assert again["counts"] == RIGHT and again["hits"] == 1
    assert not list(cache.rglob("*.tmp")), "a temporary file was left behind"


def test_temporary_names_are_unique_even_when_pids_repeat(tmp_path, monkeypatch):
    """Two writers of one entry at once (two containers whose processes have the same PID) never
    share a temporary file; the last rename wins whole, and nothing is left behind."""
    monkeypatch.setattr(os, "getpid", lambda: 1)
    target = tmp_path / "k.nbi"
    with _cache._atomic_writer(str(target)) as first:
        first.write(b"first " * 1000)
        with _cache._atomic_writer(str(target)) as second:
            second.write(b"second " * 1000)
            temporary = sorted(tmp_path.iterdir())
            assert len(temporary) == 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in temporary)
        assert target.read_bytes() == b"second " * 1000  # whole, the other writer's file untouched
    assert target.read_bytes() == b"first " * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.nbi"]
