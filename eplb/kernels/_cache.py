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
two installs (a wheel and a checkout) never share files. Numba still checks each entry against a
hash of its source file, so a stale entry is recompiled, never used.

The locator applies to functions defined in this package's files only; every other package keeps
Numba's usual behaviour. :func:`register` runs when ``eplb.kernels`` is imported, before any kernel
module is (the locator is chosen when ``@njit(cache=True)`` is applied). Nothing is compiled here.
"""

from __future__ import annotations

import functools
import getpass
import os
import tempfile

import numba
from numba.core import config
from numba.core.caching import CacheImpl, _CacheLocator, _SourceFileBackedLocatorMixin

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../eplb


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


def cache_dir(py_file: str) -> str | None:
    """The folder holding the compiled kernels of source file ``py_file``; ``None`` if no candidate
    folder is writable."""
    sub = _CacheLocator.get_suitable_cache_subpath(py_file)
    for root in cache_roots():
        path = os.path.join(root, sub)
        if _writable(path):
            return path
    return None


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
