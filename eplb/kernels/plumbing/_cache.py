"""Where Numba keeps the compiled code of eplb's kernels: a private per-user cache folder, never the package.

Numba's default for ``cache=True`` writes next to the source (``eplb/kernels/__pycache__``). In an
installed package that folder is not pip's: uninstalling leaves it behind, and the leftover
``site-packages/eplb`` (then a namespace package) shadows a later editable install. A read-only
install cannot cache at all. So eplb's kernels are cached in the configured folder:

1. ``$EPLB_CACHE_DIR``;
2. else ``$NUMBA_CACHE_DIR/eplb`` (Numba's own setting, so a user who moved every Numba cache finds
   eplb's there too);
3. else ``$XDG_CACHE_HOME/eplb`` (``~/.cache/eplb`` when unset);

each followed by ``numba-<Numba version>/kernels_<hash of the kernel folder's path>`` (one folder
for the kernels of every sub-package of ``eplb/kernels/``), so two installs (a wheel and a
checkout) never share files.

**Only private folders are used.** Numba's cache files are pickles: whoever can write them runs
code in the process that loads them. So a folder is used only if every folder eplb uses, from the
configured one down, is owned by this user (the effective uid) and not writable by group or
others (a symbolic link is followed only if this user owns it, and its target is checked the
same way), and every folder above it is owned by this user or root and, if others can write it,
sticky (like ``/tmp``: nobody else can rename what is inside). Folders eplb creates get mode
``0o700``; each cache file is written privately (mode ``0o600``) and loaded only if this user owns
it and nobody else can write it. When the configured folder cannot be used (it is unsafe, names a
file, or cannot be created or written, e.g. a read-only ``HOME``), eplb warns once per process
(:class:`KernelCacheWarning`, naming the folder, the setting and the reason) and falls back to
``<temp dir>/eplb-cache-<uid>`` under the same checks: a fixed name, so later processes of a
container with a read-only home still find the compiled code, and safe, since a folder another
user created first is refused (that user can deny the cache, never run code). If that fails too,
the kernels are compiled in memory with no disk cache (every process compiles again). On
platforms without POSIX owners (Windows) the owner and mode checks are not made.

**Stamps.** Each entry is stamped with a hash of the content of every kernel source
(``eplb/kernels/**/*.py``, by path relative to the package, and of the function's own file): a
compiled kernel embeds the helpers it calls from other kernel files (kernels import only from
``eplb.kernels``, which ``tests/kernels/test_cache_safety.py`` checks), so a change to any of them
recompiles every kernel, never runs stale code. The content, not the modification time an install
sets, so the shipped entries below match the installed files.

**Corrupt entries.** An index or data file that cannot be read (truncated, empty, garbage, a folder
in its place, a file of another user) is a miss: the kernel is compiled and the entry replaced.
Every file is written to a uniquely named temporary file in the same folder and renamed into place,
so processes sharing a folder (also across containers, whose PIDs can repeat) never see half a file.
A failed write leaves the compiled code running, uncached.

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
Numba's usual behaviour (the index-file class :func:`register` installs behaves as Numba's own for
any folder this module did not choose). :func:`register` runs when ``eplb.kernels`` is imported,
before any kernel module is (the locator is chosen when ``@njit(cache=True)`` is applied). Nothing
is compiled here.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import warnings

import numba
from numba.core import caching, config
from numba.core.caching import CacheImpl, IndexDataCacheFile, _CacheLocator, _SourceFileBackedLocatorMixin

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../eplb
KERNELS_DIR = os.path.join(PACKAGE_DIR, "kernels")
SHIPPED_ROOT = os.path.join(PACKAGE_DIR, "_precompiled")
MANIFEST = "manifest.json"


class KernelCacheWarning(RuntimeWarning):
    """The configured kernel cache folder cannot be used; the message says why and what is used instead."""


# ---------------------------------------------------------------------------------------------
# Which folder


def configured_root() -> tuple[str, str]:
    """``(folder, setting)``: the cache folder the environment configures and the setting that names it."""
    if os.environ.get("EPLB_CACHE_DIR"):
        return os.path.abspath(os.environ["EPLB_CACHE_DIR"]), "EPLB_CACHE_DIR"
    if config.CACHE_DIR:
        return os.path.abspath(os.path.join(config.CACHE_DIR, "eplb")), "NUMBA_CACHE_DIR"
    if os.environ.get("XDG_CACHE_HOME"):
        return os.path.abspath(os.path.join(os.environ["XDG_CACHE_HOME"], "eplb")), "XDG_CACHE_HOME"
    return os.path.abspath(os.path.join(os.path.expanduser("~"), ".cache", "eplb")), "HOME"


def temp_root() -> str:
    """The fallback folder: ``<temp dir>/eplb-cache-<uid>`` (used only if private, see the module docstring)."""
    uid = _euid()
    return os.path.join(tempfile.gettempdir(), f"eplb-cache-{uid if uid is not None else 'user'}")


# ---------------------------------------------------------------------------------------------
# Is a folder private


def _euid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def _components(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b", "/a/b/c"]``."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out[::-1]


def _unsafe_component(path: str, st: os.stat_result, own: bool) -> str | None:
    """Why folder ``path`` (``lstat`` result ``st``) may not hold or lead to cache files; ``None`` if
    it may. ``own``: a folder eplb uses itself (the cache folder and below) rather than one above."""
    uid = _euid()
    if uid is None:
        return None
    owners = (uid,) if own else (uid, 0)
    if st.st_uid not in owners:
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {uid})" + ("" if own else " or root")
    if stat.S_ISLNK(st.st_mode):
        return None  # a link this user (or root) owns: its target is checked on the resolved path
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    mode = stat.S_IMODE(st.st_mode)
    if own and mode & 0o022:
        return f"{path} is writable by group or others (mode {mode:o}; `chmod -R go-w` it to make it private)"
    if not own and mode & 0o022 and not mode & stat.S_ISVTX:
        return f"{path} is writable by other users and not sticky (mode {mode:o})"
    return None


def _unsafe_path(folder: str, root: str, create: bool) -> str | None:
    """Why ``folder`` (``root`` or inside it) may not be used; ``None`` if it may. With ``create``,
    missing folders are made (mode ``0o700``), each only after the folder above it passed."""
    for path in _components(folder):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return f"{path} does not exist"
            try:
                os.mkdir(path, 0o700)
                st = os.lstat(path)
            except FileExistsError:  # made by another process just now: checked like any other
                st = os.lstat(path)
            except OSError as error:
                return f"cannot create {path} ({error.strerror})"
        except OSError as error:
            return f"cannot read {path} ({error.strerror})"
        reason = _unsafe_component(path, st, own=os.path.commonpath([path, root]) == root)
        if reason is not None:
            return reason
    real_folder, real_root = os.path.realpath(folder), os.path.realpath(root)
    if real_folder != folder and os.path.commonpath([real_folder, real_root]) == real_root:
        return _unsafe_path(real_folder, real_root, create=False)  # a link's target, checked the same way
    if real_folder != folder:
        return f"{folder} is a link to {real_folder}, outside the cache folder {real_root}"
    return None


@functools.lru_cache(maxsize=None)
def folder_problem(folder: str, root: str) -> str | None:
    """Why cache folder ``folder`` (``root`` or inside it) cannot be used, made if missing; ``None``
    if it is private and writable (checked once per folder and process, not once per kernel)."""
    reason = _unsafe_path(folder, root, create=True)
    if reason is None:
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            reason = f"cannot write in {folder} ({error.strerror})"
    return reason


def _private_file(path: str) -> bool:
    """Whether ``path`` is a regular file this user owns and nobody else can write (a cache file to load)."""
    st = os.lstat(path)
    uid = _euid()
    return stat.S_ISREG(st.st_mode) and (uid is None or (st.st_uid == uid and not st.st_mode & 0o022))


@contextlib.contextmanager
def _atomic_writer(path: str):
    """A binary file object whose content replaces ``path`` when the block ends (a rename); nothing
    changes if the block raises. The temporary file is private and uniquely named in the same folder;
    a folder in ``path``'s place (a corrupt entry) is removed first."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)  # another process may be removing it too
    folder, name = os.path.split(path)
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)  # mode 0o600
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


