"""The package's tuned defaults, in one place (each chosen on held-out windows; the figures that
chose them are in ``bench/results``).

The migration tolerance (how far above the best plan's peak a plan near the placement in service
may be, to copy fewer experts) has three defaults, each where it was measured best:

==========================  =====  ==========================================================
constant                    value  used by (when no ``tolerance`` is given)
==========================  =====  ==========================================================
:data:`PLAN_TOLERANCE`      0.005  :func:`eplb.plan` with ``previous=`` on the same deployment
                                   (a one-off rebalance), vLLM's adapter
:data:`CHANGE_TOLERANCE`    0.01   :func:`eplb.plan` across a deployment change, the simulator's
                                   re-plan policy (:class:`eplb.serving.policy.Replan`)
:data:`RECOVERY_TOLERANCE`  0.005  ``eplb plan --previous`` across a change (the recovery from
                                   a series' summed windows, judged against its in-service balance)
:data:`BALANCER_TOLERANCE`  0.03   :class:`eplb.Balancer` above 4 slots per GPU, a change
                                   included (``rebalance(deployment=...)``); at 4 or fewer, 0
                                   within a move budget of one GPU's slots (:data:`AUTO`)
==========================  =====  ==========================================================

Every result says the one it used: ``placement.info["tolerance"]``, the Balancer's
``info["recovery"]["tolerance"]`` across a change, the re-plan policy's label.
"""

import numpy as np


class Default(float):
    """A default number, told apart from the same number a caller passes: :func:`eplb.plan` uses
    :data:`CHANGE_TOLERANCE` across a change when no tolerance is given, and the identity of a
    plain float cannot say so (equal constants of one module are one object, so a caller's 0.005
    could be taken for the default)."""

    __slots__ = ()


PLAN_TOLERANCE = Default(0.005)
""":func:`eplb.plan` with ``previous=``: how far (a fraction) above the best plan's peak a plan
near the placement in service may be, to move fewer experts."""

CHANGE_TOLERANCE = 0.01
""":func:`eplb.plan` across a deployment change (GPUs lost or added, ``previous=`` on another
deployment) when no ``tolerance`` is given: the search stops within this fraction of the better of
a fresh plan's peak and the service's own balance. Chosen in ``bench/elastic.py`` (DeepSeek-V3 size,
one GPU or a node lost, grown 32 -> 40 GPUs, hierarchical GPU loss; mixed workloads, drift and the
public traces): on the 8 windows after those planned on, 0.005 / 0.01 / 0.02 / 0.05 served 0.8360 /
0.8356 / 0.8331 / 0.8258 mean balancedness at 2.56 / 2.27 / 1.96 / 1.50 times the copy floor. 0.01
is the loosest within 0.001 of the best held out (its cells differ from 0.005's by -0.007 to +0.005):
11% fewer copies than 0.005 (15% for one GPU lost), so a faster recovery, for no held-out balance
one can tell apart; in sample it still reaches 0.99 after a GPU or a node lost or GPUs added."""

RECOVERY_TOLERANCE = 0.005
"""``eplb plan``'s tolerance across a deployment change when ``--tolerance`` is not given: a max GPU
load up to 0.5% above the better of planning from scratch and the placement in service's peak. The
command line plans the recovery on a series' summed windows and promises a balancedness no worse
than the placement in service's - 0.005: at DeepSeek-V3 size (288 slots, 32 GPUs, 4 nodes, 8
groups, GPU 5 lost, 12 drifting windows) 0.005 makes 2.54x the orphan floor in copies at the
placement in service's balancedness (0.9322 -> 0.9322), where :data:`CHANGE_TOLERANCE` made 2.56x
and lost 0.0054."""

