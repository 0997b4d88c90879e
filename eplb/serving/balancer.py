"""The online balancer a serving engine plugs in: record loads every forward pass, decide when a
rebalance pays for its weight copies, and plan it close to the placement in service.

Typical use inside an engine::

    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)
    balancer = eplb.Balancer(58, deployment, window=1000, expert_bytes=44 << 20)
    for step in serving_loop:
        balancer.record(tokens_per_expert)          # [L, E] logical or [L, S] per slot
        if step % 100 == 0 and balancer.should_rebalance():
            placement, transfer = balancer.rebalance(commit=False)   # may run on a background thread
            pending = transfer.chunks(8)                  # 8 layers' copies per step
        if pending:
            chunk = pending.pop(0)
            for step, copies in chunk.ordered():          # "copy" (all at once), "load", "after_load"
                engine.copy_weights(copies)
            balancer.commit(placement, chunk.layers)      # those layers are now in service

Thread safety: :meth:`record` and the window snapshot taken by planning share a lock; planning
itself runs in Numba kernels that release the GIL, so :meth:`rebalance` can run on a background
thread while the engine keeps recording.

Compilation: Numba compiles a kernel on its first call (tens of seconds on an empty cache). A
``Balancer`` compiles every kernel its decisions and rebalances use before the serving loop needs
them (``compile="eager"``, the default, at construction; ``"background"`` on a thread, see
:class:`Balancer`); :func:`warm_kernels` does the same for a configuration without a balancer (for
container builds: the compiled kernels land in Numba's cache, and later processes load them).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..model.defaults import AUTO, BALANCER_TOLERANCE, COPY_COST, balancer_move_budget, slots_per_gpu
from ..model._validation import as_int
from ..model.change import DeploymentChange
from ..model.deployment import Deployment, deployment_argument, make_deployment
from ..engines import dispatch_rule
from ..planning.pipeline import build, run, windows_of
from ..planning.pipeline import MAX_MOVES_WARNING
from ..planning.replan import RELAXED_WARNING, fit_groups, warn_relaxed
from ..analysis.bounds import average_bound, replica_bound
from ..model.cost import CostModel
from ..analysis.loads import RANDOM_SPLIT, gpu_work
from ..kernels.plumbing.load_window import (STAGED_DTYPES, copy_counts, first_bad_count, store_logical, store_physical,
                                   warm_copy_counts, weighted_window, window_residuals)
from ..planning.methods import DEFAULT_METHOD, get_method
from ..planning.migration import SPREAD_WARNING, groups_spread, warm_search_kernels
from ..analysis.metrics import balancedness
from ..analysis.placement import Placement, uniform_shares
from ..model.topology import Topology
from .transfer import TransferPlan, transfer_plan

STATE_VERSION = 1
COMPILE_MODES = ("eager", "background", "lazy")


def round_robin_placement(num_layers: int, num_experts: int, topology: Topology, num_groups=None) -> Placement:
    """The layout engines start from: slot ``s`` holds expert ``s % E`` in every layer."""
    row = np.arange(topology.num_slots, dtype=np.int64) % num_experts
    return Placement(np.tile(row, (num_layers, 1)), num_experts, topology, num_groups, method="round_robin")


HORIZON_WINDOWS = 3
"""With a cost model, a new placement's savings are counted over this many windows of passes
unless ``horizon`` says otherwise (see :class:`Balancer`)."""

FORECAST_MIN_PASSES = 10
"""Fewer recorded passes than this: no trend is fitted (see :meth:`Balancer.planning_counts`)."""

SUBWINDOWS = 10
"""The Balancer hedges its plans over this many sub-windows of its window (see :class:`Balancer`)."""


class Balancer:
    """Online expert-load balancer: a window of recent loads and the placement in service.

    Args:
        num_layers: ``L`` MoE layers.
        deployment: the :class:`eplb.Deployment` (``E`` experts per layer, slots, GPUs, nodes,
            groups; an even-split dispatch rule). Its keywords (``num_experts``, ``num_slots``, ...)
            still work in its place, deprecated.
        window: ``W``, forward passes kept (a ring buffer ``[W, L, E]`` allocated once).
        decay: ``None`` (all passes in the window weigh the same) or a factor in ``(0, 1]``: a pass
            ``a`` steps old weighs ``decay ** a``.
        forecast: plan for the loads this many passes past the newest, each expert's extrapolated
            along its least-squares trend over the window (:meth:`planning_counts`); default
            ``None``: half the window; ``0``: the window's loads as recorded. On the drifting
            DeepSeek-V3-sized series of ``bench/decision_rule.py`` it cut the MoE time lost, stalls
            included, on the held-out series, for a few more copies.
        subwindows: plan hedged over the window cut into this many sub-windows of consecutive
            passes (:func:`eplb.planning.pipeline.hedge_near`: the plan near the placement in service,
            then swaps that lower the mean over the sub-windows of each one's peak, each paying
            ``copy_cost`` per slot it changes), so the placement serves the traffic the window
            moved through, not only its average; ``1``: plan for the window's loads alone.
        copy_cost: with ``subwindows > 1``, what one changed slot costs the hedged search, in mean
            ``peak / mean`` load (see :func:`eplb.plan`).
        method: the planning method (``eplb.METHODS``); tolerance, max_moves: the trade-off of
            migration-aware planning (see :func:`eplb.plan`): how far above the best plan's peak a
            rebalance may stay, and how many slots per layer it may change. By default
            (``"auto"``) the move budget knows the slots per GPU ``k``: up to 4 slots a GPU (one copy
            moves a quarter or more of a GPU's load), at most ``round(k)`` slots per layer, one GPU's
            worth, the most balanced plan within it (tolerance 0); above, no budget and tolerance
            :data:`~eplb.model.defaults.BALANCER_TOLERANCE` (0.03), as tuned at 9 slots a GPU
            (:func:`eplb.model.defaults.balancer_move_budget`: why). Re-read after a deployment change.
        min_gain: rebalance only if the mean balancedness over layers rises by at least this much
            (on the window's loads) ...
        move_cost: ... plus ``move_cost`` times the fraction of slots that change (the migration cost
            expressed in balancedness points: with 0.05, moving every slot must buy 0.05).
        expert_bytes: bytes of one expert's weights in one layer (for transfer-plan byte totals).
        cost_model: decide in time instead (:class:`eplb.CostModel`; recommended): rebalance when
            the step time the candidate plan saves on the mean pass, times ``horizon`` passes,
            exceeds the time its weight copies stall serving (``copy_mode="stall"``; copies beside
            serving or free cost nothing), and its balancedness gain is at least ``min_gain`` (the
            gain and the savings are measured on the loads the candidate was planned for, so they
            run high; the hurdle keeps it from chasing that). Only time tells that memory-bound
            decode passes gain next to nothing from token balance: on the decode series of
            ``bench/decision_rule.py`` the balancedness rule rebalanced every check and lost time
            to stalls, the decision in time never rebalanced. ``move_cost`` is not used. Not part of
            :meth:`state_dict` (pass it again to :meth:`from_state_dict`).
        horizon: passes over which a new placement's savings are counted (default: three windows,
            :data:`HORIZON_WINDOWS`; placements serve several windows between rebalances, and one
            window under-counted the savings: the Balancer rebalanced too rarely and lost more time,
            stalls included, on the series of ``bench/decision_rule.py``); with ``cost_model`` only.
        placement: the placement in service at start (default: slot ``s`` holds expert ``s % E``).
        options: passed to the planning method.
        threads: plan chunks of layers on this many threads (the kernels release the GIL); the
            placement is the same for any number, only the wall time of a rebalance changes.
        compile: when the Numba kernels of decisions and rebalances are compiled (or loaded from
            Numba's cache), so that none is compiled inside the serving loop:

            - ``"eager"`` (default): at construction, which then takes as long as compiling (20-60 s
              on an empty cache; about a second once :func:`warm_kernels` or ``eplb warmup`` has
              filled it, e.g. at container build);
            - ``"background"``: the recording kernels at construction (about a second), the rest
              on a daemon thread. Until it ends, :meth:`should_rebalance` does not block: it returns
              False with ``last_decision["reason"] == "kernels still compiling"``; :meth:`rebalance`
              (an explicit request) waits for the compile. :attr:`compiled` and
              :meth:`wait_compiled` tell when it is done; an error in the thread is raised by the
              next decision or rebalance;
            - ``"lazy"``: on first use (scripts and tests; the first decision may then compile).
    """

    def __init__(self, num_layers, deployment: Deployment | None = None, *, window: int = 100, decay: float | None = None,
                 forecast: int | None = None, method: str = DEFAULT_METHOD, tolerance: float | None | str = AUTO,
                 max_moves: int | None | str = AUTO, min_gain: float = 0.01, move_cost: float = 0.05, expert_bytes: int | None = None,
                 placement: Placement | None = None, options: dict | None = None, threads: int = 1,
                 compile: str = "eager", cost_model: CostModel | None = None, horizon: int | None = None,
                 subwindows: int = SUBWINDOWS, copy_cost: float = COPY_COST, **deployment_keywords):
        self.num_layers = as_int(num_layers, "num_layers", minimum=1)
        deployment = deployment_argument(deployment, deployment_keywords, type(self).__name__)
        if dispatch_rule(deployment.dispatch).kind != "uniform":
            raise ValueError(f"the Balancer plans near the placement in service for an even split; dispatch="
                             f"{deployment.dispatch!r} plans from scratch (eplb.plan)")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise ValueError(f"cost_model must be an eplb.CostModel or None, got {type(cost_model).__name__}")
        self.cost_model = cost_model
        self.horizon = None if horizon is None else as_int(horizon, "horizon", minimum=1)
        self.deployment = deployment
        get_method(method)  # fail early on an unknown method
        self.window = as_int(window, "window", minimum=1)
        if decay is not None:
            decay = float(decay)
            if not 0.0 < decay <= 1.0:
                raise ValueError(f"decay must be in (0, 1] or None, got {decay}")
        self.decay = decay
        self.forecast = self.window // 2 if forecast is None else as_int(forecast, "forecast", minimum=0)
        self.subwindows = as_int(subwindows, "subwindows", minimum=1)
        self.copy_cost = _non_negative(copy_cost, "copy_cost")
        self.method = method
        self._move_arguments = (tolerance, max_moves)
        self.tolerance, self.max_moves = move_settings(tolerance, max_moves, deployment.topology)
        self.min_gain = _non_negative(min_gain, "min_gain")
        self.move_cost = _non_negative(move_cost, "move_cost")
        self.expert_bytes = None if expert_bytes is None else as_int(expert_bytes, "expert_bytes", minimum=0)
        self.options = dict(options or {})
        self.threads = as_int(threads, "threads", minimum=1)
        if placement is None:
            placement = round_robin_placement(self.num_layers, self.num_experts, self.topology, self.num_groups)
        self._check_placement(placement)
        self.placement = placement
        try:
            self._buffer = np.zeros((self.window, self.num_layers, self.num_experts))
        except MemoryError:
            raise ValueError(f"window={self.window}: the ring buffer [window, num_layers, num_experts] would take "
                             f"{self.window * self.num_layers * self.num_experts * 8 / 2**30:.3g} GiB, more than "
                             "can be allocated") from None
        self._position = 0  # next row of the ring buffer to write
        self._filled = 0  # rows holding data
        self.steps = 0  # forward passes recorded in all
        self.rebalances = 0
        self.history: list[dict] = []
        self.last_decision: dict = {}
        self._candidate: tuple[int, int, Placement] | None = None  # (steps, rebalances, plan)
        self._committing: Placement | None = None  # the placement last committed (whole or in part)
        self._changing: tuple[Placement, DeploymentChange] | None = None  # a plan across a change, not committed
        # the plans rebalance() handed out -> the epoch they were planned in; a deployment change or
        # load_state_dict starts a new epoch, and a plan of an older one is refused by commit()
        self._epoch = 0
        self._planned_in: dict[int, tuple[weakref.ref, int]] = {}  # id(plan) -> (plan, epoch)
        self._lock = threading.Lock()
        # every recorded pass is converted into one of these first, so the window kernels see
        # float64 [L, E] / [L, S] arrays only (one compiled specialization, any input dtype)
        self._logical = np.zeros((self.num_layers, self.num_experts))
        self._physical = np.zeros((self.num_layers, self.topology.num_slots))
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        self.compile = compile
        self._compiled = threading.Event()
        self._compile_error: BaseException | None = None
        if compile == "lazy":
            self._compiled.set()
        else:
            _warm_window_kernels(self.num_layers, self.num_experts, self.topology.num_slots)
            settings = dict(method=method, tolerance=self.tolerance, max_moves=self.max_moves, options=self.options)
            if compile == "eager":
                warm_kernels(self.deployment, **settings)
                self._warm_cost_model()
                self._compiled.set()
            else:
                threading.Thread(target=self._warm_in_background, args=(settings,), daemon=True,
                                 name="eplb-balancer-compile").start()

    # -- compiling -------------------------------------------------------------------------------
    def _warm_cost_model(self) -> None:
        """Compile the pricing kernel a decision in time uses (nothing without a cost model)."""
        if self.cost_model is not None:
            self._step_time(self.placement, np.ones((self.num_layers, self.num_experts)))

    def _warm_in_background(self, settings: dict) -> None:
        try:
            warm_kernels(self.deployment, **settings)
            self._warm_cost_model()
        except BaseException as exc:  # handed to the next decision or rebalance
            self._compile_error = exc
        finally:
            self._compiled.set()

    @property
    def num_experts(self) -> int:
        """``E``, the deployment's logical experts per layer."""
        return self.deployment.num_experts

    @property
    def topology(self) -> Topology:
        """The deployment's topology."""
        return self.deployment.topology

    @property
    def num_groups(self) -> int | None:
        """The expert groups the deployment keeps on one node each, or ``None``."""
        return self.deployment.num_groups

    @property
    def count_limit(self) -> float:
        """The largest count :meth:`record` takes (:func:`pass_count_limit` of this balancer's
        window, forecast, experts and slots): above it the window's sums could overflow float64."""
        return pass_count_limit(self.window, self.forecast, self.num_experts, self.topology.num_slots)

    @property
    def compiled(self) -> bool:
        """Whether every kernel of decisions and rebalances is compiled (always True unless
        ``compile="background"`` is still running)."""
        return self._compiled.is_set()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: as long as it takes) for the background compile;
        returns :attr:`compiled`."""
        self._compiled.wait(timeout)
        self._raise_compile_error()
        return self.compiled

    def _raise_compile_error(self) -> None:
        if self._compile_error is not None:
            raise RuntimeError("compiling the balancer's kernels in the background failed") from self._compile_error

    # -- recording -------------------------------------------------------------------------------
    def record(self, counts, *, physical: bool | None = None) -> None:
        """Add one forward pass's token counts to the window (no allocation for numpy input).

        Args:
            counts: ``[L, E]`` tokens per logical expert, or ``[L, S]`` tokens per physical slot
                (mapped back through the placement in service); numpy or torch, any numeric dtype.
            physical: which of the two ``counts`` is; inferred from the shape unless ``E == S``.

        A negative, NaN or infinite count, or one above :attr:`count_limit`, is a ``ValueError``
        and leaves the window as it was.
        """
        counts, physical = check_counts(counts, self.num_layers, self.num_experts, self.topology.num_slots, physical)
        with self._lock:
            staged = self._physical if physical else self._logical
            if staged.shape != counts.shape:  # the deployment changed since the check (another thread)
                raise ValueError(f"counts per slot must have shape {list(staged.shape)} after the deployment change, "
                                 f"got {list(counts.shape)}")
            stage_counts(counts, staged, self.count_limit)
            row = self._buffer[self._position]
            if physical:
                store_physical(staged, self.placement.phy2log, row)
            else:
                store_logical(staged, row)
            self._position = (self._position + 1) % self.window
            self._filled = min(self._filled + 1, self.window)
            self.steps += 1

    def window_counts(self) -> np.ndarray:
        """``[L, E]`` float64: the window's loads (decay-weighted sum over the recorded passes)."""
        with self._lock:
            weights, _ = self._row_weights()
            out = np.empty((self.num_layers, self.num_experts))
            weighted_window(self._buffer, weights, out)
        return out

    def _row_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """``[W]`` weight and ``[W]`` age (passes before the newest) of each ring-buffer row."""
        ages = ((self._position - 1 - np.arange(self.window)) % self.window).astype(np.float64)
        weights = np.where(ages < self._filled, 1.0, 0.0)
        if self.decay is not None:
            weights *= self.decay ** ages
        return weights, ages

    def planning_counts(self) -> np.ndarray:
        """``[L, E]`` float64: the loads decisions and plans are made for, on the scale of
        :meth:`window_counts` (the window's weight of passes).

        With ``forecast=h`` each expert's load per pass is its (weighted) least-squares line over the
        window's passes, read ``h`` passes past the newest one: traffic that drifts is planned for
        where it is going, not where it was on average half a window ago. Each slope is shrunk by
        ``max(0, 1 - (2 standard errors / slope)^2)`` (the standard error from the line's own
        residuals): a trend the window's noise could explain is ignored, so the noise of small
        batches (decode) is not extrapolated. A prediction is never below a twentieth of the expert's window mean
        (a line through a falling expert may cross zero). Without forecast, or with fewer than
        :data:`FORECAST_MIN_PASSES` passes recorded, the window's loads as they are.
        """
        if not self.forecast or self._filled < FORECAST_MIN_PASSES:
            return self.window_counts()
        shape = (self.num_layers, self.num_experts)
        total, by_age, residual = np.empty(shape), np.empty(shape), np.empty(shape)
        with self._lock:
            weights, ages = self._row_weights()
            mass = weights.sum()
            mean_age = float(weights @ ages) / mass
            centred = ages - mean_age
            spread = float(weights @ centred ** 2)
            weighted_window(self._buffer, weights, total)
            weighted_window(self._buffer, weights * centred, by_age)
            mean = total / mass
            slope = by_age / spread  # per pass of age: negative for a rising expert
            scale = np.where(mean > 0, mean, 1.0)
            window_residuals(self._buffer, weights, ages, mean - slope * mean_age, slope, scale, residual)
        # the slope's sampling variance, from the residuals (in units of the mean, as is the slope
        # below), with the effective number of passes of the weights
        passes = mass ** 2 / float(weights @ weights)
        residual *= passes / max(passes - 2.0, 1.0) / mass
        slope_variance = residual * float((weights ** 2) @ centred ** 2) / spread ** 2
        signal = (slope / scale) ** 2
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            shrink = np.maximum(1.0 - 4.0 * slope_variance / signal, 0.0)  # soft threshold at 2 standard errors
        shrink = np.where(np.isfinite(shrink), shrink, 0.0)
        predicted = mean - shrink * slope * (mean_age + self.forecast)
        return np.maximum(predicted, mean / 20.0) * mass

    # -- deciding and planning -------------------------------------------------------------------
    def _plan(self, load: np.ndarray, change: DeploymentChange | None = None) -> Placement:
        """Migration-aware plan for ``load [L, E]`` from the placement in service, hedged over
        :meth:`planning_windows` (``plan``'s pipeline from the placement in service; its bounds are computed only if read).
        Across ``change`` (from the balancer's deployment), the re-plan for ``change.new`` as
        :func:`eplb.plan` makes it (a hierarchical deployment whose groups no longer fit is relaxed as
        there: :func:`eplb.planning.replan.fit_groups`), for ``load`` alone: a change is not chosen for
        its gain, so its plan makes the copies recovery takes and no hedging swaps (one GPU of 32 lost
        on drifting DeepSeek-V3-sized traffic: hedged, 1.7x the copies global and 6x hierarchical,
        for no better balance on ``load``; ``bench/elastic_serving.py``).
        Later plans on such a deployment are global, close to the placement in service (regrouping it
        into units of groups, as a plan from scratch does, would move many slots again; ``info["relaxed"]``)."""
        windows, objective = windows_of(self.planning_windows() if self._filled and change is None else load[None],
                                        weights=load)
        deployment, relaxed = fit_groups(self.deployment if change is None else change.new, spill=True,
                                         near=change is None)
        tolerance, max_moves = self._move_budget(change, deployment)
        stages = build(windows, deployment, method=self.method, objective=objective,
                       previous=self.placement.phy2log, tolerance=tolerance, max_moves=max_moves,
                       copy_cost=self.copy_cost, threads=self.threads, options=self.options, change=change)
        return run(windows, deployment, stages, self.method, notes={"relaxed": relaxed} if relaxed else None)

    def _move_budget(self, change: DeploymentChange | None, deployment: Deployment) -> tuple[float | None, int | None]:
        """``(tolerance, max_moves)`` of a plan: :attr:`tolerance` and :attr:`max_moves`, except
        that the default budget (``max_moves="auto"``) does not bind a re-plan across ``change`` nor
        one that must gather expert groups spread over nodes (the round-robin start of a
        hierarchical deployment): those are not chosen for their gain, and plan as without a
        budget (tolerance :data:`~eplb.model.defaults.BALANCER_TOLERANCE` unless given)."""
        if not isinstance(self._move_arguments[1], str):
            return self.tolerance, self.max_moves
        if change is not None or groups_spread(self.placement.phy2log, deployment, self.num_experts).any():
            return move_settings(self._move_arguments[0], None, deployment.topology)
        return self.tolerance, self.max_moves

    def planning_windows(self) -> np.ndarray:
        """``[K, L, E]`` float64: the window's passes in ``K = min(subwindows, passes recorded)``
        sub-windows of consecutive passes, oldest first (decay-weighted), what plans hedge over."""
        count = min(self.subwindows, self._filled)
        out = np.zeros((count, self.num_layers, self.num_experts))
        with self._lock:
            weights, ages = self._row_weights()
            edges = np.linspace(0, self._filled, count + 1)
            for k in range(count):  # sub-window k holds the passes aged in [edges[K-1-k], edges[K-k])
                low, high = edges[count - 1 - k], edges[count - k]
                weighted_window(self._buffer, np.where((ages >= low) & (ages < high), weights, 0.0), out[k])
        return out

    def should_rebalance(self) -> bool:
        """Whether a rebalance now is worth its weight copies.

        The predicted gain is the rise in mean balancedness (over layers) on the loads planned for
        (:meth:`planning_counts`: the window's, carried ``forecast`` passes ahead).
        First a free check: the lower bound caps what any plan can reach; if even that is less than
        ``min_gain`` above today's balancedness, no. Otherwise plan (migration-aware; the plan is
        kept for :meth:`rebalance`) and say yes when
        ``gain >= min_gain + move_cost * fraction of slots changed``. Details in ``last_decision``.
        """
        if not self._compiled.is_set():
            self.last_decision = {"rebalance": False, "reason": "kernels still compiling"}
            return False
        self._raise_compile_error()
        if self._filled == 0:
            self.last_decision = {"rebalance": False, "reason": "no loads recorded"}
            return False
        steps, rebalances = self.steps, self.rebalances
        load = self.planning_counts()
        current_layers = balancedness(self.placement.gpu_loads(load))  # [L]
        current = float(current_layers.mean())
        active = int((self.topology.slots_per_gpu > 0).sum())
        # the cheap bounds only: this check runs often and must cost far less than planning
        bound = np.maximum(average_bound(load, self.topology), replica_bound(load, self.topology))
        mean = load.sum(axis=1) / active
        ceiling = float(np.divide(mean, bound, out=np.ones_like(mean), where=bound > 0).mean())
        decision = {"step": steps, "balancedness": current, "ceiling": ceiling}
        if ceiling - current < self.min_gain:
            self.last_decision = {**decision, "rebalance": False, "reason": "even an optimal plan gains too little"}
            return False
        planned = self._plan(load)
        planned_layers = balancedness(planned.gpu_loads(load))  # [L]
        candidate = self._layers_that_pay(load, planned, planned_layers - current_layers)
        kept = candidate.info.get("layers_rebalanced", np.ones(self.num_layers, bool))
        gain = float(np.where(kept, planned_layers, current_layers).mean()) - current
        moved = float(np.sum(candidate.info["slots_changed"])) / candidate.phy2log.size
        self._candidate = (steps, rebalances, candidate)
        if moved == 0:
            planned_gain = float(planned_layers.mean()) - current
            self.last_decision = {**decision, "rebalance": False, "gain": 0.0, "planned_gain": planned_gain,
                                  "moved_fraction": 0.0, "reason": "no layer's move pays for its copies"}
            return False
        if self.cost_model is None:
            worth = gain >= self.min_gain + self.move_cost * moved
            self.last_decision = {**decision, "rebalance": bool(worth), "gain": gain, "moved_fraction": moved,
                                  "cost": self.move_cost * moved,
                                  "reason": "gain exceeds cost" if worth else "gain below min_gain + migration cost"}
        else:
            per_pass = load / self._effective_passes()
            now, new = self._step_time(self.placement, per_pass), self._step_time(candidate, per_pass)
            horizon = self.horizon or HORIZON_WINDOWS * self.window
            saved = (now - new) * horizon
            copies = 0.0
            if self.cost_model.copy_mode == "stall":
                copies = self.cost_model.transfer_time(transfer_plan(self.placement, candidate,
                                                                     expert_bytes=int(self.cost_model.expert_bytes)))
            worth = saved > copies and gain >= self.min_gain
            self.last_decision = {**decision, "rebalance": bool(worth), "gain": gain, "moved_fraction": moved,
                                  "step_time_s": now, "step_time_new_s": new, "saved_s": saved, "copy_s": copies,
                                  "reason": "time saved exceeds copy time" if worth else
                                            "time saved below copy time"}
        return bool(worth)

    def _layers_that_pay(self, load: np.ndarray, candidate: Placement, gain: np.ndarray) -> Placement:
        """``candidate`` with every layer whose move does not pay for itself on ``load [L, E]``
        given back its slots in service: with a cost model, a layer pays when the time it saves
        over the horizon exceeds its share of the copy stall (its copies' share of the plan's);
        otherwise when its balancedness gain is at least ``move_cost`` times the fraction of its
        slots that change (``gain [L]``: the candidate's balancedness minus the placement in
        service's, per layer). Copies then go to the layers where they buy balance."""
        previous = self.placement.phy2log
        changed = np.asarray(candidate.info["slots_changed"], dtype=np.int64)
        if not changed.any():
            return candidate
        if self.cost_model is None:
            pays = gain >= self.move_cost * changed / previous.shape[1]
        else:
            per_pass = load / self._effective_passes()
            saved = (self._layer_times(self.placement, per_pass) - self._layer_times(candidate, per_pass)) \
                * (self.horizon or HORIZON_WINDOWS * self.window)
            stall = np.zeros(self.num_layers)
            if self.cost_model.copy_mode == "stall":
                transfer = transfer_plan(self.placement, candidate, expert_bytes=int(self.cost_model.expert_bytes))
                copies = np.bincount(transfer.layer, minlength=self.num_layers)
                stall = self.cost_model.transfer_time(transfer) * copies / max(int(copies.sum()), 1)
            pays = saved > stall
        keep = pays & (changed > 0)
        if keep.all():
            return candidate
        phy2log = np.where(keep[:, None], candidate.phy2log, previous)
        info = {**candidate.info, "slots_changed": np.where(keep, changed, 0), "layers_rebalanced": keep}
        return Placement(phy2log, self.num_experts, self.topology, self.num_groups, method=self.method, info=info)

    def _effective_passes(self) -> float:
        """The weight of the window's passes (their number without decay)."""
        if self.decay is None:
            return float(self._filled)
        return float(np.sum(self.decay ** np.arange(self._filled)))

    def _layer_times(self, placement: Placement, per_pass: np.ndarray) -> np.ndarray:
        """``[L]`` predicted seconds of each MoE layer of one pass of ``per_pass [L, E]`` counts under
        ``placement`` (even split): the layer's slowest GPU."""
        phy2log = np.ascontiguousarray(placement.phy2log)
        shares = uniform_shares(phy2log, placement.logcnt)[None]
        tokens, active = gpu_work(per_pass[None], phy2log, self.topology, shares, RANDOM_SPLIT)
        live = self.topology.slots_per_gpu > 0
        return self.cost_model.layer_time(tokens[..., live], active[..., live])[0]

    def _step_time(self, placement: Placement, per_pass: np.ndarray) -> float:
        """Predicted seconds of one pass of ``per_pass [L, E]`` counts under ``placement`` (even split)."""
        return float(self._layer_times(placement, per_pass).sum())

    def rebalance(self, *, commit: bool = True, deployment: Deployment | DeploymentChange | None = None,
                  gpu_map=None) -> tuple[Placement, TransferPlan]:
        """Plan a new placement close to the one in service, for the window's loads.

        Args:
            commit: make it the placement in service now (physical counts recorded afterwards are
                mapped through it). With ``commit=False`` call :meth:`commit` once the engine has
                moved the weights.
            deployment: serve another deployment from now on (GPUs lost, added or renumbered, slots
                per GPU changed): the :class:`eplb.Deployment` to serve next, or an
                :class:`eplb.DeploymentChange` from the balancer's deployment. The placement in
                service is re-planned across the change at once, as :func:`eplb.plan` re-plans it
                (``previous=``; :mod:`eplb.planning.replan`), for :meth:`planning_counts` (the
                window is recorded per logical expert, so it carries over; not hedged over
                sub-windows: the copies recovery takes, no more; with nothing recorded, for no load:
                the fewest copies). Committed, the deployment is the balancer's: physical counts are
                then on its slots and :meth:`state_dict` saves it. The placement's ``info`` has the
                re-plan's ``change``, ``orphans``, ``copy_floor`` and ``copies`` (per layer) and
                ``recovery`` (:func:`recovery_summary`: orphans, copies, bytes and the estimated
                seconds at the cost model's bandwidths); the :class:`TransferPlan` loads each orphan
                from host memory once and never reads a lost GPU. Committed later, it is committed
                whole (``commit(placement)``), before any other commit. Bad input (see
                :func:`change_for`) is a ``ValueError`` and changes nothing; the deployment in
                service itself (a change that changes nothing) is a plain rebalance.
            gpu_map: with ``deployment`` an :class:`eplb.Deployment`: the new index of each GPU of
                the balancer's deployment (``-1``: gone; vLLM's ``rank_mapping``); ``None``: by index.
        Returns:
            The new :class:`Placement` (``info["slots_changed"]`` per layer) and the
            :class:`TransferPlan` of weight copies from the current placement.
        """
        start = time.perf_counter()
        self.wait_compiled()
        change = change_for(self.deployment, deployment, gpu_map)
        if change is not None:
            return self._rebalance_across(change, commit, start)
        cached = self._candidate
        if cached is not None and cached[0] == self.steps and cached[1] == self.rebalances:
            candidate = cached[2]
        else:
            if self._filled == 0:
                raise ValueError("record() some loads before rebalance()")
            candidate = self._plan(self.planning_counts())
        old = self.placement
        transfer = transfer_plan(old, candidate, expert_bytes=self.expert_bytes)
        self._remember(candidate)
        moved = int(np.sum(candidate.info["slots_changed"]))
        self.history.append({
            "step": self.steps, "slots_changed": moved, "moved_fraction": moved / candidate.phy2log.size,
            "plan_time_s": float(candidate.info["time_s"]), "time_s": time.perf_counter() - start,
            "copies": transfer.counts(),
        })
        if commit:
            self.commit(candidate)
        return candidate, transfer

    def _rebalance_across(self, change: DeploymentChange, commit: bool, start: float) -> tuple[Placement, TransferPlan]:
        """:meth:`rebalance` across ``change`` (checked by :func:`change_for`)."""
        candidate = self._plan(self.planning_counts(), change)
        warn_relaxed(candidate.info.get("relaxed"), stacklevel=4)
        transfer = transfer_plan(self.placement, candidate, change, expert_bytes=self.expert_bytes)
        recovery = recovery_summary(candidate, transfer, self.cost_model)
        # the placement was just planned here and not handed out yet: its info gains the summary
        object.__setattr__(candidate, "info", MappingProxyType({**candidate.info, "recovery": recovery}))
        self._remember(candidate)
        moved = int(np.sum(candidate.info["slots_changed"]))
        self.history.append({
            "step": self.steps, "slots_changed": moved, "moved_fraction": moved / candidate.phy2log.size,
            "plan_time_s": float(candidate.info["time_s"]), "time_s": time.perf_counter() - start,
            "copies": transfer.counts(), "change": change.describe(), "recovery": recovery,
        })
        if commit:
            self._switch(change, candidate)
        else:
            self._changing = (candidate, change)
        return candidate, transfer

    def _switch(self, change: DeploymentChange, placement: Placement) -> None:
        """Serve ``change.new`` with ``placement`` from now on (the window's logical counts stay)."""
        with self._lock:
            self.deployment = change.new
            self.placement = placement
            self._physical = np.zeros((self.num_layers, change.new.topology.num_slots))
            self.tolerance, self.max_moves = move_settings(*self._move_arguments, change.new.topology)
            self.rebalances += 1
            self._committing = placement
            self._candidate = None
            self._changing = None
            self._epoch += 1  # plans of the deployment before are stale (issue 47 item 19)
        self._remember(placement)

    def _remember(self, plan: Placement) -> None:
        """Note that ``plan`` was planned in the current epoch (dropped once the caller drops it)."""
        key = id(plan)
        with self._lock:
            self._planned_in[key] = (weakref.ref(plan, lambda _, key=key: self._planned_in.pop(key, None)), self._epoch)

    def commit(self, placement: Placement, layers: tuple[int, int] | None = None) -> None:
        """Make ``placement`` the one in service (after the engine moved the weights).

        Args:
            placement: the new placement (from :meth:`rebalance`).
            layers: ``None`` (every layer), or ``(start, stop)``: only layers ``start <= l < stop``
                switch, the others keep the placement in service. An engine that applies a
                rebalance a few layers per step commits each chunk once its weights are in place
                (``balancer.commit(placement, chunk.layers)`` for ``chunk`` in
                ``transfer.chunks(k)``), so per-slot counts recorded meanwhile are mapped through
                what each layer really holds. A rebalance counts once, at the first commit of its
                placement. A plan across a deployment change (``rebalance(deployment=...,
                commit=False)``) is committed whole, before any other commit: the balancer then
                serves its deployment.

        A plan :meth:`rebalance` made before a deployment change was put in service or before
        :meth:`load_state_dict` replaced the placement it was planned from is refused
        (``ValueError``): its copies start from weights no longer in service, even where the
        topology is the same (GPUs renumbered).
        """
        planned = self._planned_in.get(id(placement))
        if planned is not None and planned[0]() is placement and planned[1] != self._epoch:
            raise ValueError("placement was planned from a placement no longer in service (a deployment change "
                                 "or load_state_dict came since): plan again with rebalance()")
        changing = self._changing
        if changing is not None and placement is changing[0]:
            if commit_range(layers, self.num_layers) != (0, self.num_layers):
                raise ValueError("a plan across a deployment change is committed whole (layers=None): the slots of "
                                 "the deployment in service are not the plan's")
            self._switch(changing[1], placement)
            return
        if isinstance(placement, Placement) and placement.topology != self.topology:
            raise ValueError("placement is planned for another topology than the deployment in service: a plan "
                             "across a deployment change (rebalance(deployment=..., commit=False)) is committed "
                             "whole, before any other commit")
        self._check_placement(placement)
        start, stop = commit_range(layers, self.num_layers)
        with self._lock:
            self.placement = merged_placement(self.placement, placement, start, stop, self.num_groups)
            if placement is not self._committing:
                self.rebalances += 1
                self._committing = placement
            self._candidate = None
            self._changing = None  # a plan across a change no longer starts from what is in service

    def _check_placement(self, placement) -> None:
        if not isinstance(placement, Placement):
            raise ValueError(f"placement must be an eplb.Placement, got {type(placement).__name__}")
        if placement.topology != self.topology or placement.num_experts != self.num_experts \
                or placement.num_layers != self.num_layers:
            raise ValueError("placement must match the balancer's layers, experts and topology")

    # -- persistence -----------------------------------------------------------------------------
    def _config(self) -> dict:
        return {
            "num_layers": self.num_layers, "num_experts": self.num_experts, "topology": self.topology.to_dict(),
            "num_groups": self.num_groups, "window": self.window, "decay": self.decay, "forecast": self.forecast,
            "method": self.method,
            # as given: "auto" stays "auto" (its value follows the deployment, which may change)
            "tolerance": self._saved_move_argument(0), "max_moves": self._saved_move_argument(1),
            "min_gain": self.min_gain,
            "move_cost": self.move_cost, "expert_bytes": self.expert_bytes, "options": self.options,
            "threads": self.threads, "subwindows": self.subwindows, "copy_cost": self.copy_cost,
        }

    def _saved_move_argument(self, index: int):
        """``tolerance`` (0) or ``max_moves`` (1) as saved: ``"auto"`` when left to the slots per GPU,
        else the value in use."""
        given = self._move_arguments[index]
        if isinstance(given, str):
            return given
        return self.tolerance if index == 0 else self.max_moves

    def state_dict(self) -> dict:
        """Everything a restarted server needs, as numpy arrays, ints and a JSON string (no pickle):
        save it with ``np.savez(path, **state)`` (load with ``allow_pickle=False``) or as JSON after
        ``tolist()``."""
        with self._lock:
            return {
                "format_version": STATE_VERSION,
                "config": json.dumps(self._config()),
                "window_buffer": self._buffer.copy(),
                "position": self._position,
                "filled": self._filled,
                "steps": self.steps,
                "rebalances": self.rebalances,
                "phy2log": self.placement.phy2log.copy(),
            }

    def load_state_dict(self, state) -> None:
        """Restore a :meth:`state_dict` (also as read back by ``np.load`` or from JSON lists). A
        malformed state is a ``ValueError`` naming the key and the rule (:func:`read_state`)."""
        saved = read_state(state)
        config, buffer, phy2log = saved.config, saved.window_buffer, saved.phy2log
        position, filled, steps, rebalances = saved.position, saved.filled, saved.steps, saved.rebalances
        mine = self._config()
        for key in ("num_layers", "num_experts", "topology", "window"):
            if config.get(key, CONFIG_DEFAULTS.get(key)) != mine[key]:
                raise ValueError(f"state has {key}={config.get(key, CONFIG_DEFAULTS.get(key))!r}, "
                                 f"this balancer has {mine[key]!r}")
        if buffer.shape != self._buffer.shape:
            raise ValueError(f"state window_buffer has shape {buffer.shape}, expected {self._buffer.shape}")
        bad = first_bad_count(np.ascontiguousarray(buffer).reshape(-1, self.num_experts), np.inf)
        if bad >= 0:
            raise ValueError(f"state window_buffer must be finite and non-negative, found {buffer.flat[bad]} at "
                             f"flat index {bad}")
        # a pass's layer total at most what record() lets in (count_limit per expert or slot)
        most = self.count_limit * max(self.num_experts, self.topology.num_slots)
        with np.errstate(over="ignore"):
            largest = float(buffer.sum(axis=2).max(initial=0.0))
        if not largest <= most:
            raise ValueError(f"state window_buffer holds a pass whose layer total is {largest:.3g}, above the "
                             f"{most:.3g} record() lets in: the window's sums would overflow float64")
        if not (0 <= position < self.window and 0 <= filled <= self.window):
            raise ValueError("state position/filled are out of range for the window")
        placement = Placement(phy2log, self.num_experts, self.topology, self.num_groups, method="restored")
        with self._lock:
            self._buffer[...] = buffer
            self._position, self._filled = position, filled
            self.steps, self.rebalances = steps, rebalances
            self.placement = placement
            self._candidate = None
            self._changing = None  # a plan across a change started from the placement replaced here
            self._epoch += 1

    @classmethod
    def from_state_dict(cls, state, *, compile: str = "eager", cost_model: CostModel | None = None,
                        horizon: int | None = None) -> "Balancer":
        """A new balancer with the configuration and state saved by :meth:`state_dict` (``compile``,
        ``cost_model`` and ``horizon`` as for the constructor: not part of the state)."""
        saved = read_state(state)
        config = dict(saved.config)
        accepted = set(CONFIG_KEYS)
        unknown = sorted(set(config) - accepted)
        if unknown:
            raise ValueError(f"state config has unknown keys {unknown}; accepted keys: {sorted(accepted)}")
        topology = Topology.from_dict(config.pop("topology"))
        # the window buffer is part of the state: check its size before allocating one
        shape = saved.window_buffer.shape
        expected = (config.get("window", CONFIG_DEFAULTS["window"]), config["num_layers"], config["num_experts"])
        if tuple(shape) != expected:
            raise ValueError(f"state window_buffer has shape {tuple(shape)}, the config says [window, num_layers, "
                             f"num_experts] = {list(expected)}")
        deployment = make_deployment(config.pop("num_experts"), topology=topology, num_groups=config.pop("num_groups", None))
        balancer = cls(config.pop("num_layers"), deployment, compile=compile, cost_model=cost_model, horizon=horizon,
                       **config)
        balancer.load_state_dict(state)
        return balancer


def commit_range(layers, num_layers: int) -> tuple[int, int]:
    """The ``(start, stop)`` layers a commit switches: ``layers`` checked (``None``: every layer)."""
    if layers is None:
        return 0, num_layers
    try:
        start, stop = (as_int(v, "layers entry") for v in layers)
    except (TypeError, ValueError):
        raise ValueError(f"layers must be None or a (start, stop) pair of integer layer indices, "
                         f"got {layers!r}") from None
    if not 0 <= start < stop <= num_layers:
        raise ValueError(f"layers must satisfy 0 <= start < stop <= {num_layers}, got {layers!r}")
    return start, stop


def change_for(current: Deployment, deployment, gpu_map) -> DeploymentChange | None:
    """The deployment change a rebalance crosses from ``current`` (the deployment in service), or
    ``None`` (``deployment=None``, or a change that changes nothing).

    ``deployment``: the :class:`Deployment` to serve next (``gpu_map``: the new index of each GPU
    of ``current``, ``-1`` gone; ``None``: by index) or a :class:`DeploymentChange` from
    ``current``. ``ValueError`` naming the argument and the rule: ``gpu_map`` without
    ``deployment`` or beside a change, of the wrong length, out of range or mapping two GPUs to one
    (:class:`DeploymentChange`), another number of experts, fewer slots than experts, a dispatch
    rule that is not an even split, a change that does not start from ``current``."""
    if deployment is None:
        if gpu_map is not None:
            raise ValueError("gpu_map needs deployment=, the deployment to serve next")
        return None
    if isinstance(deployment, DeploymentChange):
        if gpu_map is not None:
            raise ValueError("give gpu_map in the DeploymentChange or as gpu_map=, not both")
        change = deployment
        if change.old.topology != current.topology or change.old.num_experts != current.num_experts:
            raise ValueError("deployment: the DeploymentChange must start from the deployment in service "
                             f"({current.num_experts} experts, slots per GPU {current.topology.slots_per_gpu.tolist()})")
    elif isinstance(deployment, Deployment):
        change = DeploymentChange(current, deployment, gpu_map)
    else:
        raise ValueError(f"deployment must be an eplb.Deployment or eplb.DeploymentChange, got "
                         f"{type(deployment).__name__}")
    new = change.new
    if dispatch_rule(new.dispatch).kind != "uniform":
        raise ValueError(f"deployment: the Balancer plans for an even split; dispatch={new.dispatch!r} plans from "
                         "scratch (eplb.plan)")
    if new.num_slots < new.num_experts:
        survivors = max(int((new.topology.slots_per_gpu > 0).sum()), 1)
        raise ValueError(f"deployment: {new.num_slots} slots for {new.num_experts} experts after the change "
                         f"({change.describe()}); every expert needs a slot: give the {survivors} GPUs "
                         f"{-(-new.num_experts // survivors)} slots each")
    return None if change.is_identity else change


def recovery_summary(placement: Placement, transfer: TransferPlan, cost_model: CostModel | None = None) -> dict:
    """What putting a plan across a deployment change in service takes, summed over layers:
    ``orphans`` (experts with no replica left, loaded from host memory once each), ``copy_floor``
    (the fewest copies any re-plan makes), ``copies`` (:meth:`TransferPlan.counts`, by kind),
    ``expert_bytes`` (one expert's weights in one layer: the transfer plan's, else the cost
    model's; ``None`` without either), ``bytes`` (copies times ``expert_bytes``), ``recovery_s``
    (:meth:`eplb.CostModel.transfer_time` at that same size: the GPU copies, then the host loads,
    then the copies that read them, at the cost model's bandwidths; ``None`` without a cost model)
    and ``tolerance`` (the one the re-plan used, ``info["tolerance"]``). ``placement``: planned
    across the change (``info`` with ``orphans [L]`` and ``copy_floor [L]``); ``transfer``: its
    copies. Bytes and seconds are priced with one size (issue 47 item 20: the seconds used the
    cost model's where the bytes used ``expert_bytes``)."""
    counts = transfer.counts()
    size = transfer.expert_bytes if transfer.expert_bytes is not None else (
        None if cost_model is None else cost_model.expert_bytes)
    seconds = None
    if cost_model is not None:
        priced = cost_model if size == cost_model.expert_bytes else cost_model.with_(expert_bytes=float(size))
        seconds = float(priced.transfer_time(transfer))
    return {"orphans": int(np.sum(placement.info["orphans"])), "copy_floor": int(np.sum(placement.info["copy_floor"])),
            "copies": counts, "expert_bytes": None if size is None else int(size),
            "bytes": None if size is None else {k: int(v * size) for k, v in counts.items()},
            "recovery_s": seconds, "tolerance": placement.info.get("tolerance")}


def merged_placement(in_service: Placement, placement: Placement, start: int, stop: int, num_groups) -> Placement:
    """The placement in service once layers ``start <= l < stop`` of ``placement`` are committed:
    ``placement`` itself when that makes every layer its own, else a ``"mixed"`` one (of the
    balancer's ``num_groups``)."""
    if (start, stop) == (0, in_service.num_layers):
        return placement
    mixed = in_service.phy2log.copy()
    mixed[start:stop] = placement.phy2log[start:stop]
    if np.array_equal(mixed, placement.phy2log):
        return placement
    return Placement(mixed, in_service.num_experts, in_service.topology, num_groups, method="mixed")


CONFIG_KEYS = ("num_layers", "num_experts", "topology", "num_groups", "window", "decay", "forecast", "method",
               "tolerance", "max_moves", "min_gain", "move_cost", "expert_bytes", "options", "threads",
               "subwindows", "copy_cost")
"""The keys of a saved configuration (``state_dict()["config"]``)."""


CONFIG_DEFAULTS = {"window": inspect.signature(Balancer).parameters["window"].default}
"""What a saved configuration means by a key it leaves out (the constructor's default)."""

STATE_KEYS = ("format_version", "config", "window_buffer", "position", "filled", "steps", "rebalances", "phy2log")
"""The keys of :meth:`Balancer.state_dict`."""


@dataclass(frozen=True)
class SavedState:
    """A :meth:`Balancer.state_dict` read back and checked for types (:func:`read_state`).

    Attributes:
        config: the saved configuration (a dict of :data:`CONFIG_KEYS`, ``topology`` a dict).
        window_buffer: ``[window, L, E]`` float64; phy2log: ``[L, S]`` integer array.
        position, filled, steps, rebalances: non-negative ints.
    """

    config: dict
    window_buffer: np.ndarray
    phy2log: np.ndarray
    position: int
    filled: int
    steps: int
    rebalances: int


def read_state(state) -> SavedState:
    """Read a saved state (a dict, an ``np.load`` result or JSON lists) or raise ``ValueError``
    naming the key and the rule it breaks: every key of :data:`STATE_KEYS` present, a supported
    ``format_version``, ``config`` a JSON object with ``num_layers``, ``num_experts`` and
    ``topology``, ``window_buffer`` a numeric array, ``phy2log`` an integer array, the counters
    non-negative integers. Shapes and values against a configuration are the caller's to check."""
    if not isinstance(state, Mapping):  # a dict, or what np.load returns for an .npz
        raise ValueError(f"state must be a mapping of {list(STATE_KEYS)} (Balancer.state_dict()), "
                         f"got {type(state).__name__}")
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"state is missing the keys {missing}")
    version = _state_int(state, "format_version")
    if version != STATE_VERSION:
        raise ValueError(f"unsupported balancer state format_version {version} (this eplb reads {STATE_VERSION})")
    text = np.asarray(state["config"])
    if text.ndim != 0 or text.dtype.kind not in "US":
        raise ValueError(f"state config must be a JSON string (an object of {list(CONFIG_KEYS)}), got {text!r}")
    try:
        config = json.loads(str(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"state config must be a JSON object, could not parse it: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"state config must be a JSON object of {list(CONFIG_KEYS)}, got {type(config).__name__} "
                         f"{config!r}"[:300])
    needed = sorted({"num_layers", "num_experts", "topology"} - set(config))
    if needed:
        raise ValueError(f"state config is missing the keys {needed}")
    for key in ("num_layers", "num_experts", "window"):
        if key in config:
            as_int(config[key], f"state config {key}", minimum=1)
    buffer = _state_array(state, "window_buffer", np.float64, "a numeric array [window, num_layers, num_experts]")
    phy2log = _state_array(state, "phy2log", None, "an integer array [num_layers, num_slots] of expert ids")
    if phy2log.dtype.kind not in "iu":
        raise ValueError(f"state phy2log must hold integer expert ids, got dtype {phy2log.dtype}")
    position, filled, steps, rebalances = (_state_int(state, key) for key in ("position", "filled", "steps",
                                                                              "rebalances"))
    return SavedState(config, buffer, phy2log, position, filled, steps, rebalances)


def _state_array(state, key: str, dtype, rule: str) -> np.ndarray:
    """``state[key]`` as a numpy array (of ``dtype`` when given), else ``ValueError`` saying ``rule``."""
    try:
        array = np.asarray(state[key], dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"state {key} must be {rule}: {exc}") from None
    if array.dtype == object:
        raise ValueError(f"state {key} must be {rule}, got objects")
    return array


def _state_int(state, key: str) -> int:
    """``state[key]`` as a non-negative int (a 0-d array, a number): floats and bools are refused."""
    try:
        value = np.asarray(state[key])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"state {key} must be one integer: {exc}") from None
    if value.ndim != 0:
        raise ValueError(f"state {key} must be one integer, got shape {value.shape}")
    return as_int(value.item(), f"state {key}", minimum=0)


