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

import inspect
import json
import threading
import time
import weakref

import numpy as np

from ..model.defaults import AUTO, COPY_COST
from ..model._validation import as_int
from ..model.change import DeploymentChange
from ..model.deployment import Deployment, deployment_argument, make_deployment
from ..engines import dispatch_rule
from ..analysis.bounds import average_bound, replica_bound
from ..model.cost import CostModel
from ..kernels.plumbing.load_window import (first_bad_count, store_logical, store_physical, weighted_window,
                                            window_residuals)
from ..planning.methods import DEFAULT_METHOD, get_method
from ..planning.migration import warm_search_kernels
from ..analysis.metrics import balancedness
from ..analysis.placement import Placement
from ..model.topology import Topology
from .balancer_change import ChangeHandling, change_for
from .balancer_decision import HORIZON_WINDOWS, DecisionSide, move_settings
from .balancer_state import CONFIG_KEYS, STATE_VERSION, SavedConfig, read_state
from .balancer_warmup import throwaway_warnings_hidden, warm_change, warm_loads, warm_window_kernels
from .layer_commits import commit_range, merged_placement
from .pass_counts import check_counts, pass_count_limit, stage_counts
from .transfer import TransferPlan, transfer_plan

COMPILE_MODES = ("eager", "background", "lazy")


def round_robin_placement(num_layers: int, num_experts: int, topology: Topology, num_groups=None) -> Placement:
    """The layout engines start from: slot ``s`` holds expert ``s % E`` in every layer."""
    row = np.arange(topology.num_slots, dtype=np.int64) % num_experts
    return Placement(np.tile(row, (num_layers, 1)), num_experts, topology, num_groups, method="round_robin")


FORECAST_MIN_PASSES = 10
"""Fewer recorded passes than this: no trend is fitted (see :meth:`Balancer.planning_counts`)."""

SUBWINDOWS = 10
"""The Balancer hedges its plans over this many sub-windows of its window (see :class:`Balancer`)."""


class Balancer(DecisionSide, ChangeHandling, SavedConfig):
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
            :data:`~eplb.serving.balancer_decision.HORIZON_WINDOWS`; placements serve several windows
            between rebalances, and one window under-counted the savings: the Balancer rebalanced too
            rarely and lost more time, stalls included, on the series of ``bench/decision_rule.py``);
            with ``cost_model`` only.
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
            warm_window_kernels(self.num_layers, self.num_experts, self.topology.num_slots)
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
        """The largest count :meth:`record` takes (:func:`~eplb.serving.pass_counts.pass_count_limit` of this balancer's
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
                ``recovery`` (:func:`~eplb.serving.balancer_change.recovery_summary`: orphans, copies,
                bytes and the estimated seconds at the cost model's bandwidths); the
                :class:`TransferPlan` loads each orphan from host memory once and never reads a lost GPU. Committed later, it is committed
                whole (``commit(placement)``), before any other commit. Bad input (see
                :func:`~eplb.serving.balancer_change.change_for`) is a ``ValueError`` and changes
                nothing; the deployment in service itself (a change that changes nothing) is a plain rebalance.
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
        malformed state is a ``ValueError`` naming the key and the rule
        (:func:`~eplb.serving.balancer_state.read_state`)."""
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
    warm_window_kernels(2, num_experts, num_slots)
    warm_search_kernels(balancer.topology)
    with throwaway_warnings_hidden():
        for load in warm_loads(2, num_experts):
            balancer.record(load, physical=False)
            balancer.should_rebalance()
            placement, transfer = balancer.rebalance()
            transfer.counts()
            balancer.record(np.ones((2, num_slots)), physical=True)
            balancer.rebalance(commit=False)  # planned again: not the cached candidate
        warm_change(balancer)
    _WARMED.add(key)
    return time.perf_counter() - start


_WARMED: set[str] = set()  # configurations warm_kernels has run in this process


CONFIG_DEFAULTS = {"window": inspect.signature(Balancer).parameters["window"].default}
"""What a saved configuration means by a key it leaves out (the constructor's default)."""


def _non_negative(value, name: str) -> float:
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number, got {value}")
    return value
