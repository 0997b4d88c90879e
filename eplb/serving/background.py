"""A balancer whose caller never waits for a plan: :class:`BackgroundBalancer`.

With :class:`~eplb.serving.balancer.Balancer` (or :class:`~eplb.serving.worker.BalancerProcess`) a
decision stalls the engine's thread: ``should_rebalance()`` and ``rebalance()`` return only once the
plan is made (about 140 ms at DeepSeek-V3 size with ``window=1000``, several times that beside a
busy Python thread). A ``BackgroundBalancer`` runs a real ``Balancer`` in a worker process and
talks to it through a one-way stream of events in shared memory:

- :meth:`~BackgroundBalancer.record` copies a pass into a staging row of shared memory in the
  pass's own dtype (one copy; the worker widens it to float64, exactly as ``Balancer.record``
  would) and checks it (shape and dtype once per kind of input, values by one kernel on the row;
  unsigned integers need no value check), then bumps a counter of passes staged;
  :meth:`~BackgroundBalancer.check` and :meth:`~BackgroundBalancer.commit` post events, each
  saying how many passes come before it. None of them waits for the worker.
- The worker takes the events in the order they were posted and does what the synchronous loop
  would have done at that point: ``record`` a pass, ``should_rebalance()`` and, when it says yes,
  ``rebalance(commit=False)`` at a check, ``commit`` at a commit. So it makes the same decisions
  and the same placements as a ``Balancer`` fed the same passes, checks and commits in the same
  order (``tests/serving/test_host_loop.py`` compares them byte for byte).
- Its answers come back one message at a time through shared memory;
  :meth:`~BackgroundBalancer.poll` reads them without waiting and returns a proposal
  ``(placement, transfer)`` once a check found one worth its copies.

Why a process and not a thread: a thread of the engine's process competes for the GIL with the
engine's own Python threads (its scheduler), and each of the dozens of GIL hand-backs a plan makes
costs up to a switch interval (``bench/background_thread.py``); the worker has its own interpreter.
Why not incremental window statistics: the window's sums and trend take about a quarter of a
decision's time at ``window=1000`` (the rest is planning), in the worker they cost the caller
nothing, and running sums would round differently from the ``Balancer`` they must agree with.

The caller waits only when the worker falls so far behind that the staging ring is full (it then
waits for a free row: back-pressure, not a plan), in :meth:`~BackgroundBalancer.wait`, and in the
rare calls that need the worker's answer (:meth:`~BackgroundBalancer.state_dict`).
"""

from __future__ import annotations

import collections
import functools
import multiprocessing.connection
import threading
import time
import weakref

import numpy as np

from ..analysis.placement import Placement
from ..kernels.plumbing.load_window import STAGED_DTYPES, memory_fence, stage_pass, warm_copy_counts
from .balancer import Balancer
from .balancer_change import change_for
from .layer_commits import commit_range, merged_placement
from .pass_counts import bad_count_error, check_counts, fold_pass
from .event_ring import (CHANGE, CHECK, CLOSE, COMMIT, EVENTS_DONE, EVENTS_POSTED, FLOAT64, MESSAGE_LEN,
                         MESSAGES_SENT, MESSAGES_TAKEN, PASSES_DONE, PASSES_POSTED, QUEUED, RELEASE, STAGING,
                         STATE, EventBlock, event_layout, serve_events)
from .process_link import (WorkerBalancer, WorkerLink, balancer_arguments, dumps, from_state_arguments,
                           proposal_bytes, raise_remote, ring_rows, take)
from .transfer import TransferPlan

STAGING_BYTES = 32 << 20
"""Bytes of shared memory for staged passes unless ``staging_rows`` says otherwise."""

KEPT_DECISIONS = 1000
"""Decisions kept in :attr:`BackgroundBalancer.decisions` (the newest ones)."""

WAKE_EVERY = 16
"""Passes staged between wake-ups of the worker (a check, commit or wait wakes it at once): each
wake-up is a system call on the caller's thread, and the passes only matter at the next check."""

WAIT_S = 0.0005
"""Seconds between looks at the worker's progress while a call waits for it."""

