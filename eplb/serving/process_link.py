"""What a balancer running in a worker process needs on both ends, written once for
:class:`~eplb.serving.worker.BalancerProcess` (requests answered in turn) and
:class:`~eplb.serving.background.BackgroundBalancer` (events posted, never waited for).

- Starting: the ``spawn`` or ``forkserver`` context (:data:`CONTEXTS`, never ``fork``), the guard
  against a caller's unguarded main module (:func:`stop_unguarded_worker`), the construction
  handshake over a pipe (:meth:`WorkerLink.answer`, :meth:`WorkerBalancer._handshake`) and the
  shared block handed to the worker (:meth:`WorkerBalancer._share`).
- Messages: pickled with placements by their fields (:func:`dumps`), an exception raised in the
  worker raised again in the caller with the worker's traceback as its cause
  (:func:`error_message`, :func:`raise_remote`); a message too large for the shared area goes
  through the pipe (:func:`place`, :func:`take`).
- Stopping: asked, then terminated, then killed, the shared memory freed
  (:meth:`WorkerLink.shutdown`); a worker that died is an error naming its pid and exit code
  (:meth:`WorkerLink.died`); close, context manager and copy refusal (:class:`WorkerBalancer`).
- The worker's side: build the balancer, send its attributes, map the block, run the loop, exit
  without the interpreter's slow teardown (:func:`serve`).
"""

from __future__ import annotations

import copyreg
import inspect
import io
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
import weakref
from multiprocessing import shared_memory

import numpy as np

from ..analysis.placement import Placement
from ..model.deployment import DEPLOYMENT_KEYWORDS, deployment_argument
from .balancer import Balancer

CONTEXTS = ("spawn", "forkserver")
"""The ``multiprocessing`` start methods a balancer with a worker process accepts (not ``fork``)."""

POLL_S = 0.25
"""Seconds between checks that the other process is still alive while waiting for it."""

PROTOCOL = 5

IN_PIPE = -1
"""A message length meaning "too large for the shared area: read it from the pipe"."""

UNGUARDED_MAIN_EXIT = 87
"""Exit code of a worker whose import of the caller's main module would start another worker."""

UNGUARDED_MAIN = ("a {kind} was created while its worker process imported the main module: with the "
                  "'spawn' and 'forkserver' start methods the worker imports the caller's main script again, and "
                  "creating a {kind} there would start workers without end. Put the script's code that "
                  "creates it under  if __name__ == \"__main__\":  (see 'Safe importing of main module' in "
                  "Python's multiprocessing documentation)")


def exit_code(process, timeout: float) -> int | None:
    """``process``'s exit code once it is known, waiting up to ``timeout`` seconds (``None`` after).

    Read once into a local: a closed pipe or sentinel can come before the exit status is ready, and
    a watchdog thread's ``join`` may reap the process first, in which case this thread's own
    ``waitpid`` fails and ``exitcode`` reads ``None`` until the other thread has stored it."""
    deadline = time.monotonic() + timeout
    code = process.exitcode
    while code is None and time.monotonic() < deadline:
        process.join(0.05)
        code = process.exitcode
    return code


def refuse_copy(kind: str):
    """Raise the ``TypeError`` that :func:`copy.copy`, :func:`copy.deepcopy` and :mod:`pickle` of a
    ``kind`` (a balancer with a worker process) get.

    Refused, not copied: a copy would share the worker process and its shared memory (closing either
    would stop the other's worker while it still says ``closed == False``), and a copy with a worker
    of its own would have to start a process and replay the state, which a copy must not do unasked."""
    raise TypeError(f"a {kind} cannot be copied or pickled: it owns a worker process and shared memory, which a "
                    f"copy would share. Start another from its state: {kind}.from_state_dict(balancer.state_dict())")


