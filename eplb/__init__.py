"""eplb: expert-parallel load balancing for Mixture-of-Experts serving."""

from .api import plan, rebalance_experts
from .bounds import lower_bound, lower_bounds
from .methods import DEFAULT_METHOD, METHODS
from .placement import Placement
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_METHOD",
    "METHODS",
    "Placement",
    "Topology",
    "lower_bound",
    "lower_bounds",
    "plan",
    "rebalance_experts",
]
