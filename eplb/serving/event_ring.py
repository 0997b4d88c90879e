"""The shared block of a :class:`~eplb.serving.background.BackgroundBalancer` and the worker's end
of it: the header's fields, the event ring the caller posts to (a record's staging rows, checks,
commits, releases, a change, state requests, close), and the loop that takes the passes and events
in the order they were posted and sends each answer as soon as the message area is free.

The caller's end is :mod:`eplb.serving.background`; both ends build their views from
:func:`event_layout`.
"""

from __future__ import annotations

import collections
import os
import pickle

import numpy as np

from ..analysis.placement import Placement
from ..kernels.plumbing.load_window import STAGED_DTYPES, memory_fence
from .balancer import Balancer
from .process_link import SharedBlock, dumps, error_message, place, serve

# the shared block: a header of int64 fields, the event ring, the staging rows, the message area
(EVENTS_POSTED, EVENTS_DONE, PASSES_POSTED, PASSES_DONE, MESSAGES_SENT, MESSAGES_TAKEN, MESSAGE_LEN,
 QUEUED) = range(8)
STAGING, CHECK, COMMIT, STATE, CLOSE, RELEASE = range(6)
CHANGE = 6  # a rebalance across a deployment change: its deployment and gpu_map follow through the pipe
EVENT_FIELDS = 5  # kind, passes staged before the event, then up to three integer arguments
FLOAT64 = STAGED_DTYPES.index(np.dtype(np.float64))  # the staging code of input widened by the caller


def event_layout(num_layers: int, width: int, rows: int, events: int, area: int) -> dict:
    """Byte offsets of the shared block: header ``int64 [16]``, events ``int64 [N, 5]``, staged rows
    of ``8 * L * width`` bytes each (``width = max(E, S)``: room for ``[L, E]`` or ``[L, S]`` in any
    dtype of :data:`STAGED_DTYPES`), message area ``uint8 [area]``."""
    ring = SharedBlock.HEADER_FIELDS * 8 + events * EVENT_FIELDS * 8
    message = ring + rows * num_layers * width * 8
    return {"rows": rows, "events": events, "row_size": num_layers * width, "ring": ring, "message": message,
            "area": area, "size": message + area}


class EventBlock(SharedBlock):
    """Views of the shared block (both processes build them from the same :func:`event_layout`): the
    :class:`SharedBlock`'s, the header again as ``words``, and the event ring."""

    def __init__(self, shm, layout: dict):
        super().__init__(shm, layout)
        buf = shm.buf
        # the same header as a memoryview of int64: a read or write of one field costs a tenth of numpy's
        self.words = buf[:self.HEADER_FIELDS * 8].cast("q")
        self.events = np.ndarray((layout["events"], EVENT_FIELDS), np.int64, buf, self.HEADER_FIELDS * 8)

    def row(self, index: int, num_layers: int, width: int, dtype=np.float64) -> np.ndarray:
        """Staging row ``index`` as a C-contiguous ``[L, width]`` view of ``dtype`` (8 bytes or fewer)."""
        return np.ndarray((num_layers, width), dtype, self.shm.buf, self.layout["ring"] + index * self.ring.strides[0])