def check_counts(counts, num_layers: int, num_experts: int, num_slots: int, physical: bool | None):
    """One forward pass's counts checked for shape (:meth:`Balancer.record`): returns ``(counts,
    physical)``, ``counts`` a numpy array ``[L, E]`` (``physical=False``) or ``[L, S]`` (``True``);
    ``physical=None`` is inferred from the shape unless ``E == S``."""
    if type(counts) is not np.ndarray or counts.dtype not in STAGED_DTYPES:  # else already a real numpy array
        counts = _counts_array(counts)
    if counts.ndim != 2 or counts.shape[0] != num_layers or counts.shape[1] not in (num_experts, num_slots):
        raise ValueError(
            f"counts must have shape [L, E] = [{num_layers}, {num_experts}] or per slot "
            f"[L, S] = [{num_layers}, {num_slots}], got {counts.shape}"
        )
    if physical is None:
        if num_experts == num_slots:
            raise ValueError("E == S: pass physical=True (per-slot counts) or physical=False (per expert)")
        return counts, counts.shape[1] == num_slots
    expected = num_slots if physical else num_experts
    if counts.shape[1] != expected:
        raise ValueError(f"counts must have {expected} columns with physical={physical}, got {counts.shape[1]}")
    return counts, bool(physical)


FLOAT64_MAX = float(np.finfo(np.float64).max)