def stop_unguarded_worker(kind: str) -> None:
    """In a worker importing the caller's unguarded main module (spawn, forkserver), stop that
    worker with a code its parent turns into :data:`UNGUARDED_MAIN` (no multiprocessing
    traceback); a forkserver's server (it has no channel to the caller) says it on stderr."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        if "multiprocessing.forkserver" in sys.modules:
            print(f"eplb: {UNGUARDED_MAIN.format(kind=kind)}", file=sys.stderr)
        raise SystemExit(UNGUARDED_MAIN_EXIT)


# -- messages ----------------------------------------------------------------------------------
def _reduce_placement(placement: Placement):
    """Pickle a :class:`Placement` by its fields (its ``info`` is a read-only mapping, which pickle
    refuses; lazily computed diagnostics not yet computed are dropped)."""
    state = {key: (None if callable(value) else value) for key, value in placement.__dict__.items()}
    state["info"] = dict(state["info"])
    return _rebuild_placement, (state,)


def _rebuild_placement(state: dict) -> Placement:
    """The :class:`Placement` of :func:`_reduce_placement`'s ``state`` (arrays read-only, as built)."""
    placement = Placement.__new__(Placement)
    placement.__setstate__(state)
    return placement


def dumps(obj) -> bytes:
    """``obj`` pickled (protocol 5), placements included."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, Placement: _reduce_placement}
    pickler.dump(obj)
    return out.getvalue()


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in the worker process (the cause of the one raised here)."""

    def __str__(self) -> str:
        return self.args[0]