# -- the caller's end ----------------------------------------------------------------------------
class _Link(WorkerLink):
    """The caller's end of one worker: process, semaphore, pipe, shared block, and a watchdog
    thread that notices the worker's death without the caller asking (it blocks on the process's
    sentinel, holding no GIL, until the worker ends)."""

    def __init__(self, context: str):
        self.wake = multiprocessing.get_context(context).Semaphore(0)
        super().__init__(context, "BackgroundBalancer", serve_events, (self.wake,), "eplb-background-balancer")
        threading.Thread(target=self._watch, daemon=True, name="eplb-background-watchdog").start()

    def _watch(self) -> None:
        multiprocessing.connection.wait([self.process.sentinel])
        if self.broken is None:
            self.died()

    def check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def ask_to_close(self) -> None:
        """Post the close event (if the event ring has room) and wake the worker."""
        block = self.shared
        posted = int(block.header[EVENTS_POSTED])
        if posted - int(block.header[EVENTS_DONE]) < block.layout["events"]:
            block.events[posted % block.layout["events"]] = (CLOSE, 0, 0, 0, 0)
            memory_fence()
            block.header[EVENTS_POSTED] = posted + 1
        self.wake.release()


class BackgroundBalancer(WorkerBalancer):
    """An :class:`eplb.Balancer` in a worker process whose caller never waits for a plan.

    The serving loop records every pass, asks for a decision now and then, and takes a proposal
    when one is ready (the worker decides on the window as it was when :meth:`check` was called)::

        deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)
        balancer = eplb.BackgroundBalancer(58, deployment, window=1000, expert_bytes=44 << 20)
        for step in serving_loop:
            balancer.record(tokens_per_expert)       # one copy into shared memory
            if step % 100 == 0:
                balancer.check()                     # decided in the worker
            proposal = balancer.poll()               # None, or a plan worth its copies
            if proposal is not None:
                placement, transfer = proposal
                ...                                  # move the weights (transfer), then
                balancer.commit(placement)           # or per chunk: commit(placement, chunk.layers)

    Args:
        num_layers, deployment, **kwargs: as for :class:`eplb.Balancer` (every keyword it takes).
        context: ``"spawn"`` (default) or ``"forkserver"`` (not ``fork``, unsafe beside threads and
            CUDA); guard a script's work with ``if __name__ == "__main__":``, as for any spawn.
        staging_rows: passes the staging ring holds (default: 32 MiB worth, 8 to 1024 passes); the
            worker takes each in as soon as it is posted, so the ring fills only when it falls
            behind by that many passes (it then makes :meth:`record` wait for a free row).

    The same inputs give the same placements as a ``Balancer``: the worker runs one, and feeds it
    the passes, checks and commits in the order they were posted. A proposal is planned from the
    placement in service at its check; if the caller commits anything after that check, the
    proposal's transfer plan no longer starts from what is in service and :meth:`poll` drops it
    (``last_decision["stale"]``). The worker keeps every proposal :meth:`poll` handed out for as long
    as the caller holds its placement (the caller tells it when one is garbage-collected), so any
    proposal the caller still holds can be committed, however many checks came since. :attr:`last_decision` is the newest decision :meth:`poll` read
    (``should_rebalance``'s details, with the ``"check"`` number and ``"stale"``), :attr:`decisions`
    the newest :data:`KEPT_DECISIONS` of them; :attr:`steps` and :attr:`rebalances` count the passes
    recorded and the proposals committed.

    Costs: a process start (importing eplb and building the balancer there, about 2-4 s with
    Numba's cache filled), the window in the worker's memory (and the proposals the caller holds),
    the staging ring and a message area in shared memory. A check that raises in the worker (as
    ``Balancer.should_rebalance`` or ``rebalance`` may) is raised by the :meth:`poll` that reads its
    outcome (its type and message, the worker's traceback as its cause; ``last_decision["reason"]``
    names it), and the balancer goes on as a ``Balancer`` would; so does one raised by the worker's
    ``state_dict``, in :meth:`state_dict`. A worker that died, or one whose recording or commit
    raised (the caller's checks leave nothing for these to refuse, so its state is unknown), makes
    every call raise ``RuntimeError``. Use one thread for the loop's calls (as for a ``Balancer``'s
    :meth:`record`). A ``BackgroundBalancer`` cannot be copied or pickled (:func:`copy.copy` raises
    ``TypeError``): start another with :meth:`from_state_dict`.
    """

    def __init__(self, num_layers, deployment=None, *, context: str = "spawn", staging_rows: int | None = None,
                 **kwargs):
        self._start(balancer_arguments("BackgroundBalancer", num_layers, deployment, kwargs, "context, staging_rows"),
                    context, staging_rows)

    @classmethod
    def from_state_dict(cls, state, *, compile: str = "eager", cost_model=None, horizon: int | None = None,
                        context: str = "spawn", staging_rows: int | None = None) -> "BackgroundBalancer":
        """A new background balancer whose worker runs :meth:`eplb.Balancer.from_state_dict` of ``state``."""
        self = cls.__new__(cls)
        self._start(from_state_arguments(state, compile, cost_model, horizon), context, staging_rows)
        return self

    # -- starting and stopping -----------------------------------------------------------------
    def _start(self, construct: tuple, context: str, staging_rows) -> None:
        self._check_start(context, staging_rows)
        self._launch(_Link(context), construct, staging_rows)

    def _connect(self, link: _Link, construct: tuple, staging_rows) -> None:
        """Build the worker's balancer, mirror its configuration, share the block with it."""
        attributes = self._handshake(link, construct)
        self.num_layers, self.num_experts = attributes["num_layers"], attributes["num_experts"]
        self.topology, self.num_groups = attributes["topology"], attributes["num_groups"]
        self.deployment = attributes["deployment"]
        self.window = attributes["window"]
        num_slots = self.topology.num_slots
        width = max(self.num_experts, num_slots)
        row_bytes = self.num_layers * width * 8
        rows = ring_rows(staging_rows, row_bytes, STAGING_BYTES, 8, 1024)
        area = max(1 << 20, min(16 << 20, 2 * proposal_bytes(self.num_layers, self.num_experts, num_slots)))
        block = self._share(link, EventBlock, event_layout(self.num_layers, width, rows, 4 * rows + 64, area))
        warm_copy_counts()  # record()'s kernels, compiled or loaded here once
        self._words = block.words  # the shared header, for poll() (a memoryview: the cheapest reads)
        self._header = block.header  # the same, for record()'s compiled call
        self._ring_rows, self._event_slots = rows, block.layout["events"]
        self._num_slots = num_slots
        self._count_limit = attributes["count_limit"]  # the largest count record() takes (the worker's balancer's)
        self._stagers: dict[tuple[int, bool], _Stager] = {}  # (dtype code, physical) -> its staging rows
        self._stager = _Stager.none()  # the kind of input record() saw last (none yet)
        self._staging: tuple[int, bool] | None = None  # the kind of rows the worker was last told of
        self._events = 0  # events posted in all
        self._events_room = self._event_slots  # events that fit in the ring as the worker's progress was last read
        self._woken = 0  # passes + events posted when the worker was last woken
        self._passes = 0  # passes recorded in all
        self._passes_room = rows  # passes that fit in the ring as the worker's progress was last read
        self._taken = 0  # the worker's messages read
        self._checks = 0  # checks posted in all
        self._commits = 0  # commits posted in all
        self._check_commits: dict[int, int] = {}  # check id -> commits posted before it
        self._switches = 0  # deployment changes put in service in all
        self._check_switches: dict[int, int] = {}  # check id -> deployment changes put in service before it
        self._inbox: collections.deque = collections.deque()  # messages read, not yet handed out
        # id(placement) -> (check id, weak reference, deployment changes before its check) of every
        # proposal poll() handed out and the caller still holds; the reference's callback queues
        # (id, check id) in _released when the caller drops it
        self._proposals: dict[int, tuple[int, weakref.ref, int]] = {}
        self._released: collections.deque = collections.deque()  # (id, check id) to tell the worker to drop
        self._in_service = attributes["placement"]  # the placement in service, after the pending commits
        self._pending_commits: list[tuple[Placement, int, int]] = []
        self._committing: Placement | None = None
        self._changing = None  # (placement, DeploymentChange) of a plan across a change not committed yet
        self._row_bytes = row_bytes  # a staged pass holds at most this many bytes (wider ones are folded)
        self._steps_before = attributes["steps"]  # passes the worker's balancer had recorded when built
        self.rebalances = attributes["rebalances"]
        self.last_decision: dict = {}
        self.decisions: collections.deque = collections.deque(maxlen=KEPT_DECISIONS)

    @property
    def steps(self) -> int:
        """Passes recorded in all (those of a restored state included)."""
        return self._steps_before + self._passes

    @property
    def pid(self) -> int | None:
        """The worker process's id (``None`` once closed)."""
        return None if self.closed else self._channel.process.pid

    # -- the serving loop ------------------------------------------------------------------------
    def record(self, counts, *, physical: bool | None = None) -> None:
        """Stage one forward pass's counts for the worker (as :meth:`eplb.Balancer.record`: ``[L, E]``
        per logical expert or ``[L, S]`` per slot, numpy or torch, any real dtype; bad input gets the
        same ``ValueError``, here). One copy into shared memory; never waits for a plan.

        The engine's pass is the same kind of array every time, so its shape and dtype are checked
        once (:meth:`_restage`) and later passes of that kind only copied and checked for values."""
        stager = self._stager
        if (type(counts) is not np.ndarray or counts.dtype is not stager.dtype or counts.shape != stager.shape
                or physical is not stager.physical):
            counts, stager = self._restage(counts, physical)
        link = self._channel
        if link is None or link.broken is not None:
            self._live()  # raises
        index = self._passes
        if index >= self._passes_room:  # the ring may be full: look at the worker's progress
            self._wait_for_room(PASSES_DONE, index)
        row = stager.rows[index % self._ring_rows]
        # one call copies the pass and, if every value is good, hands it to the worker (PASSES_POSTED)
        if stager.stage(counts, row, self._header, PASSES_POSTED, index + 1, self._count_limit):
            raise bad_count_error(counts, row, self._count_limit)
        self._passes = index = index + 1
        if index - self._woken >= WAKE_EVERY:
            self._wake(link)

    def _restage(self, counts, physical) -> tuple[np.ndarray, "_Stager"]:
        """``counts`` checked for shape and dtype (as :func:`check_counts`) and the :class:`_Stager`
        for its kind, which :meth:`record` keeps for the passes after; tells the worker when the kind
        of the staged rows (dtype, per slot or not) changes. Returns ``(counts as numpy, stager)``."""
        array, is_physical = check_counts(counts, self.num_layers, self.num_experts, self._num_slots, physical)
        self._live()
        staged = array.dtype in STAGED_DTYPES  # and native: a big-endian dtype is not among them
        key = (STAGED_DTYPES.index(array.dtype) if staged else FLOAT64, is_physical)
        if is_physical and self.num_layers * self._num_slots * 8 > self._row_bytes:
            key = (FLOAT64, False)  # the deployment grew past the staging rows: passes are folded (_stage_folded)
        rows = self._stagers.get(key)
        if rows is None:
            block, width = self._channel.shared, self._num_slots if key[1] else self.num_experts
            rows = self._stagers[key] = [block.row(index, self.num_layers, width, STAGED_DTYPES[key[0]])
                                         for index in range(self._ring_rows)]
        if key != self._staging:
            self._post(STAGING, *key)
            self._staging = key
        # a dtype the worker takes as it is: one compiled call (for any layout: a layout not seen
        # before, e.g. Fortran order, compiles once), else widened to float64 here
        stage = stage_pass if staged else _stage_widened
        if is_physical and not key[1]:
            stage = self._stage_folded
        stager = _Stager(array.dtype, array.shape, physical, stage, rows)
        if type(counts) is np.ndarray:  # other input (torch, lists) comes here every pass
            self._stager = stager
        return array, stager

    def _stage_folded(self, counts: np.ndarray, row: np.ndarray, header: np.ndarray, field: int, value: int,
                      limit: float) -> bool:
        """Stage a pass per slot ``counts [L, S]`` of a deployment grown past the staging rows as the
        per-expert counts ``row [L, E]`` the worker's Balancer would keep of it (:func:`fold_pass`,
        through the placement in service; a bad value raises its ``ValueError`` here), then hand it
        over (``header[field] = value``). Returns False (no bad value left)."""
        staged = np.empty(counts.shape)
        fold_pass(counts, self.placement.phy2log, staged, row, limit)
        return stage_pass(row, row, header, field, value, limit)

    def rebalance(self, *, deployment, gpu_map=None, commit: bool = True) -> tuple[Placement, TransferPlan]:
        """Serve another deployment (GPUs lost, added or renumbered): the worker re-plans the
        placement in service across the change at once (:meth:`eplb.Balancer.rebalance` with
        ``deployment=``, ``gpu_map=``, after every pass recorded so far) and this call returns its
        ``(placement, transfer)``: the caller's thread waits for that plan alone.

        Bad input (:func:`eplb.serving.balancer_change.change_for`) is a ``ValueError`` raised here before
        the worker is asked, and so is an error of the re-plan (raised from the worker's): the
        worker serves on the deployment as it was. With ``commit=True`` the new deployment is in
        service when this returns (per-slot counts recorded afterwards are on its slots; proposals
        of earlier checks are dropped as stale); with ``commit=False`` :meth:`commit` the placement
        whole once the weights are moved, before any other commit. The deployment in service itself
        is a plain rebalance made now (``rebalance(commit=...)``; commit it per chunk as a proposal)."""
        link = self._live()
        change = change_for(self.deployment, deployment, gpu_map)
        proposal = self._checks
        self._checks = proposal + 1
        link.send(dumps((proposal, deployment, gpu_map)))  # read by the worker when it takes the event
        self._post(CHANGE, proposal, int(bool(commit)))
        _, _, placement, transfer, error = self._answer("change", proposal)
        if error is not None:
            raise_remote(*error[1:])
        key = id(placement)
        self._proposals[key] = (proposal, weakref.ref(placement, functools.partial(_dropped, self._released, key,
                                                                                   proposal)), self._switches)
        if commit:
            self._commits += 1  # a commit: proposals of earlier checks no longer start from what is in service
            self._pending_commits.append((placement, 0, self.num_layers))
            self.rebalances += 1
            self._committing = placement
            if change is not None:
                self._serve_deployment(change.new)
            self._changing = None
        elif change is not None:
            self._changing = (placement, change)
        return placement, transfer

    def _serve_deployment(self, deployment) -> None:
        """Mirror the worker balancer's deployment after a change: its slots are what record() takes."""
        self.deployment, self.topology, self.num_groups = deployment, deployment.topology, deployment.num_groups
        self._num_slots = deployment.topology.num_slots
        self._switches += 1  # proposals planned before are stale, even on the same topology (GPUs renumbered)
        self._stagers.clear()  # rows per slot were laid out for the old slots
        self._stager = _Stager.none()

    def _answer(self, kind: str, number: int) -> tuple:
        """Wait for the worker's message ``(kind, number, ...)``; the others stay for :meth:`poll`."""
        link = self._live()
        while True:
            for index, message in enumerate(self._inbox):
                if message[0] == kind and message[1] == number:
                    del self._inbox[index]
                    return message
            if not self._receive(link):
                self._wait_once()

    def check(self) -> int:
        """Ask the worker whether a rebalance now is worth its copies (:meth:`eplb.Balancer.should_rebalance`
        on the window as it is after the passes recorded so far) and, if so, for the plan
        (``rebalance(commit=False)``). Returns at once with the check's number; :meth:`poll` hands
        the plan over when it is ready, :attr:`last_decision` tells each check's outcome."""
        self._live()
        self._post_releases()
        check_id = self._checks
        self._post(CHECK, check_id)
        self._check_commits[check_id] = self._commits
        self._check_switches[check_id] = self._switches
        self._checks = check_id + 1
        return check_id

    def poll(self) -> tuple[Placement, TransferPlan] | None:
        """The next proposal the worker made, ``(placement, transfer)`` as ``rebalance(commit=False)``
        returns them, or ``None`` (no check answered yes since the last call). Never waits. A
        proposal planned before a later :meth:`commit` is dropped (its transfer plan would start
        from a placement no longer in service)."""
        link = self._channel
        if link is None or link.broken is not None:
            self._live()  # raises
        while True:
            if not self._inbox and not self._receive(link):
                return None
            message = self._inbox.popleft()
            if message[0] == "decision":
                proposal = self._take_decision(message)
                if proposal is not None:
                    return proposal
            elif message[0] == "check_error":
                self._take_check_error(message)  # raises

    def _take_decision(self, message: tuple):
        _, check_id, decision, placement, transfer = message
        commits_before = self._check_commits.pop(check_id, self._commits)
        switches_before = self._check_switches.pop(check_id, self._switches)
        stale = placement is not None and commits_before != self._commits
        self.last_decision = {**decision, "check": check_id, "stale": stale}
        self.decisions.append(self.last_decision)
        if placement is None:
            return None
        if stale:  # the worker holds it for a commit that will not come
            self._released.append((None, check_id))
            return None
        key = id(placement)
        self._proposals[key] = (check_id, weakref.ref(placement, functools.partial(_dropped, self._released, key,
                                                                                   check_id)), switches_before)
        return placement, transfer

    def _take_check_error(self, message: tuple):
        """Record that check ``message[1]`` raised in the worker, and raise its exception here."""
        _, check_id, exc, text = message
        self._check_commits.pop(check_id, None)
        self._check_switches.pop(check_id, None)
        self.last_decision = {"rebalance": False, "reason": f"the check raised {type(exc).__name__}: {exc}",
                              "check": check_id, "stale": False}
        self.decisions.append(self.last_decision)
        raise_remote(exc, text)

    def _post_releases(self) -> None:
        """Tell the worker which proposals the caller dropped (it keeps the others for a commit)."""
        released = self._released
        while released:
            key, check_id = released.popleft()
            held = self._proposals.get(key)
            if held is not None and held[0] == check_id:
                del self._proposals[key]
            self._post(RELEASE, check_id)

    def commit(self, placement: Placement, layers: tuple[int, int] | None = None) -> None:
        """Make a proposed ``placement`` (or its ``layers = (start, stop)``) the one in service, once
        the engine has moved those weights (as :meth:`eplb.Balancer.commit`; per-slot counts
        recorded afterwards are mapped through it). Takes a placement :meth:`poll` returned, however
        long ago, unless a deployment change was put in service since its check (``ValueError``).
        Never waits."""
        self._live()
        start, stop = commit_range(layers, self.num_layers)
        held = self._proposals.get(id(placement))
        if held is None or held[1]() is not placement:
            raise ValueError("placement must be one that this BackgroundBalancer's poll() or rebalance() returned")
        if held[2] != self._switches:  # issue 47 item 19
            raise ValueError("placement was planned before a deployment change was put in service: its copies start "
                             "from weights no longer in service (even with the same topology); check() again")
        changing = self._changing
        across = changing is not None and placement is changing[0]
        if placement.topology != self.topology and not across:
            raise ValueError("placement is planned for another topology than the deployment in service: a plan "
                             "across a deployment change (rebalance(deployment=..., commit=False)) is committed "
                             "whole, before any other commit")
        if across and (start, stop) != (0, self.num_layers):
            raise ValueError("a plan across a deployment change is committed whole (layers=None): the slots of the "
                             "deployment in service are not the plan's")
        self._post_releases()
        self._post(COMMIT, held[0], start, stop)
        self._commits += 1
        self._pending_commits.append((placement, start, stop))
        if placement is not self._committing:
            self.rebalances += 1
            self._committing = placement
        self._changing = None
        if across:
            self._serve_deployment(changing[1].new)

    @property
    def placement(self) -> Placement:
        """The placement in service, as committed so far (the worker's balancer holds the same)."""
        for placement, start, stop in self._pending_commits:
            self._in_service = merged_placement(self._in_service, placement, start, stop, self.num_groups)
        self._pending_commits.clear()
        return self._in_service

    @property
    def pending_checks(self) -> int:
        """Checks posted whose decision :meth:`poll` has not read yet."""
        return len(self._check_commits)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the worker has handled every pass, check and commit posted so far (their
        decisions are then ready for :meth:`poll`); returns whether it did within ``timeout``
        seconds; their answers are then read, so :meth:`poll` hands them out without the worker.
        For tests, shutdown and benchmarks: the serving loop does not need it."""
        words = self._live().shared.words
        events, passes = self._events, self._passes

        def caught_up() -> bool:  # every pass and event handled, every answer read into the inbox
            return (words[EVENTS_DONE] >= events and words[PASSES_DONE] >= passes and words[QUEUED] == 0
                    and words[MESSAGES_SENT] == self._taken)

        return self._wait(caught_up, timeout)

    def state_dict(self) -> dict:
        """:meth:`eplb.Balancer.state_dict` of the worker's balancer after every event posted so far
        (waits for the worker; loadable by ``Balancer.from_state_dict`` and :meth:`from_state_dict`)."""
        link = self._live()
        self._post(STATE, 0)
        while True:
            for index, message in enumerate(self._inbox):
                if message[0] in ("state", "state_error"):
                    del self._inbox[index]
                    if message[0] == "state_error":
                        raise_remote(*message[1:])
                    return message[1]
            if not self._receive(link):
                self._wait_once()

    # -- plumbing ------------------------------------------------------------------------------
    def _live(self) -> _Link:
        link = self.__dict__.get("_channel")
        if link is None:
            raise RuntimeError("this BackgroundBalancer is closed")
        link.check()
        return link

    def _post(self, kind: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        """Append one event to the ring, with the number of passes staged before it (waiting for
        room only if the worker is that far behind); wake the worker unless it can wait for the
        next pass (a change of staging kind)."""
        link = self._channel
        number = self._events
        if number >= self._events_room:
            self._wait_for_room(EVENTS_DONE, number)
        link.shared.events[number % self._event_slots] = (kind, self._passes, a, b, c)
        self._events = number + 1
        memory_fence()  # the event before its counter
        self._words[EVENTS_POSTED] = number + 1
        if kind != STAGING:
            self._wake(link)

    def _wait_for_room(self, field: int, number: int) -> None:
        """Wait until the worker has handled enough of its ring (``field``: ``PASSES_DONE`` for the
        staging rows, ``EVENTS_DONE`` for the events) for item ``number`` to fit. What fits as the
        worker's progress was last read is kept (``_passes_room``, ``_events_room``), so a call with
        room to spare reads no shared header."""
        words = self._words
        passes = field == PASSES_DONE
        capacity = self._ring_rows if passes else self._event_slots

        def room() -> bool:
            fits = words[field] + capacity
            if passes:
                self._passes_room = fits
            else:
                self._events_room = fits
            return number < fits

        self._wait(room)

    def _wake(self, link: _Link) -> None:
        self._woken = self._passes
        link.wake.release()

    def _receive(self, link: _Link) -> bool:
        """Read the worker's next message into the inbox if one is there (never waits for one);
        raise the worker's error if it is one that leaves its state unknown (a check's or a state
        request's error goes to the inbox, for the call that reads its outcome). Returns whether a
        message was read."""
        words = self._words
        if words[MESSAGES_SENT] == self._taken:  # written after the message (and its length)
            return False
        memory_fence()  # the counter before the message
        size = words[MESSAGE_LEN]
        message = take(size, link.shared.area, link.receive)
        self._taken += 1
        words[MESSAGES_TAKEN] = self._taken
        link.wake.release()  # the worker may send its next message
        if message[0] == "error":
            link.broken = f"the eplb worker process raised {type(message[1]).__name__}: {message[1]}"
            raise_remote(message[1], message[2])
        self._inbox.append(message)
        return True

    def _wait(self, done, timeout: float | None = None) -> bool:
        """Wait until ``done()``, reading messages meanwhile (the worker may be waiting to send one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._woken < self._passes:  # passes staged since the last wake-up: the worker's next work
            self._wake(self._channel)
        while not done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._wait_once()
        return True

    def _wait_once(self) -> None:
        link = self._live()
        while self._receive(link):
            pass
        time.sleep(WAIT_S)


class _Stager:
    """How :meth:`BackgroundBalancer.record` stages one kind of input: numpy arrays of ``dtype`` and
    ``shape`` passed with ``physical`` (the argument as given), copied into one of ``rows`` (the
    ring's ``[L, X]`` views) by ``stage(counts, row, header, field, value, limit)``, which sets
    ``header[field] = value`` unless a value is bad (negative, NaN or above ``limit``), and returns
    whether one is."""

    __slots__ = ("dtype", "shape", "physical", "stage", "rows")

    def __init__(self, dtype, shape, physical, stage, rows: list[np.ndarray]):
        self.dtype, self.shape, self.physical, self.stage, self.rows = dtype, shape, physical, stage, rows

    @classmethod
    def none(cls) -> "_Stager":
        """A stager no input matches (before the first pass)."""
        return cls(None, None, object(), None, [])


def _stage_widened(counts: np.ndarray, row: np.ndarray, header: np.ndarray, field: int, value: int,
                   limit: float) -> bool:
    """As :func:`~eplb.kernels.plumbing.load_window.stage_pass` for a dtype the worker does not take as it is
    (float16, longdouble, big-endian, bool): ``row [L, X]`` float64 ``= counts`` (values beyond
    float64's range become inf), then ``header[field] = value`` unless a value is negative, NaN or
    above ``limit``; returns whether one is."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(row, counts, casting="unsafe")
    return stage_pass(row, row, header, field, value, limit)  # checks the row, then fences and hands it over


def _dropped(released: collections.deque, key: int, check_id: int, reference) -> None:
    """A proposal's placement was garbage-collected: queue its release (posted to the worker at the
    caller's next check or commit; a callback of the garbage collector posts nothing itself)."""
    released.append((key, check_id))