COUNT_HEADROOM = 1024.0
"""Room :func:`pass_count_limit` leaves above the largest sum of a window: what is computed from
the sums (a forecast along a trend, the hedged plan's sub-window peaks, prices) stays finite."""


def pass_count_limit(window: int, forecast: int, num_experts: int, num_slots: int) -> float:
    """The largest count a balancer's ``record`` takes: float64's largest value over
    ``COUNT_HEADROOM * (window + forecast) * max(E, S)``, so a layer's total over the window, carried
    ``forecast`` passes along its trend, cannot overflow (about 1e300 at DeepSeek-V3 size; counts are
    scale-free, so only values no engine records are refused)."""
    return FLOAT64_MAX / (COUNT_HEADROOM * (window + forecast) * max(num_experts, num_slots))


def bad_count_error(counts: np.ndarray, staged: np.ndarray, limit: float) -> ValueError:
    """The ``ValueError`` for a pass ``counts`` whose staged copy ``staged`` (the same shape) holds a
    value :func:`~eplb.kernels.plumbing.load_window.first_bad_count` refuses under ``limit``."""
    bad = first_bad_count(staged, limit)
    value = staged.flat[bad]
    if value >= 0 and np.isfinite(value):  # finite and non-negative: too large
        return ValueError(f"counts must be at most {limit:.3g} (beyond it the window's sums overflow float64; "
                          f"counts are scale-free: divide them by a common factor), found {counts.flat[bad]} at "
                          f"flat index {bad}")
    return ValueError(f"counts must be finite and non-negative, found {counts.flat[bad]} at flat index {bad}")


