"""eplb: expert-parallel load balancing for Mixture-of-Experts serving."""

from .api import pareto, plan, rebalance_experts
from .balancer import Balancer
from .bounds import lower_bound, lower_bounds
from .dispatch import dispatch
from .methods import DEFAULT_METHOD, METHODS
from .placement import Placement
from .topology import Topology
from .transfer import TransferPlan, transfer_plan
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "Balancer",
    "DEFAULT_METHOD",
    "METHODS",
    "Placement",
    "Topology",
    "TransferPlan",
    "dispatch",
    "lower_bound",
    "lower_bounds",
    "pareto",
    "plan",
    "rebalance_experts",
    "transfer_plan",
    "warmup",
]
