"""A :class:`~eplb.serving.balancer.Balancer` that plans in a worker process, so the caller's threads
never wait for the GIL while it plans.

Beside a busy Python thread (an engine's scheduler), an in-process rebalance waits up to one switch
interval (5 ms by default) every time a NumPy call or kernel hands the GIL back, and a rebalance
makes dozens of them (``bench/background_thread.py``). :class:`BalancerProcess` runs a real
``Balancer`` in a child process started with ``multiprocessing``'s ``"spawn"`` (or
``"forkserver"``) context, never ``fork`` (unsafe in a process with threads or CUDA), and talks to
it through shared memory:

- :meth:`BalancerProcess.record` checks a pass and copies it (one NumPy copy to float64, one check
  kernel) into a ring of staging rows in shared memory, then posts a semaphore; the child takes the
  rows into its ``Balancer`` in order, on its own core;
- every other call writes a small pickled request into shared memory (how many rows to take in
  first, the method, its arguments), posts the semaphore and waits on another for the answer,
  which the child writes back into shared memory (a :class:`~eplb.Placement` and its
  :class:`~eplb.TransferPlan` take about a megabyte at DeepSeek-V3 size); answers too large for
  the shared area (a state dict) go through a pipe. Posting a semaphore and copying bytes keep
  the GIL, so a rebalance hands the GIL back once, while it waits for the child.

Getting the GIL back after that one wait still costs a switch interval beside a busy thread; while
it waits and reads the answer, the caller lowers the interpreter's switch interval to
``gil_interval`` (restored right after; ``None`` leaves it alone), so it gets the GIL back within
that instead. (Restoring it as soon as the GIL is back is not enough: the busy thread, forced to
hand the GIL over, waits the short interval for its turn and takes the GIL back before the answer
is read; the caller would then wait a full interval.)

The child receives the same calls in the same order as an in-process ``Balancer`` fed the same
:meth:`~BalancerProcess.record` calls would, so placements, decisions, transfer plans and state
dicts are identical. An exception in the child is raised in the caller with its type and message
(the child's traceback as its cause); a child that died raises ``RuntimeError`` naming its pid and
exit code at the next call (:meth:`~BalancerProcess.record` included: one ``waitpid`` that does not
wait, under a microsecond). A script that creates a ``BalancerProcess`` outside an ``if __name__ ==
"__main__":`` guard gets a ``RuntimeError`` saying to add it.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import sys
import threading
import time

import numpy as np

from ..analysis.placement import Placement
from ..kernels.plumbing.load_window import warm_copy_counts
from .balancer import Balancer
from .balancer_change import change_for
from .pass_counts import check_counts, fold_pass, pass_count_limit, stage_counts
from .process_link import (POLL_S, SharedBlock, WorkerBalancer, WorkerLink, balancer_arguments, dumps,
                           error_message, from_state_arguments, place, plain_state, proposal_bytes, raise_remote,
                           ring_rows, serve, take)
from .transfer import TransferPlan

GIL_INTERVAL = 0.0005
"""Seconds: the switch interval the caller's interpreter runs with while it waits for the child
(see :class:`BalancerProcess`)."""

STAGING_BYTES = 16 << 20
"""Bytes of shared memory for staged passes unless ``staging_rows`` says otherwise."""

# the shared block: a header of int64 fields, the staged rows' kinds, the staged rows, the message area
_REQUEST_SEQ, _REPLY_SEQ, _RECORDED, _INGESTED, _REQUEST_ROWS, _REQUEST_LEN, _REPLY_LEN = range(7)
_CONFIG_ATTRIBUTES = ("num_layers", "num_experts", "topology", "num_groups", "window", "decay", "forecast",
                      "subwindows", "copy_cost", "method", "tolerance", "max_moves", "min_gain", "move_cost",
                      "expert_bytes", "options", "threads", "cost_model", "horizon", "compile", "deployment")


def _layout(num_layers: int, width: int, rows: int, area: int) -> dict:
    """Byte offsets of the shared block: header ``int64 [16]``, row kinds ``int8 [C]``, staged rows
    ``float64 [C, L * width]``, message area ``uint8 [area]``; ``width = max(E, S)``."""
    kinds = SharedBlock.HEADER_FIELDS * 8
    ring = kinds + -(-rows // 64) * 64
    message = ring + rows * num_layers * width * 8
    return {"rows": rows, "row_size": num_layers * width, "kinds": kinds, "ring": ring, "message": message,
            "area": area, "size": message + area}


class _Shared(SharedBlock):
    """Views of the shared block (both processes build them from the same :func:`_layout`): the
    :class:`SharedBlock`'s and the staged rows' kinds (per slot or not)."""

    def __init__(self, shm, layout: dict):
        super().__init__(shm, layout)
        self.kinds = np.ndarray((layout["rows"],), np.int8, shm.buf, layout["kinds"])

    def row(self, index: int, num_layers: int, width: int) -> np.ndarray:
        """The staging row of pass ``index`` as a C-contiguous ``[L, width]`` view."""
        return self.ring[index % self.layout["rows"], :num_layers * width].reshape(num_layers, width)


# -- the switch interval while waiting ---------------------------------------------------------
_INTERVAL_LOCK = threading.Lock()
_INTERVAL_STATE = {"waiters": 0, "saved": None, "lowered": None}


def _lower_switch_interval(interval: float) -> None:
    """Lower the interpreter's switch interval to ``interval`` while at least one caller waits."""
    with _INTERVAL_LOCK:
        state = _INTERVAL_STATE
        if state["waiters"] == 0:
            saved = sys.getswitchinterval()
            state["saved"], state["lowered"] = saved, None
            if interval < saved:
                sys.setswitchinterval(interval)
                state["lowered"] = sys.getswitchinterval()
        state["waiters"] += 1