def stage_counts(counts: np.ndarray, staged: np.ndarray, limit: float) -> None:
    """Copy ``counts`` (any real dtype) into ``staged``, float64 of the same shape, and refuse
    (``ValueError``) a value that is not finite and non-negative or is above ``limit``
    (:func:`pass_count_limit`)."""
    if counts.dtype in STAGED_DTYPES and counts.flags.c_contiguous and counts.flags.writeable:
        if not copy_counts(counts, staged, limit):  # the engine's case: one compiled pass
            return
    else:
        # any other real dtype (float16, longdouble, big-endian, any integer width) or layout to
        # float64 in place: values beyond float64's range become inf and are refused just below
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(staged, counts, casting="unsafe")
        if first_bad_count(staged, limit) < 0:
            return
    raise bad_count_error(counts, staged, limit)


def fold_pass(counts: np.ndarray, phy2log: np.ndarray, staged: np.ndarray, out: np.ndarray, limit: float) -> None:
    """One pass's counts per slot ``counts [L, S]``, checked and copied into ``staged [L, S]``
    float64 (:func:`stage_counts`), summed per expert into ``out [L, E]`` float64 through
    ``phy2log [L, S]``: what :meth:`Balancer.record` keeps of a pass per slot. A worker whose
    staging rows are narrower than a grown deployment's slots hands the pass over so. ``limit``: the
    largest count accepted (:func:`pass_count_limit`)."""
    stage_counts(counts, staged, limit)
    store_physical(staged, phy2log, out)