# ---------------------------------------------------------------------------------------------
# Kernels shipped compiled


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
    with open(source, "rb") as data, _atomic_writer(target) as out:
        shutil.copyfileobj(data, out)


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


# ---------------------------------------------------------------------------------------------
# The folder of a source file

_CHOSEN: set[str] = set()  # the folders cache_dir handed out: GuardedIndexDataCacheFile guards these
_WARNED: set[tuple[str, str]] = set()


def _warn_once(root: str, setting: str, reason: str, used: str | None, fallback_reason: str | None) -> None:
    if (root, reason) in _WARNED:
        return
    _WARNED.add((root, reason))
    instead = (f"caching compiled kernels in {used} instead" if used is not None else
               f"the fallback cannot be used either ({fallback_reason}); compiling kernels in memory, "
               "without a disk cache (every new process compiles again)")
    warnings.warn(f"eplb: cannot use the kernel cache folder {root} (from {setting}): {reason}; {instead}",
                  KernelCacheWarning, stacklevel=_outside_stacklevel())


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside eplb, Numba and the import machinery (the
    user's line that imported or called eplb), counted from the function calling ``warnings.warn``."""
    skip = (PACKAGE_DIR + os.sep, os.path.dirname(os.path.abspath(numba.__file__)) + os.sep, "<frozen ")
    frame, level = sys._getframe(1), 1  # the frame that calls warnings.warn (stacklevel 1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
        name = frame.f_code.co_filename if frame is not None else ""
        if not ("importlib" in name and "_bootstrap" in name):  # frames warnings does not count
            level += 1
    return level if frame is not None else 1


def cache_source(py_file: str) -> str:
    """The file whose folder names the cache of ``py_file``'s kernels: ``eplb/kernels/__init__.py``
    for every file under :data:`KERNELS_DIR` (the kernels of every sub-package share one folder, as
    they share one stamp; Numba names each entry after its file, and no two files of eplb share a
    name), else ``py_file`` itself."""
    path = os.path.abspath(py_file)
    if os.path.commonpath([path, KERNELS_DIR]) == KERNELS_DIR:
        return os.path.join(KERNELS_DIR, "__init__.py")
    return py_file


def cache_dir(py_file: str) -> str | None:
    """The folder holding the compiled kernels of source file ``py_file`` (seeded from the shipped
    kernels, if any); ``None`` if no private, writable folder can be used (then a warning says why)."""
    py_file = cache_source(py_file)
    sub = _CacheLocator.get_suitable_cache_subpath(py_file)
    shipped = shipped_dir(py_file)
    if shipped is not None:
        sub += "_" + shipped[1][:16]
    configured, setting = configured_root()
    problems = []
    chosen = None
    for root in (configured, temp_root()):
        path = os.path.join(root, f"numba-{numba.__version__}", sub)
        problem = folder_problem(path, root)
        if problem is None:
            chosen = path
            break
        problems.append(problem)
    if problems:
        _warn_once(configured, setting, problems[0], chosen, problems[-1])
    if chosen is not None:
        _CHOSEN.add(chosen)
        if shipped is not None:
            seed_from_shipped(shipped[0], chosen)
    return chosen


# ---------------------------------------------------------------------------------------------
# Stamps


def kernel_sources() -> list[str]:
    """The files every kernel's compiled code may depend on: each ``.py`` under :data:`KERNELS_DIR`
    (sorted absolute paths)."""
    files = []
    for folder, dirs, names in os.walk(KERNELS_DIR):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files.extend(os.path.join(folder, name) for name in names if name.endswith(".py"))
    return sorted(files)


def source_stamp(py_file: str) -> str:
    """The stamp of the cache entries of the functions in ``py_file``: SHA-256 over the path (relative
    to the package, so independent of where it is installed) and content of each of
    :func:`kernel_sources` and of ``py_file``. The kernel sources are read once per process (all are
    imported together); ``py_file`` again whenever it changes, as Numba's own stamp does."""
    st = os.stat(py_file)
    return _stamp(_kernel_sources_hash(), os.path.abspath(py_file), st.st_mtime_ns, st.st_size)


def _file_digest(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    name = os.path.relpath(path, PACKAGE_DIR).replace(os.sep, "/")
    return hashlib.sha256(name.encode() + b"\0" + hashlib.sha256(data).digest()).digest()


@functools.lru_cache(maxsize=None)
def _kernel_sources_hash() -> str:
    digest = hashlib.sha256()
    for path in kernel_sources():
        digest.update(_file_digest(path))
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _stamp(kernels_hash: str, py_file: str, mtime_ns: int, size: int) -> str:
    # keyed by time and size too, so a file edited while the process runs is hashed again
    return hashlib.sha256(kernels_hash.encode() + _file_digest(py_file)).hexdigest()


# ---------------------------------------------------------------------------------------------
# Numba's hooks


class GuardedIndexDataCacheFile(IndexDataCacheFile):
    """Numba's index and data files, for the folders :func:`cache_dir` chose: a file that cannot be
    read, or is not this user's own private file, is a miss; every write goes through a private,
    uniquely named temporary file; a write that fails leaves the kernel uncached. ``cache_path``
    ``None`` (no usable folder): nothing is read or written. Any other folder: Numba's behaviour."""

    def __init__(self, cache_path, filename_base, source_stamp):
        self._guarded = cache_path is None or cache_path in _CHOSEN
        self._on_disk = cache_path is not None
        # os.devnull: a folder nothing can be created in, should a path of "no folder" ever be used
        super().__init__(cache_path if cache_path is not None else os.devnull, filename_base, source_stamp)

    def _load_index(self):
        if not self._guarded:
            return super()._load_index()
        if not self._on_disk:
            return {}
        try:
            if not _private_file(self._index_path):
                return {}
            overloads = super()._load_index()
        except Exception:  # missing, truncated, empty, garbage, a folder: a miss, replaced by the next save
            return {}
        return overloads if isinstance(overloads, dict) else {}

    def load(self, key):
        if not self._guarded:
            return super().load(key)
        data_name = self._load_index().get(key)
        if not isinstance(data_name, str):
            return None
        try:
            if not _private_file(self._data_path(data_name)):
                return None
            data = self._load_data(data_name)
        except Exception:  # as for the index: a miss
            return None
        return data if isinstance(data, tuple) else None

    def save(self, key, data):
        if not self._guarded:
            return super().save(key, data)
        if not self._on_disk:
            return None
        try:
            super().save(key, data)
        except OSError:  # disk full, folder removed: the compiled code runs, uncached
            pass
        return None

    def flush(self):
        if self._on_disk:
            super().flush()

    def _open_for_write(self, filepath):
        if not self._guarded:
            return super()._open_for_write(filepath)
        return _atomic_writer(filepath)


class EplbCacheLocator(_SourceFileBackedLocatorMixin, _CacheLocator):
    """Numba cache locator for functions defined in eplb's own source files (see module docstring).
    ``path`` ``None``: no private folder could be used, the function is compiled in memory."""

    def __init__(self, py_func, py_file, path):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = path

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        # the content of every kernel source, whatever the Numba version: a kernel embeds the helpers
        # it calls, and shipped entries must match the installed files, whose modification times the
        # install sets
        return source_stamp(self._py_file)

    def ensure_cache_path(self):
        pass  # checked when chosen (cache_dir); a write that fails later leaves the kernel uncached, never raises

    @classmethod
    def from_function(cls, py_func, py_file):
        if not (os.path.exists(py_file) and _in_package(py_file)):
            return None  # not eplb's: the next locator (Numba's usual ones) decides
        return cls(py_func, py_file, cache_dir(py_file))


def _in_package(py_file: str) -> bool:
    path = os.path.abspath(py_file)
    return os.path.commonpath([path, PACKAGE_DIR]) == PACKAGE_DIR


def register() -> None:
    """Put :class:`EplbCacheLocator` first in Numba's locator list and have Numba's caches use
    :class:`GuardedIndexDataCacheFile` (once)."""
    if EplbCacheLocator not in CacheImpl._locator_classes:
        CacheImpl._locator_classes.insert(0, EplbCacheLocator)
    caching.IndexDataCacheFile = GuardedIndexDataCacheFile