def _restore_switch_interval() -> None:
    """Undo :func:`_lower_switch_interval` once the last waiter is back (unless someone else set
    the interval meanwhile: theirs stays)."""
    with _INTERVAL_LOCK:
        state = _INTERVAL_STATE
        state["waiters"] -= 1
        if state["waiters"] == 0 and state["lowered"] is not None and sys.getswitchinterval() == state["lowered"]:
            sys.setswitchinterval(state["saved"])


# -- the parent's end --------------------------------------------------------------------------
class _Channel(WorkerLink):
    """The parent's end of one worker: the process, the semaphores, the pipe and the shared block."""

    def __init__(self, context: str, gil_interval: float | None):
        ctx = multiprocessing.get_context(context)
        self.requests, self.replies = ctx.Semaphore(0), ctx.Semaphore(0)
        super().__init__(context, "BalancerProcess", _serve, (self.requests, self.replies), "eplb-balancer")
        self.gil_interval = gil_interval
        self.lock = threading.Lock()  # one request at a time
        self.seq = 0

    def check(self) -> None:
        """Raise the channel's error if it is broken, or if the child died since the last call (a
        ``waitpid`` without waiting: :meth:`BalancerProcess.record` notices a dead worker at once)."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if not self.process.is_alive():
            raise self.died()

    # requests, over shared memory
    def request(self, message: tuple, rows: int):
        """Send ``message`` (the child first takes in staged passes up to ``rows``); return
        ``(status, value)``, ``value`` a :class:`_RaiseLater` when the child raised. Status: what the
        caller mirrors (see :meth:`_Server.status`), with ``seq`` the request's number."""
        data = dumps(message)
        with self.lock:
            self.check()
            shared = self.shared
            header, area = shared.header, shared.area
            self.seq += 1
            header[_REQUEST_ROWS] = rows
            in_pipe = place(data, area, header, _REQUEST_LEN)
            header[_REQUEST_SEQ] = self.seq
            self.requests.release()
            try:
                if in_pipe:
                    self.send(data)
                lowered = self._wait_reply()
            except BaseException as exc:  # interrupted (Ctrl-C) or dead: the answer would come unasked
                if self.broken is None:
                    self.broken = (f"a call to the eplb worker process was interrupted ({type(exc).__name__}) "
                                   "before it answered; this BalancerProcess cannot be used any more")
                raise
            try:
                if int(header[_REPLY_SEQ]) != self.seq:
                    self.broken = "the eplb worker process answered out of turn; this BalancerProcess cannot be used"
                    raise RuntimeError(self.broken)
                reply = take(int(header[_REPLY_LEN]), area, self.receive)
            finally:
                if lowered:  # kept while reading the answer: a hand-over meanwhile costs the short interval
                    _restore_switch_interval()
        kind, status, *rest = reply
        status["seq"] = self.seq
        if kind == "error":
            return status, _RaiseLater(*rest)
        return status, rest[0]

    def _wait_reply(self) -> bool:
        """Wait for the child's answer: first with the switch interval lowered (a quick answer gets
        the GIL back within ``gil_interval``; returns True, the interval still lowered for reading
        the answer: the caller restores it), then, for slow ones, with the interval as it was,
        checking every :data:`POLL_S` that the child lives (returns False)."""
        if self.gil_interval is not None:
            _lower_switch_interval(self.gil_interval)
            try:
                answered = self.replies.acquire(timeout=POLL_S)
            except BaseException:
                _restore_switch_interval()
                raise
            if answered:
                return True
            _restore_switch_interval()
        while not self.replies.acquire(timeout=POLL_S):
            if not self.process.is_alive():
                raise self.died()
        return False

    def nudge(self) -> None:
        """Tell the child that passes were staged."""
        self.requests.release()

    def ask_to_close(self) -> None:
        """Post the close request (once no other request is in flight, or after 5 s)."""
        if self.lock.acquire(timeout=5.0):
            try:
                header = self.shared.header
                self.seq += 1
                header[_REQUEST_ROWS] = header[_INGESTED]
                data = dumps(("close",))
                self.shared.area[:len(data)] = data
                header[_REQUEST_LEN] = len(data)
                header[_REQUEST_SEQ] = self.seq
                self.requests.release()
            finally:
                self.lock.release()