def _counts_array(counts) -> np.ndarray:
    """One forward pass's counts as a numpy array of real numbers (not copied when already one).

    Torch tensors: dense, on any real device; bfloat16 (which numpy lacks) is widened on the
    tensor's device first. Sparse, meta and complex inputs get a ``ValueError``.
    """
    if type(counts).__module__.split(".")[0] == "torch":
        layout = str(getattr(counts, "layout", "torch.strided"))
        if layout != "torch.strided":
            raise ValueError(f"counts must be a dense tensor, got layout {layout} (call .to_dense() first)")
        if counts.device.type == "meta":
            raise ValueError("counts is a meta tensor (shape only, no values): pass a tensor holding the counts")
        if counts.is_complex():
            raise ValueError(f"counts must hold real numbers, got dtype {counts.dtype}")
        counts = counts.detach()
        if str(counts.dtype) == "torch.bfloat16":
            counts = counts.float()
        counts = counts.cpu().numpy()
    counts = np.asarray(counts)
    if counts.dtype.kind == "c":
        raise ValueError(f"counts must hold real numbers, got complex dtype {counts.dtype}")
    if counts.dtype.kind not in "biuf":
        raise ValueError(f"counts must hold numbers, got dtype {counts.dtype}")
    return counts


def _warm_window_kernels(num_layers: int, num_experts: int, num_slots: int) -> None:
    """Compile (or load from the cache) the kernels :meth:`Balancer.record` and
    :meth:`Balancer.window_counts` call, with the array types they pass."""
    logical = np.zeros((num_layers, num_experts))
    warm_copy_counts()
    store_logical(logical, np.zeros((num_layers, num_experts)))
    phy2log = np.zeros((num_layers, num_slots), np.int64) % num_experts
    phy2log.setflags(write=False)  # record(physical=True) passes a placement's read-only phy2log
    store_physical(np.zeros((num_layers, num_slots)), phy2log, np.zeros((num_layers, num_experts)))
    weighted_window(np.zeros((1, num_layers, num_experts)), np.ones(1), np.zeros((num_layers, num_experts)))
    level, slope, out = (np.zeros((num_layers, num_experts)) for _ in range(3))
    window_residuals(np.zeros((1, num_layers, num_experts)), np.ones(1), np.zeros(1), level, slope,
                     np.ones((num_layers, num_experts)), out)