def error_message(exc: BaseException) -> tuple:
    """``("error", exc, traceback text)`` with ``exc`` replaced by a ``RuntimeError`` naming it when it
    cannot be pickled."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc, protocol=PROTOCOL))
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return ("error", exc, text)


def raise_remote(exc: BaseException, text: str):
    raise exc from _RemoteTraceback(f"\n\nin the eplb worker process:\n{text}")


def place(data: bytes, area: memoryview, header: np.ndarray, field: int) -> bool:
    """Write message ``data`` into the shared ``area`` and its length into ``header[field]``, or
    :data:`IN_PIPE` there when it does not fit; returns whether it must go through the pipe (after
    the other side has been told, so that it reads the pipe while the writer blocks on it)."""
    if len(data) <= len(area):
        area[:len(data)] = data
        header[field] = len(data)
        return False
    header[field] = IN_PIPE
    return True


def take(size: int, area: memoryview, receive):
    """The message of length ``size`` in ``area`` (or, for :data:`IN_PIPE`, ``receive()``'s bytes), unpickled."""
    return pickle.loads(receive() if size == IN_PIPE else area[:size])


def proposal_bytes(num_layers: int, num_experts: int, num_slots: int) -> int:
    """About the bytes of one pickled proposal: phy2log and a transfer plan ``[L, S]`` each and
    log2phy ``[L, E, R]`` with ``R <= S - E + 1``."""
    return 8 * num_layers * (9 * num_slots + num_experts * (num_slots - num_experts + 2))


def ring_rows(staging_rows: int | None, row_bytes: int, budget: int, fewest: int, most: int) -> int:
    """Rows of the staging ring: ``staging_rows`` as asked, else ``budget`` bytes' worth of rows of
    ``row_bytes``, from ``fewest`` to ``most``."""
    return int(staging_rows) if staging_rows is not None else max(fewest, min(most, budget // row_bytes))


# -- the worker's construction ---------------------------------------------------------------------
def plain_state(state):
    """A state dict as sent to the worker: a mapping that is not a dict (``np.load``'s file) as a
    dict of its arrays; anything else as it is (the worker's balancer judges it)."""
    if not isinstance(state, dict) and hasattr(state, "items"):
        return dict(state.items())
    return state


BALANCER_KEYWORDS = tuple(name for name, parameter in inspect.signature(Balancer.__init__).parameters.items()
                          if parameter.kind is inspect.Parameter.KEYWORD_ONLY)


def balancer_arguments(caller: str, num_layers, deployment, kwargs: dict, own: str) -> tuple:
    """What a worker builds its :class:`Balancer` from: ``("init", (num_layers, deployment),
    keywords)``, the deployment resolved here (:func:`eplb.model.deployment.deployment_argument`: its
    deprecated keywords warn in the caller's code, not the worker's) and a keyword neither the
    Balancer nor ``caller`` takes (``own``: its own, for the message) a ``TypeError`` naming it."""
    spelled = {name: kwargs.pop(name) for name in DEPLOYMENT_KEYWORDS if name in kwargs}
    unknown = sorted(set(kwargs) - set(BALANCER_KEYWORDS))
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword arguments {unknown}; it takes eplb.Balancer's "
                        f"keywords {sorted(BALANCER_KEYWORDS)} and {own}")
    return "init", (num_layers, deployment_argument(deployment, spelled, caller, stacklevel=4)), kwargs


def from_state_arguments(state, compile: str, cost_model, horizon) -> tuple:
    """What a worker builds its balancer from for ``from_state_dict``."""
    return "from_state", plain_state(state), dict(compile=compile, cost_model=cost_model, horizon=horizon)


def build_balancer(construct: tuple) -> Balancer:
    kind, args, kwargs = construct
    if kind == "init":
        return Balancer(*args, **kwargs)
    return Balancer.from_state_dict(args, **kwargs)


def eplb_file() -> str:
    """This module's file: the parent and the worker must run the same copy of eplb."""
    return os.path.realpath(__file__)


# -- the shared block and the caller's end -------------------------------------------------------
class SharedBlock:
    """Views of a shared block both processes build from the same layout: ``header`` (int64
    fields), the staging ``ring`` (``float64 [rows, row_size]``) and the message ``area``; a
    subclass adds its own views (NumPy arrays or memoryviews: :meth:`release` drops them all)."""

    HEADER_FIELDS = 16

    def __init__(self, shm: shared_memory.SharedMemory, layout: dict):
        self.shm, self.layout = shm, layout
        buf = shm.buf
        self.header = np.ndarray((self.HEADER_FIELDS,), np.int64, buf, 0)
        self.ring = np.ndarray((layout["rows"], layout["row_size"]), np.float64, buf, layout["ring"])
        self.area = buf[layout["message"]:layout["message"] + layout["area"]]

    def release(self, unlink: bool) -> None:
        """Drop every view, then close (and ``unlink``: remove) the block."""
        for name, value in list(vars(self).items()):
            if isinstance(value, np.ndarray):
                setattr(self, name, None)
        for name, value in list(vars(self).items()):
            if isinstance(value, memoryview):
                value.release()
                setattr(self, name, None)
        try:
            self.shm.close()
        except BufferError:  # a view is still referenced somewhere: the mapping goes with it
            pass
        if unlink:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


class WorkerLink:
    """The caller's end of one worker: the process (started with ``target(child_conn, *args)``),
    the pipe and the shared block (``shared``, once handed over); ``kind`` names the caller's class
    in errors. A subclass says how to ask its worker to close (:meth:`ask_to_close`)."""

    def __init__(self, context: str, kind: str, target, args: tuple, name: str):
        ctx = multiprocessing.get_context(context)
        self.kind = kind
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child_conn, *args), name=name, daemon=True)
        self.process.start()
        child_conn.close()
        self.shared: SharedBlock | None = None
        self.broken: str | None = None

    def send(self, data: bytes) -> None:
        try:
            self.conn.send_bytes(data)
        except (BrokenPipeError, ConnectionError, OSError):
            raise self.died() from None

    def receive(self) -> bytes:
        while not self.conn.poll(POLL_S):
            if not self.process.is_alive():
                raise self.died()
        try:
            return self.conn.recv_bytes()
        except (EOFError, ConnectionError, OSError):
            raise self.died() from None

    def answer(self):
        """The worker's next answer over the pipe (``("ok", value)``: ``value``); its error raised here."""
        kind, *rest = pickle.loads(self.receive())
        if kind == "error":
            raise_remote(*rest)
        return rest[0]

    def died(self) -> RuntimeError:
        """Mark the link broken and return the error for a worker that ended: what to add to an
        unguarded script, else its pid and exit code."""
        code = exit_code(self.process, 30.0)  # it closed its end: it is exiting (slowly on a busy machine)
        if code == UNGUARDED_MAIN_EXIT:
            self.broken = UNGUARDED_MAIN.format(kind=self.kind)
        else:
            self.broken = (f"the eplb worker process (pid {self.process.pid}) died (exit code {code}); this "
                           f"{self.kind} cannot be used any more")
        return RuntimeError(self.broken)

    def ask_to_close(self) -> None:
        """Tell the live worker to end its loop (a subclass's request or event)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the worker (asked, then terminated, then killed) and free the shared memory."""
        process = self.process
        ask = self.broken is None and self.shared is not None and process.is_alive()
        self.broken = f"this {self.kind} is closed"
        try:
            if ask:
                self.ask_to_close()
            process.join(2.0)
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
        finally:
            if self.shared is not None:
                self.shared.release(unlink=True)
                self.shared = None
            self.conn.close()


