"""Progress of a long command on stderr, for the person waiting on it.

The long computations (:func:`eplb.recommend`, :func:`eplb.sweep`, :func:`eplb.simulate`,
:func:`eplb.compare`) take a ``progress`` callback and call it as ``progress(done, total, note)``:
``done`` of ``total`` steps finished, ``note`` what runs now (or ``""``). :class:`Progress` is such
a callback for the command line. On a terminal it draws a tqdm bar, redrawn every :data:`TICK_S`
seconds so that its clock moves through a long step; elsewhere (a log file, CI, a pipe) it writes
a line per step with the time so far and an estimate of the time left, at most one every
:data:`LINE_EVERY_S` seconds (the first and the last always), e.g.::

    eplb recommend: 4/13 steps (fold 2 of 4); 34 s so far, about 1 min 17 s left

Everything goes to stderr: stdout keeps only the command's results. Quiet commands draw nothing.
"""

from __future__ import annotations

import sys
import threading
import time

LINE_EVERY_S = 1.0
"""Seconds at least between two progress lines when stderr is not a terminal."""

TICK_S = 1.0
"""Seconds between redraws of a terminal's bar while a step runs (its clock keeps moving)."""


def duration(seconds: float) -> str:
    """``seconds`` as ``"7 s"``, ``"1 min 42 s"`` or ``"2 h 05 min"``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """A ``progress(done, total, note)`` callback that shows ``eplb COMMAND``'s progress on stderr.

    Args:
        command: the command's name, which starts every line.
        unit: what a step is, in the plural (``"steps"``, ``"runs"``, ``"methods"``).
        quiet: show nothing (the command's ``--quiet``).
        stream: where to write (default: ``sys.stderr`` when called).
        terminal: draw a bar (True) or write lines (False); default: whether ``stream`` is a terminal.

    Use it as a context manager: leaving it closes the bar (or writes nothing more).
    """

    def __init__(self, command: str, *, unit: str = "steps", quiet: bool = False, stream=None,
                 terminal: bool | None = None):
        self.command, self.unit, self.quiet = command, unit, quiet
        self.stream = sys.stderr if stream is None else stream
        self.terminal = (hasattr(self.stream, "isatty") and self.stream.isatty()) if terminal is None else terminal
        self.started = time.monotonic()
        self._bar = None
        self._closed = threading.Event()
        self._last_line: float | None = None
        self._last_done = -1

    def __call__(self, done: int, total: int, note: str = "") -> None:
        if self.quiet:
            return
        if self.terminal:
            self._draw(done, total, note)
        else:
            self._line(done, total, note)

    def _draw(self, done: int, total: int, note: str) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=total, desc=f"eplb {self.command}", unit=f" {self.unit}", file=self.stream,
                             leave=False, dynamic_ncols=True)
            threading.Thread(target=self._tick, args=(self._bar,), daemon=True, name="eplb-progress").start()
        bar = self._bar
        bar.total = total
        bar.n = done
        bar.set_postfix_str(note, refresh=False)
        bar.refresh()

    def _line(self, done: int, total: int, note: str) -> None:
        now = time.monotonic()
        finished = done >= total
        due = self._last_line is None or now - self._last_line >= LINE_EVERY_S or (finished and done != self._last_done)
        if not due:
            return
        elapsed = now - self.started
        if finished:
            timing = f"done in {duration(elapsed)}"
        elif done > 0:
            timing = f"{duration(elapsed)} so far, about {duration(elapsed / done * (total - done))} left"
        else:
            timing = f"{duration(elapsed)} so far"
        what = f" ({note})" if note and not finished else ""
        print(f"eplb {self.command}: {done}/{total} {self.unit}{what}; {timing}", file=self.stream, flush=True)
        self._last_line, self._last_done = now, done

    def _tick(self, bar) -> None:
        """Redraw ``bar`` every :data:`TICK_S` seconds until :meth:`close`."""
        while not self._closed.wait(TICK_S):
            bar.refresh()

    def close(self) -> None:
        """Remove the bar from the terminal (lines stay as written)."""
        self._closed.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def offset(progress, before: int, total: int, note: str = ""):
    """A callback for one part of a longer run: ``progress`` told ``before + done`` of ``total``,
    the part's own ``note`` (e.g. which policy) before the one it reports; ``None`` passes through."""
    if progress is None:
        return None

    def report(done: int, _part_total: int, part_note: str = "") -> None:
        progress(before + done, total, ", ".join(text for text in (note, part_note) if text))

    return report