# -- the worker's end ----------------------------------------------------------------------------
class EventWorker:
    """The worker's loop: take the passes and events in order, send each answer as soon as the
    message area is free."""

    def __init__(self, balancer: Balancer, block: EventBlock, conn):
        self.balancer, self.block, self.conn = balancer, block, conn
        self.done = 0  # events handled
        self.passes = 0  # passes recorded
        self.staging = (FLOAT64, False)  # the kind of the staged rows: (dtype code, per slot)
        self.sent = 0
        self.queue: collections.deque = collections.deque()  # answers not sent yet
        self.proposals: dict[int, Placement] = {}  # check id -> placement proposed, until the caller drops it

    def take_passes(self, upto: int) -> None:
        """Record the staged passes before pass number ``upto`` into the balancer (the row's values,
        widened to float64 by ``Balancer.record`` as the caller's own ``Balancer`` would)."""
        balancer, block = self.balancer, self.block
        code, physical = self.staging
        width = balancer.topology.num_slots if physical else balancer.num_experts
        while self.passes < upto:
            row = block.row(self.passes % block.layout["rows"], balancer.num_layers, width, STAGED_DTYPES[code])
            try:
                balancer.record(row, physical=physical)
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                self.queue.append(error_message(exc))
            self.passes += 1
            memory_fence()  # the row read before it is handed back
            block.words[PASSES_DONE] = self.passes  # the row is free for the caller

    def handle(self, kind: int, a: int, b: int, c: int) -> bool:
        """Do what one event asks; False for the close event."""
        balancer = self.balancer
        if kind == STAGING:
            self.staging = (a, bool(b))
        elif kind == CHECK:
            try:
                placement = transfer = None
                if balancer.should_rebalance():
                    placement, transfer = balancer.rebalance(commit=False)
                    self.proposals[a] = placement
                self.queue.append(("decision", a, balancer.last_decision, placement, transfer))
            except Exception as exc:  # noqa: BLE001 (the caller's poll raises it; the balancer goes on)
                self.queue.append(("check_error", a, *error_message(exc)[1:]))
        elif kind == COMMIT:
            if a not in self.proposals:  # the caller posts commits of the proposals it holds only
                raise RuntimeError(f"the worker holds no proposal of check {a} to commit")
            balancer.commit(self.proposals[a], (b, c))
        elif kind == RELEASE:
            self.proposals.pop(a, None)
        elif kind == CHANGE:
            number = None
            while number != a:  # (a payload whose event was never posted, the caller interrupted, is skipped)
                number, deployment, gpu_map = pickle.loads(self.conn.recv_bytes())
            try:
                placement, transfer = balancer.rebalance(commit=bool(b), deployment=deployment, gpu_map=gpu_map)
            except Exception as exc:  # noqa: BLE001 (raised by the caller; the balancer serves on as it was)
                self.queue.append(("change", a, None, None, error_message(exc)))
            else:
                self.proposals[a] = placement
                self.queue.append(("change", a, placement, transfer, None))
        elif kind == STATE:
            try:
                self.queue.append(("state", balancer.state_dict()))
            except Exception as exc:  # noqa: BLE001 (the caller's state_dict raises it)
                self.queue.append(("state_error", *error_message(exc)[1:]))
        elif kind == CLOSE:
            return False
        return True

    def send(self) -> None:
        """Write the next answer into the message area if the caller has taken the last one."""
        header = self.block.header
        if not self.queue or int(header[MESSAGES_TAKEN]) < self.sent:
            header[QUEUED] = len(self.queue)
            return
        data = dumps(self.queue.popleft())
        area = self.block.area
        in_pipe = place(data, area, header, MESSAGE_LEN)
        self.sent += 1
        header[QUEUED] = len(self.queue)
        memory_fence()  # the message and its length before the counter
        header[MESSAGES_SENT] = self.sent  # last: the caller reads the message once it sees this
        if in_pipe:
            self.conn.send_bytes(data)

    def run(self, wake, parent: int) -> None:
        block = self.block
        words, capacity = block.words, block.layout["events"]
        while True:
            if not wake.acquire(timeout=1.0):
                if os.getppid() != parent:
                    return
                continue
            # passes before events: an event posted after this read has every pass read here before it
            passes, posted = words[PASSES_POSTED], words[EVENTS_POSTED]
            memory_fence()  # the counters before the rows and events they hand over
            while self.done < posted:
                kind, before, a, b, c = (int(value) for value in block.events[self.done % capacity])
                self.take_passes(before)
                try:
                    if not self.handle(kind, a, b, c):
                        return
                except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                    self.queue.append(error_message(exc))
                self.done += 1
                self.send()  # before the event counts as done: wait() then finds its answer sent or queued
                words[EVENTS_DONE] = self.done
            self.take_passes(passes)
            self.send()


def serve_events(conn, wake) -> None:
    """The worker process (:func:`~eplb.serving.process_link.serve`): run the event loop until told
    to close or the caller is gone."""
    serve(conn, ("num_layers", "num_experts", "topology", "num_groups", "window", "placement", "steps",
                 "rebalances", "count_limit", "deployment"), EventBlock,
          lambda balancer, block, parent: EventWorker(balancer, block, conn).run(wake, parent))