class _Named:
    """A placement the child holds, named in a request instead of sent: ``"committing"`` (its
    balancer's placement last committed) or ``"result"`` (its last rebalance's)."""

    def __init__(self, name: str):
        self.name = name


class _RaiseLater:
    """The child's exception, raised by the caller once its lock is released."""

    def __init__(self, exc: BaseException, text: str):
        self.exc, self.text = exc, text

    def throw(self):
        raise_remote(self.exc, self.text)


class BalancerProcess(WorkerBalancer):
    """An :class:`eplb.Balancer` that runs in a worker process: the same constructor arguments, the
    same methods and the same results, but the caller's threads never wait for the GIL while it
    plans (for an engine that rebalances on a background thread beside its scheduler).

    Args:
        num_layers, deployment, **kwargs: as for :class:`eplb.Balancer` (every keyword it takes).
        context: ``"spawn"`` (default) or ``"forkserver"``, the ``multiprocessing`` start method
            (``fork`` is unsafe beside threads and CUDA). As with any ``spawn``, the caller's main
            module is imported again in the child: guard a script's work with
            ``if __name__ == "__main__"``. The child inherits the environment (``EPLB_CACHE_DIR``:
            the same Numba cache) and ``sys.path`` (the same ``eplb``).
        staging_rows: passes the shared staging ring holds before :meth:`record` must wait for the
            child to take them in (default: 16 MiB worth, 2 to 256 passes); the child takes each in
            as soon as it is recorded, so the ring fills only while the child is busy planning.
        gil_interval: seconds, the interpreter's switch interval while a call waits for the child's
            answer and reads it (restored right after; waits past :data:`POLL_S` run with the
            interval as it was). Beside a busy thread, getting the GIL
            back after a wait costs one switch interval (5 ms by default, more than a DeepSeek-V3
            rebalance takes); with this it costs at most ``gil_interval``. ``None`` leaves the
            interval alone. While it is lowered, other threads of the process that compete for the
            GIL also switch that often.

    Costs: starting the child takes the time of importing eplb and building the balancer there
    (about 2 s with Numba's cache filled, see ``eplb warmup``), and ``window * L * E * 8`` bytes of
    memory in the child plus the staging ring and a message area (up to 8 MiB) of shared memory.

    :attr:`placement`, :attr:`steps`, :attr:`rebalances` and :attr:`last_decision` are kept up to
    date in the caller without asking the child; any other public attribute or method of
    ``Balancer`` (``history``, ``compiled``, ``wait_compiled``, ``planning_windows``, ...) is
    forwarded to the child and answered with a copy. Thread safety as for ``Balancer``: record on
    one thread while another rebalances. Call :meth:`close` (or use it as a context manager) to stop
    the child and free the shared memory; it also happens when the object is collected and at exit.
    It cannot be copied or pickled (:func:`copy.copy` raises ``TypeError``): start another with
    :meth:`from_state_dict`.
    """

    def __init__(self, num_layers, deployment=None, *, context: str = "spawn", staging_rows: int | None = None,
                 gil_interval: float | None = GIL_INTERVAL, **kwargs):
        construct = balancer_arguments("BalancerProcess", num_layers, deployment, kwargs, "context, staging_rows, "
                                       "gil_interval")
        self._start(construct, context, staging_rows, gil_interval)

    @classmethod
    def from_state_dict(cls, state, *, compile: str = "eager", cost_model=None, horizon: int | None = None,
                        context: str = "spawn", staging_rows: int | None = None,
                        gil_interval: float | None = GIL_INTERVAL) -> "BalancerProcess":
        """A new worker whose balancer is :meth:`eplb.Balancer.from_state_dict` of ``state`` (a
        :meth:`state_dict`, as saved by ``np.savez`` and read back by ``np.load``, or from JSON)."""
        self = cls.__new__(cls)
        self._start(from_state_arguments(state, compile, cost_model, horizon), context, staging_rows, gil_interval)
        return self

    def _start(self, construct: tuple, context: str, staging_rows, gil_interval) -> None:
        self._check_start(context, staging_rows)
        if gil_interval is not None and not (isinstance(gil_interval, (int, float)) and 0 < gil_interval <= 1):
            raise ValueError(f"gil_interval must be a number of seconds in (0, 1] or None, got {gil_interval!r}")
        self._launch(_Channel(context, gil_interval), construct, staging_rows)

    def _connect(self, channel: _Channel, construct: tuple, staging_rows) -> None:
        """Build the child's balancer, mirror its attributes, share the block with it."""
        attributes = self._handshake(channel, construct)
        placement = attributes.pop("placement")
        initial = construct[2].get("placement") if construct[0] == "init" else None
        self.__dict__.update(attributes)
        self._num_slots = self.topology.num_slots
        self._count_limit = pass_count_limit(self.window, self.forecast, self.num_experts, self._num_slots)
        width = max(self.num_experts, self._num_slots)
        rows = ring_rows(staging_rows, self.num_layers * width * 8, STAGING_BYTES, 2, 256)
        area = max(1 << 20, min(8 << 20, proposal_bytes(self.num_layers, self.num_experts, self._num_slots)))
        self._share(channel, _Shared, _layout(self.num_layers, width, rows, area))
        warm_copy_counts()  # record()'s kernels, compiled or loaded here once
        self._record_lock = threading.Lock()
        self._recorded = 0  # passes staged in all
        self._status = {"seq": 0, "steps": attributes["steps"], "rebalances": attributes["rebalances"], "ingested": 0,
                        "serial": 0, "committed": False, "last_decision": {}, "cpu_s": 0.0, "call_s": 0.0}
        self._placement = (0, initial if isinstance(initial, Placement) else placement)  # (serial, placement)
        self._committing: Placement | None = None  # twin of the child balancer's placement last committed
        self._result: Placement | None = None  # twin of the child's last rebalance result
        self._changing = None  # (placement, DeploymentChange) of a plan across a change not committed yet

    # -- plumbing ------------------------------------------------------------------------------
    def _call(self, name: str, *args, **kwargs):
        """Run ``name`` in the child (after the passes staged so far); return its value."""
        channel = self._channel
        if channel is None:
            raise RuntimeError("this BalancerProcess is closed")
        status, value = channel.request((name, args, kwargs), self._recorded)
        if status["seq"] > self._status["seq"]:  # calls on several threads: the newest answer's
            self._status = status
        if isinstance(value, _RaiseLater):
            value.throw()
        return value

    def __getattr__(self, name: str):
        if name.startswith("_") or not (hasattr(Balancer, name) or name in ("history", "compiled")):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if callable(getattr(Balancer, name, None)):
            def forwarded(*args, **kwargs):
                return self._call("call", name, args, kwargs)
            forwarded.__name__ = name
            forwarded.__doc__ = getattr(Balancer, name).__doc__
            return forwarded
        return self._call("get", name)

    def __setattr__(self, name: str, value) -> None:
        if name in _CONFIG_ATTRIBUTES and name in self.__dict__:
            raise AttributeError(f"{name} is fixed when a BalancerProcess starts (its balancer is in the worker)")
        object.__setattr__(self, name, value)

    # -- the Balancer's interface ----------------------------------------------------------------
    def record(self, counts, *, physical: bool | None = None) -> None:
        """Stage one forward pass's counts for the child (as :meth:`eplb.Balancer.record`: ``[L, E]``
        per logical expert or ``[L, S]`` per slot, numpy or torch, any real dtype; bad input gets the
        same ``ValueError``, here). One copy into shared memory; the child takes it in at once."""
        counts, physical = check_counts(counts, self.num_layers, self.num_experts, self._num_slots, physical)
        with self._record_lock:
            channel = self._channel
            if channel is None:
                raise RuntimeError("this BalancerProcess is closed")
            channel.check()
            index = self._recorded
            shared = channel.shared
            if index - int(shared.header[_INGESTED]) >= shared.layout["rows"]:
                self._call("sync")  # the ring is full: wait until the child took the staged passes in
            width = self._num_slots if physical else self.num_experts
            if physical and self.num_layers * width > shared.layout["row_size"]:  # grown past the staging rows
                staged = np.empty((self.num_layers, width))
                fold_pass(counts, self.placement.phy2log, staged, shared.row(index, self.num_layers, self.num_experts),
                          self._count_limit)
                physical = False  # handed over per expert, as the child's Balancer would keep it
            else:
                stage_counts(counts, shared.row(index, self.num_layers, width), self._count_limit)
            shared.kinds[index % shared.layout["rows"]] = physical
            self._recorded = index + 1
            shared.header[_RECORDED] = index + 1
            channel.nudge()

    def should_rebalance(self) -> bool:
        """:meth:`eplb.Balancer.should_rebalance`, decided in the child (details in :attr:`last_decision`)."""
        return self._call("call", "should_rebalance", (), {})

    def rebalance(self, *, commit: bool = True, deployment=None, gpu_map=None) -> tuple[Placement, TransferPlan]:
        """:meth:`eplb.Balancer.rebalance`, planned in the child: the new :class:`~eplb.Placement`
        and the :class:`~eplb.TransferPlan` of its weight copies. Across a deployment change
        (``deployment=``, ``gpu_map=``) the caller waits for the re-plan alone; bad input is refused
        here, before the child is asked, and changes nothing."""
        change = change_for(self.deployment, deployment, gpu_map)
        placement, transfer, same = self._call("rebalance", commit=commit, deployment=deployment, gpu_map=gpu_map)
        placement = self._result if same else placement
        self._result = placement
        if commit:
            self._committing = placement
            if change is not None:
                self._serve_deployment(change.new)
        elif change is not None:
            self._changing = (placement, change)
        return placement, transfer

    def _serve_deployment(self, deployment) -> None:
        """Mirror the child balancer's deployment after a change (its slots are what record() takes)."""
        self.__dict__.update(deployment=deployment, topology=deployment.topology, num_groups=deployment.num_groups)
        self._num_slots = deployment.topology.num_slots
        self._changing = None

    def commit(self, placement: Placement, layers: tuple[int, int] | None = None) -> None:
        """:meth:`eplb.Balancer.commit`: make ``placement`` (or its ``layers = (start, stop)``) the one in
        service. A placement :meth:`rebalance` returned is not sent back to the child."""
        if placement is not None and placement is self._committing:
            self._call("commit", _Named("committing"), layers)
        elif placement is not None and placement is self._result:
            self._call("commit", _Named("result"), layers)
        else:
            self._call("commit", placement, layers)
        self._committing = placement
        changing, self._changing = self._changing, None
        if changing is not None and placement is changing[0]:
            self._serve_deployment(changing[1].new)

    @property
    def placement(self) -> Placement:
        """The placement in service (asked from the child only after it changed)."""
        serial, cached = self._placement
        status = self._status
        if serial != status["serial"]:
            cached = self._committing if status["committed"] else self._call("get", "placement")
            self._placement = (status["serial"], cached)
        return cached

    @property
    def steps(self) -> int:
        """Forward passes recorded in all (staged ones included)."""
        status = self._status
        return status["steps"] + self._recorded - status["ingested"]

    @property
    def rebalances(self) -> int:
        """Rebalances committed in all."""
        return self._status["rebalances"]

    @property
    def last_decision(self) -> dict:
        """The details of the last :meth:`should_rebalance` (as a Balancer's ``last_decision``)."""
        return self._status["last_decision"]

    @property
    def worker_cpu_s(self) -> float:
        """CPU seconds the worker process has used so far (all its threads), as of its last answer."""
        return self._status["cpu_s"]

    @property
    def worker_call_s(self) -> float:
        """Wall seconds the worker spent on the last call it answered (the rest of the call's time
        was spent passing the request and the answer, and waiting for the GIL)."""
        return self._status["call_s"]

    @property
    def pid(self) -> int:
        """The worker process's id."""
        return self._channel.process.pid if self._channel is not None else None

    def window_counts(self) -> np.ndarray:
        """:meth:`eplb.Balancer.window_counts`: ``[L, E]`` float64."""
        return self._call("call", "window_counts", (), {})

    def planning_counts(self) -> np.ndarray:
        """:meth:`eplb.Balancer.planning_counts`: ``[L, E]`` float64."""
        return self._call("call", "planning_counts", (), {})

    def state_dict(self) -> dict:
        """:meth:`eplb.Balancer.state_dict` of the child's balancer (loadable by either class)."""
        return self._call("call", "state_dict", (), {})

    def load_state_dict(self, state) -> None:
        """:meth:`eplb.Balancer.load_state_dict` in the child."""
        self._call("call", "load_state_dict", (plain_state(state),), {})
        self._changing = None  # the child refuses a plan of the placement it replaced (issue 47 item 19)