BALANCER_TOLERANCE = 0.03
"""The :class:`eplb.Balancer`'s migration tolerance without a move budget (``max_moves=None``;
its default budget: :func:`balancer_move_budget`): looser than :data:`PLAN_TOLERANCE` because it
replans every window; on the drifting DeepSeek-V3-sized series of ``bench/simulate.py`` it lost
the least MoE time, weight-copy stalls included (0.005 moved twice the weights: a lower balance
time but more stalls). The Balancer re-plans across a deployment change with it too, not with
:data:`CHANGE_TOLERANCE`: its next routine rebalance restores the balance a looser recovery left,
and fewer copies shorten the recovery (a Balancer given ``tolerance=`` uses that for both)."""

AUTO = "auto"
"""The :class:`eplb.Balancer`'s ``max_moves`` when not given: :func:`balancer_move_budget` of the
slots per GPU (a budget at 4 or fewer); its ``tolerance`` when not given: 0 with a move budget (the
most balanced plan within it), :data:`BALANCER_TOLERANCE` without one."""


def slots_per_gpu(topology) -> float:
    """``k``: the mean slots of the GPUs that hold slots (``S / G`` on a uniform topology)."""
    serving = topology.slots_per_gpu[topology.slots_per_gpu > 0]
    return float(serving.mean()) if serving.size else 1.0


BUDGET_MAX_SLOTS_PER_GPU = 4
"""Up to this many slots per GPU (one slot a quarter or more of a GPU's load) the :class:`eplb.Balancer`
has a default move budget (:func:`balancer_move_budget`); above it, none."""


def balancer_move_budget(slots: float) -> int | None:
    """The :class:`eplb.Balancer`'s default ``max_moves`` at ``slots`` per GPU (``k``): ``round(k)``
    (at least 1) up to :data:`BUDGET_MAX_SLOTS_PER_GPU` slots a GPU, else ``None`` (no budget).

    A slot carries about ``1 / k`` of its GPU's load: at 2 slots a GPU one copy replaces half a GPU's
    experts. Per layer, a rebalance then replaces at most one GPU's worth of slots, the most balanced
    plan within that (tolerance 0). Without a budget (tolerance 0.03, tuned at 9 slots a GPU) the
    Balancer changed about 30 slots per layer and rebalance at 4 and 2 slots a GPU: 1.6-1.7 times
    the copies of the engines' fewest-copying timer on the drifting DeepSeek-V3-sized series of
    ``bench/rack_online.py`` (tuning series); with one GPU's worth, 0.35x (288 / 72) and 0.14x
    (288 / 144) their copies, for 0.41x and 0.59x the better timer's MoE time lost (held out: 0.42x
    at 0.35x and 0.57x at 0.14x; racks as nodes at 288 / 144, 1.04x the global Balancer's time lost;
    ``bench/results/rack_online.md``). More slots per layer lose less time for more copies (4 at 2 a
    GPU: 0.51x at 0.25x; at 4 a GPU, 4 already make 0.35x the timers' copies). At 9 a GPU the same budget served 288 / 32 better (7.4%
    against 7.9% of the balanced time lost, 0.58x the copies) but a small deployment (72 slots on
    8 GPUs) worse (6.6% against 5.4%): above :data:`BUDGET_MAX_SLOTS_PER_GPU` the defaults stay those
    tuned there.

    Args:
        slots: ``k > 0``, e.g. :func:`slots_per_gpu` of the deployment's topology.
    """
    try:
        slots = float(slots)
    except (TypeError, ValueError):
        raise ValueError(f"slots must be a positive number of slots per GPU, got {slots!r}") from None
    if not (np.isfinite(slots) and slots > 0):
        raise ValueError(f"slots must be a positive number of slots per GPU, got {slots}")
    if slots > BUDGET_MAX_SLOTS_PER_GPU:
        return None
    return max(1, int(round(slots)))


COPY_COST = 0.0005
"""A hedged plan's price of one changed slot, in mean ``peak / mean`` of the windows it serves
(``plan(series, previous=...)`` and the Balancer's hedge)."""
