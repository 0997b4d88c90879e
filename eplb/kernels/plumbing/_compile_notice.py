"""One line on stderr when eplb's kernels take more than a couple of seconds to compile.

Numba compiles a kernel on its first call and caches it on disk (:mod:`eplb.kernels.plumbing._cache`). An
installed wheel ships the kernels of common deployments compiled, but Python started inside the
repository imports the checkout, which ships none: its first plan compiles for tens of seconds. So
that such a wait is never silent, the first time the compiles of eplb's kernels in a process have
taken :data:`NOTICE_AFTER` seconds (summed over the compiles, counted while one runs: a timer fires
during a long compile, not after it), one line goes to the ``eplb`` logger at ``WARNING`` level.
With no logging configured Python prints it on stderr as it is; an application that configures
logging gets it in its own log. Once per process; ``EPLB_COMPILE_NOTICE=0`` turns it off.

Only compiles count (Numba reports a compile, not a load from the cache, as a ``numba:compile``
event), and only those of functions defined in eplb (other packages' kernels are theirs to announce).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from numba.core import event

#: seconds of compiling after which the line is printed
NOTICE_AFTER = 2.0
LOGGER = logging.getLogger("eplb")


def notice_text(shipped: bool, package_dir: str) -> str:
    """The line: why the process waits, and whether this eplb ships compiled kernels at all."""
    if shipped:
        return ("eplb: compiling Numba kernels on first use, once (later processes load them from the disk cache; "
                "`eplb warmup` compiles a deployment's kernels ahead of time)")
    return (f"eplb: compiling Numba kernels on first use, tens of seconds once (the eplb imported from {package_dir} "
            "is a checkout or editable install, which ships none compiled; later processes load them from the disk "
            "cache, and `pip install .` ships common ones compiled)")


def _is_eplb(event_) -> bool:
    dispatcher = (event_.data or {}).get("dispatcher")
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
    return module == "eplb" or module.startswith("eplb.")


class CompileNotice(event.Listener):
    """A Numba event listener that calls ``say()`` once, when the compiles ``counts(event)``
    accepts have run ``after`` seconds in all. Nested compiles (a kernel's callees, compiled with
    it) count once, as the outermost one's time."""

    def __init__(self, say, after: float = NOTICE_AFTER, counts=_is_eplb):
        self._say, self._after, self._counts = say, float(after), counts
        self._lock = threading.Lock()
        self._depth = 0
        self._spent = 0.0
        self._since = None
        self._timer = None
        self.said = False

    def on_start(self, event_) -> None:
        if not self._counts(event_):
            return
        with self._lock:
            self._depth += 1
            if self._depth > 1 or self.said:
                return
            self._since = time.perf_counter()
            self._timer = threading.Timer(max(0.0, self._after - self._spent), self._fire)
            self._timer.daemon = True
            self._timer.start()

    def on_end(self, event_) -> None:
        if not self._counts(event_):
            return
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth or self._since is None:
                return
            self._spent += time.perf_counter() - self._since
            self._since = None
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        with self._lock:
            if self.said or self._since is None:
                return
            self.said = True
        self._say()


_INSTALLED: list[CompileNotice] = []


def install(shipped: bool, package_dir: str) -> CompileNotice | None:
    """Register the listener for this process (once); ``None`` when ``EPLB_COMPILE_NOTICE=0``."""
    if os.environ.get("EPLB_COMPILE_NOTICE", "1").strip() == "0":
        return None
    if not _INSTALLED:
        text = notice_text(shipped, package_dir)
        listener = CompileNotice(lambda: LOGGER.warning(text))
        event.register("numba:compile", listener)
        _INSTALLED.append(listener)
    return _INSTALLED[0]