def _signature() -> inspect.Signature:
    """``BalancerProcess.__init__``'s signature as documented: the Balancer's keywords, then its own."""
    base = inspect.signature(Balancer.__init__)
    own = inspect.signature(BalancerProcess.__init__).parameters
    extra = [own[name] for name in ("context", "staging_rows", "gil_interval")]
    keywords = [p for p in base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return base.replace(parameters=[*keywords, *extra])


BalancerProcess.__init__.__signature__ = _signature()


# -- the child's end ---------------------------------------------------------------------------
class _Server:
    """The child's end: the balancer, the staged passes it has taken in, and the request handlers."""

    def __init__(self, balancer: Balancer, shared: _Shared):
        self.balancer, self.shared = balancer, shared
        self.ingested = 0
        self.result: Placement | None = None  # the last rebalance's placement (the parent holds its twin)
        self.serial, self.seen = 0, balancer.placement
        self.call_s = 0.0  # wall seconds of the last request handled

    def ingest(self, rows: int) -> None:
        """Take the staged passes in, up to pass ``rows``."""
        balancer, shared = self.balancer, self.shared
        while self.ingested < rows:
            index = self.ingested
            physical = bool(shared.kinds[index % shared.layout["rows"]])
            width = balancer.topology.num_slots if physical else balancer.num_experts
            balancer.record(shared.row(index, balancer.num_layers, width), physical=physical)
            self.ingested = index + 1
            shared.header[_INGESTED] = index + 1

    def handle(self, request: tuple):
        """The value of one request (``(kind, ...)``)."""
        kind, args, kwargs = request
        balancer = self.balancer
        if kind == "sync":
            return None
        if kind == "get":
            if args[0].startswith("_"):
                raise AttributeError(f"'Balancer' object has no public attribute {args[0]!r}")
            return getattr(balancer, args[0])
        if kind == "call":
            name, call_args, call_kwargs = args
            if name.startswith("_"):
                raise AttributeError(f"'Balancer' object has no public method {name!r}")
            return getattr(balancer, name)(*call_args, **call_kwargs)
        if kind == "rebalance":
            placement, transfer = balancer.rebalance(**kwargs)
            same = placement is self.result
            self.result = placement
            return (None if same else placement), transfer, same
        if kind == "commit":
            placement, layers = args
            if isinstance(placement, _Named):
                placement = balancer._committing if placement.name == "committing" else self.result
            balancer.commit(placement, layers)
            return None
        raise ValueError(f"unknown request {kind!r}")

    def status(self) -> dict:
        """What the parent mirrors after every answer."""
        balancer = self.balancer
        if balancer.placement is not self.seen:
            self.serial, self.seen = self.serial + 1, balancer.placement
        return {"steps": balancer.steps, "rebalances": balancer.rebalances, "ingested": self.ingested,
                "serial": self.serial, "committed": balancer.placement is balancer._committing,
                "last_decision": balancer.last_decision, "cpu_s": time.process_time(), "call_s": self.call_s}


def _serve(conn, requests, replies) -> None:
    """The worker process (:func:`~eplb.serving.process_link.serve`): answer requests until told to
    close or the parent is gone."""
    serve(conn, (*_CONFIG_ATTRIBUTES, "placement", "steps", "rebalances"), _Shared,
          lambda balancer, shared, parent: _answer(_Server(balancer, shared), conn, requests, replies, parent))


def _answer(server: _Server, conn, requests, replies, parent: int) -> None:
    """The request loop: a post on ``requests`` is either staged passes or a request."""
    header, area = server.shared.header, server.shared.area
    handled = 0
    while True:
        if not requests.acquire(timeout=1.0):
            if os.getppid() != parent:
                return
            continue
        seq = int(header[_REQUEST_SEQ])
        if seq == handled:  # passes staged: take them in now, not when the next request comes
            try:
                server.ingest(int(header[_RECORDED]))
            except Exception:  # noqa: BLE001 (the next request meets it again and reports it)
                pass
            continue
        handled = seq
        try:
            request = take(int(header[_REQUEST_LEN]), area, conn.recv_bytes)
            if request[0] == "close":
                reply = None
            else:
                start = time.perf_counter()
                server.ingest(int(header[_REQUEST_ROWS]))
                reply = ("ok", server.handle(request))
                server.call_s = time.perf_counter() - start
        except BaseException as exc:  # noqa: BLE001 (handed to the parent)
            reply = error_message(exc)
        if reply is None:
            return
        kind, *rest = reply
        try:
            data = dumps((kind, server.status(), *rest))
        except Exception as exc:  # noqa: BLE001 (an answer pickle refuses)
            data = dumps(("error", server.status(), *error_message(exc)[1:]))
        in_pipe = place(data, area, header, _REPLY_LEN)
        header[_REPLY_SEQ] = seq
        replies.release()
        if in_pipe:
            conn.send_bytes(data)
