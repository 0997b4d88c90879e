"""Where Numba keeps the compiled code of eplb's kernels: a per-user cache folder, never the package.

Numba's default for ``cache=True`` writes next to the source (``eplb/kernels/__pycache__``). In an
installed package that folder is not pip's: uninstalling leaves it behind, and the leftover
``site-packages/eplb`` (then a namespace package) shadows a later editable install. A read-only
install cannot cache at all. So eplb's kernels are cached in, by precedence:

1. ``$EPLB_CACHE_DIR``;
2. ``$NUMBA_CACHE_DIR/eplb`` (Numba's own setting, so a user who moved every Numba cache finds
   eplb's there too);
3. ``$XDG_CACHE_HOME/eplb`` (``~/.cache/eplb`` when unset);
4. ``<temp dir>/eplb-cache-<user>``, when none of the above can be created or written;

each followed by ``numba-<Numba version>/<folder name>_<hash of the source folder's path>``, so
two installs (a wheel and a checkout) never share files. Each entry is stamped with a hash of its
source file's content, whatever the Numba version (some stamp the modification time, which an
install changes), so a stale entry is recompiled, never used.

**Kernels shipped compiled.** Building a wheel (``pip install .``) compiles the kernels of three
deployments (:func:`eplb.precompile.ship`, run by the build step in ``eplb/_build.py``) and
ships Numba's cache files in ``eplb/_precompiled/numba-<version>-<interpreter>/``. On a machine
whose Numba, Python and CPU match the build's (a source install builds where it installs), a
fresh process's first call then loads compiled code instead of compiling: the first time a
kernel folder's cache is located, the shipped files are copied into the user's cache folder
(whose name then also carries the shipped files' id, so an upgrade never meets the previous
version's entries). Only missing entries are copied, data files before their index, each by an
atomic rename, so processes starting together (every rank of an engine) copy safely. Anything
that does not match (another CPU, a kernel called with new argument types) compiles as before.

The locator applies to functions defined in this package's files only; every other package keeps
Numba's usual behaviour. :func:`register` runs when ``eplb.kernels`` is imported, before any kernel
module is (the locator is chosen when ``@njit(cache=True)`` is applied). Nothing is compiled here.
"""

from __future__ import annotations

import functools
import getpass
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile

import numba
from numba.core import config
from numba.core.caching import CacheImpl, _CacheLocator, _SourceFileBackedLocatorMixin

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../eplb
SHIPPED_ROOT = os.path.join(PACKAGE_DIR, "_precompiled")
MANIFEST = "manifest.json"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (containers with an arbitrary uid)
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


def cache_roots() -> list[str]:
    """The candidate folders for eplb's kernels, best first (read from the environment each call)."""
    roots = []
    if os.environ.get("EPLB_CACHE_DIR"):
        roots.append(os.environ["EPLB_CACHE_DIR"])
    elif config.CACHE_DIR:
        roots.append(os.path.join(config.CACHE_DIR, "eplb"))
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        roots.append(os.path.join(xdg, "eplb"))
    roots.append(os.path.join(tempfile.gettempdir(), f"eplb-cache-{_user()}"))
    return [os.path.join(os.path.abspath(root), f"numba-{numba.__version__}") for root in roots]


@functools.lru_cache(maxsize=None)
def _writable(path: str) -> bool:
    """Whether ``path`` exists (created if needed) and a file can be written in it (checked once per
    folder and process, not once per kernel)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def shipped_tag() -> str:
    """The folder of :data:`SHIPPED_ROOT` whose files this interpreter and Numba can load."""
    return f"numba-{numba.__version__}-{sys.implementation.cache_tag}"


@functools.lru_cache(maxsize=None)
def shipped_id(tag_dir: str) -> str | None:
    """The id of the compiled kernels shipped in ``tag_dir`` (from its manifest); ``None`` if none."""
    try:
        with open(os.path.join(tag_dir, MANIFEST)) as f:
            return str(json.load(f)["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def shipped_dir(py_file: str) -> tuple[str, str] | None:
    """``(folder, id)``: the compiled kernels shipped for source file ``py_file``'s folder and the
    id of the shipped set; ``None`` if the package ships none for this Numba and interpreter."""
    tag_dir = os.path.join(SHIPPED_ROOT, shipped_tag())
    folder = os.path.join(tag_dir, os.path.basename(os.path.dirname(os.path.abspath(py_file))))
    found = shipped_id(tag_dir)
    return (folder, found) if found and os.path.isdir(folder) else None


def _copy_atomically(source: str, target: str) -> None:
    temp = f"{target}.{os.getpid()}.tmp"
    shutil.copyfile(source, temp)
    os.replace(temp, target)


@functools.lru_cache(maxsize=None)
def seed_from_shipped(shipped: str, path: str) -> int:
    """Copy into cache folder ``path`` every shipped entry it lacks (data files, then the index that
    names them, so a reader never sees an index without its data); the number of indexes copied.
    Once per folder and process; a failed copy leaves the entry to be compiled."""
    copied = 0
    for index in sorted(glob.glob(os.path.join(glob.escape(shipped), "*.nbi"))):
        name = os.path.basename(index)
        if os.path.exists(os.path.join(path, name)):
            continue
        try:
            for data in sorted(glob.glob(glob.escape(index[:-len(".nbi")]) + ".*.nbc")):
                _copy_atomically(data, os.path.join(path, os.path.basename(data)))
            _copy_atomically(index, os.path.join(path, name))
            copied += 1
        except OSError:
            continue
    return copied


def cache_dir(py_file: str) -> str | None:
    """The folder holding the compiled kernels of source file ``py_file`` (seeded from the shipped
    kernels, if any); ``None`` if no candidate folder is writable."""
    sub = _CacheLocator.get_suitable_cache_subpath(py_file)
    shipped = shipped_dir(py_file)
    if shipped is not None:
        sub += "_" + shipped[1][:16]
    for root in cache_roots():
        path = os.path.join(root, sub)
        if _writable(path):
            if shipped is not None:
                seed_from_shipped(shipped[0], path)
            return path
    return None


def source_hash(py_file: str) -> str:
    """SHA-256 of a source file's content: the stamp of its cache entries."""
    st = os.stat(py_file)
    return _content_hash(py_file, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=None)
def _content_hash(py_file: str, mtime_ns: int, size: int) -> str:
    # keyed by time and size too, so a file edited while the process runs is hashed again
    with open(py_file, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _in_package(py_file: str) -> bool:
    path = os.path.abspath(py_file)
    return os.path.commonpath([path, PACKAGE_DIR]) == PACKAGE_DIR


class EplbCacheLocator(_SourceFileBackedLocatorMixin, _CacheLocator):
    """Numba cache locator for functions defined in eplb's own source files (see module docstring)."""

    def __init__(self, py_func, py_file, path):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = path

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        # the content, whatever the Numba version: shipped entries must match the installed
        # files, whose modification times the install sets
        return source_hash(self._py_file)

    def ensure_cache_path(self):
        if not _writable(self._cache_path):
            raise OSError(f"cannot write Numba's cache for eplb in {self._cache_path}")

    @classmethod
    def from_function(cls, py_func, py_file):
        if not (os.path.exists(py_file) and _in_package(py_file)):
            return None  # not eplb's: the next locator (Numba's usual ones) decides
        path = cache_dir(py_file)
        if path is None:
            return None
        return cls(py_func, py_file, path)


def register() -> None:
    """Put :class:`EplbCacheLocator` first in Numba's locator list (once)."""
    if EplbCacheLocator not in CacheImpl._locator_classes:
        CacheImpl._locator_classes.insert(0, EplbCacheLocator)