def _warm_loads(num_layers: int, num_experts: int) -> list[np.ndarray]:
    """Passes ``[L, E]`` that take a balancer through its planning paths: skewed loads, the same
    loads on other experts (the search from the placement in service stalls), a small drift (it
    does not), a dense (all-zero) layer and a one-hot layer. Fixed seed."""
    rng = np.random.default_rng(0)
    skewed = np.floor(rng.pareto(1.0, (num_layers, num_experts)) * 100.0) + 1.0
    moved = skewed[:, rng.permutation(num_experts)]
    drifted = np.floor(moved * rng.uniform(0.8, 1.25, moved.shape))
    extreme = drifted.copy()
    extreme[0] = 0.0
    extreme[-1] = 0.0
    extreme[-1, num_experts // 2] = 1e6
    return [skewed, moved, drifted, extreme]


@contextlib.contextmanager
def _throwaway_warnings_hidden():
    """Hide the warning that the throw-away balancer's round-robin start spreads groups over more
    slots than its move budget allows: it is about no placement of the caller's. Warning filters are
    process-wide and not thread-safe, so they change only on the main thread (a background compile
    may show it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SPREAD_WARNING, category=RuntimeWarning)
        warnings.filterwarnings("ignore", message=RELAXED_WARNING, category=RuntimeWarning)  # its change (_warm_change)
        warnings.filterwarnings("ignore", message=MAX_MOVES_WARNING, category=RuntimeWarning)  # ditto
        yield


def warm_kernels(deployment: Deployment, *, method: str = DEFAULT_METHOD, tolerance: float | None | str = AUTO,
                 max_moves: int | None | str = AUTO, options: dict | None = None) -> float:
    """Compile (or load from Numba's cache) every kernel a :class:`Balancer` of this ``deployment``
    and these options calls when it records, decides and rebalances. Returns the seconds it took.

    It runs a throw-away two-layer balancer of the same configuration (a window of two passes: its
    plans hedge over two sub-windows) through every planning path
    (from the round-robin layout, then from its own plans on shifted, drifted, dense and one-hot
    loads), so the kernels are compiled for the very array types the serving loop passes. The
    number of layers does not change what is compiled. A configuration already warmed in this
    process returns at once (what it compiled stays compiled).
    """
    start = time.perf_counter()
    num_experts = deployment.num_experts
    tolerance, max_moves = move_settings(tolerance, max_moves, deployment.topology)
    key = json.dumps([num_experts, deployment.topology.to_dict(), deployment.num_groups, method, tolerance is None,
                      max_moves is None, options or {}], sort_keys=True, default=str)
    if key in _WARMED:
        return 0.0
    balancer = Balancer(2, deployment, window=2, method=method, tolerance=tolerance, max_moves=max_moves,
                        min_gain=0.0, move_cost=0.0, options=options, compile="lazy")
    num_slots = balancer.topology.num_slots
    _warm_window_kernels(2, num_experts, num_slots)
    warm_search_kernels(balancer.topology)
    with _throwaway_warnings_hidden():
        for load in _warm_loads(2, num_experts):
            balancer.record(load, physical=False)
            balancer.should_rebalance()
            placement, transfer = balancer.rebalance()
            transfer.counts()
            balancer.record(np.ones((2, num_slots)), physical=True)
            balancer.rebalance(commit=False)  # planned again: not the cached candidate
        _warm_change(balancer)
    _WARMED.add(key)
    return time.perf_counter() - start


_WARMED: set[str] = set()  # configurations warm_kernels has run in this process


def _warm_change(balancer: Balancer) -> None:
    """Take a throw-away ``balancer`` across a deployment change, so the kernels of the re-plan and
    of its transfer plan are compiled before a GPU is lost in service: one more slot on every GPU
    with slots (the kernels are the same for any change; this one keeps a uniform deployment
    uniform, which every method plans)."""
    deployment = balancer.deployment
    slots = deployment.topology.slots_per_gpu
    grown = Topology(slots + (slots > 0), deployment.topology.num_nodes)
    change = DeploymentChange(deployment, make_deployment(deployment.num_experts, topology=grown,
                                                          num_groups=deployment.num_groups,
                                                          dispatch=deployment.dispatch))
    placement, transfer = balancer.rebalance(deployment=change)
    transfer.counts()


def move_settings(tolerance, max_moves, topology: Topology) -> tuple[float | None, int | None]:
    """The Balancer's ``(tolerance, max_moves)`` from its arguments, ``"auto"``
    (:data:`~eplb.model.defaults.AUTO`) resolved: ``max_moves`` to
    :func:`~eplb.model.defaults.balancer_move_budget` of the topology's slots per GPU, ``tolerance``
    to 0 with a move budget and to :data:`~eplb.model.defaults.BALANCER_TOLERANCE` without one; the
    others checked (``ValueError`` naming the argument and the rule)."""
    for name, value in (("tolerance", tolerance), ("max_moves", max_moves)):
        if isinstance(value, str) and value != AUTO:
            raise ValueError(f"{name} must be a number, None or {AUTO!r}, got {value!r}")
    if max_moves == AUTO:
        max_moves = balancer_move_budget(slots_per_gpu(topology))
    elif max_moves is not None:
        max_moves = as_int(max_moves, "max_moves", minimum=0)
    if tolerance == AUTO:
        tolerance = BALANCER_TOLERANCE if max_moves is None else 0.0
    elif tolerance is not None:
        try:
            tolerance = float(tolerance)
        except (TypeError, ValueError):
            raise ValueError(f"tolerance must be a non-negative number, None or {AUTO!r}, got {tolerance!r}") from None
        if not (np.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"tolerance must be a non-negative number, None or {AUTO!r}, got {tolerance}")
    if tolerance is None and max_moves is None:
        raise ValueError("give tolerance, max_moves or both")
    return tolerance, max_moves


def _non_negative(value, name: str) -> float:
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number, got {value}")
    return value