class WorkerBalancer:
    """What :class:`~eplb.serving.worker.BalancerProcess` and
    :class:`~eplb.serving.background.BackgroundBalancer` share as objects: checking the start
    arguments, starting the worker with a finalizer that stops it, the handshake, sharing the
    block, :meth:`close` (also a context manager) and refusing copies. The link is ``_channel``."""

    def _check_start(self, context: str, staging_rows) -> None:
        stop_unguarded_worker(type(self).__name__)
        if context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS} (fork is unsafe beside threads and CUDA), "
                             f"got {context!r}")
        if staging_rows is not None and (isinstance(staging_rows, bool) or not isinstance(staging_rows, (int, np.integer))
                                         or staging_rows < 2):
            raise ValueError(f"staging_rows must be an integer >= 2 or None, got {staging_rows!r}")

    def _launch(self, link: WorkerLink, construct: tuple, staging_rows) -> None:
        """Connect the new worker behind ``link`` (:meth:`_connect`, the subclass's), stopping it if that fails."""
        self._channel = None
        self._finalizer = weakref.finalize(self, link.shutdown)
        try:
            self._connect(link, construct, staging_rows)
        except BaseException:
            self._finalizer()
            raise
        self._channel = link

    def _connect(self, link: WorkerLink, construct: tuple, staging_rows) -> None:
        raise NotImplementedError

    @staticmethod
    def _handshake(link: WorkerLink, construct: tuple) -> dict:
        """Have the worker build its balancer from ``construct``; its attributes (same eplb checked)."""
        link.send(dumps(construct))
        attributes = link.answer()
        if attributes.pop("eplb_file") != eplb_file():
            raise RuntimeError("the worker process imported another eplb than this process: pass the same sys.path")
        return attributes

    @staticmethod
    def _share(link: WorkerLink, block_class, layout: dict) -> SharedBlock:
        """Create the shared block (``block_class`` views laid out as ``layout``), touch its staging
        rows (not on record()'s first pass through the ring) and wait until the worker mapped it."""
        shm = shared_memory.SharedMemory(create=True, size=layout["size"])
        try:
            block = block_class(shm, layout)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        link.shared = block  # from here on, the link's shutdown frees it
        block.ring[...] = 0
        link.send(pickle.dumps((shm.name, layout), protocol=PROTOCOL))
        link.answer()
        return block

    def close(self) -> None:
        """Stop the worker process and free the shared memory (idempotent)."""
        if self.__dict__.get("_channel") is not None:
            self._channel = None
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self.__dict__.get("_channel") is None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol):
        refuse_copy(type(self).__name__)


# -- the worker's end ----------------------------------------------------------------------------
def serve(conn, attributes: tuple[str, ...], block_class, run) -> None:
    """The worker process: build the balancer (the first message on ``conn``), send its
    ``attributes``, map the shared block, then ``run(balancer, block, parent pid)`` until it returns
    (told to close, or the caller is gone); exit at once (:func:`exit_now`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    parent = os.getppid()
    try:
        balancer = build_balancer(pickle.loads(conn.recv_bytes()))
        values = {name: getattr(balancer, name) for name in attributes}
        conn.send_bytes(dumps(("ok", {**values, "eplb_file": eplb_file()})))
        name, layout = pickle.loads(conn.recv_bytes())
        block = block_class(shared_memory.SharedMemory(name=name), layout)
    except BaseException as exc:  # noqa: BLE001 (handed to the caller)
        conn.send_bytes(dumps(error_message(exc)))
        exit_now()
    conn.send_bytes(dumps(("ok", None)))
    try:
        run(balancer, block, parent)
    finally:
        block.release(unlink=False)
    exit_now()


def exit_now() -> None:
    """End the worker process now: the interpreter's own teardown (Numba's, LLVM's) takes half a
    second, which closing the balancer would wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
