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
:data:`BALANCER_TOLERANCE`  0.03   :class:`eplb.Balancer`: every rebalance, a change included
                                   (``rebalance(deployment=...)``), and the policies built on it
==========================  =====  ==========================================================

Every result says the one it used: ``placement.info["tolerance"]``, the Balancer's
``info["recovery"]["tolerance"]`` across a change, the re-plan policy's label.
"""


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
"""The :class:`eplb.Balancer`'s migration tolerance: looser than :data:`PLAN_TOLERANCE` because it
replans every window; on the drifting DeepSeek-V3-sized series of ``bench/simulate.py`` it lost
the least MoE time, weight-copy stalls included (0.005 moved twice the weights: a lower balance
time but more stalls). The Balancer re-plans across a deployment change with it too, not with
:data:`CHANGE_TOLERANCE`: its next routine rebalance restores the balance a looser recovery left,
and fewer copies shorten the recovery (a Balancer given ``tolerance=`` uses that for both)."""

COPY_COST = 0.0005
"""A hedged plan's price of one changed slot, in mean ``peak / mean`` of the windows it serves
(``plan(series, previous=...)`` and the Balancer's hedge)."""
