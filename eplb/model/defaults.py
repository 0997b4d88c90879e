"""The package's tuned defaults, in one place (each chosen on held-out windows; the figures that
chose them are in ``bench/results``)."""

PLAN_TOLERANCE = 0.005
""":func:`eplb.plan` with ``previous=``: how far (a fraction) above the best plan's peak a plan
near the placement in service may be, to move fewer experts."""

BALANCER_TOLERANCE = 0.03
"""The :class:`eplb.Balancer`'s migration tolerance: looser than :data:`PLAN_TOLERANCE` because it
replans every window; on the drifting DeepSeek-V3-sized series of ``bench/simulate.py`` it lost
the least MoE time, weight-copy stalls included (0.005 moved twice the weights: a lower balance
time but more stalls)."""

COPY_COST = 0.0005
"""A hedged plan's price of one changed slot, in mean ``peak / mean`` of the windows it serves
(``plan(series, previous=...)`` and the Balancer's hedge)."""
