"""eplb: expert-parallel load balancing for Mixture-of-Experts serving."""

from .api import held_out, pareto, plan, rebalance_experts
from .balancer import Balancer
from .bounds import lower_bound, lower_bounds
from .cost import CostModel
from .dispatch import dispatch
from .methods import DEFAULT_METHOD, METHODS
from .placement import Placement
from .simulate import BalancerPolicy, FixedInterval, NoRebalance, SimulationResult, simulate, sglang_like, vllm_like
from .sweep import sweep
from .topology import Topology
from .transfer import TransferPlan, transfer_plan
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "Balancer",
    "BalancerPolicy",
    "CostModel",
    "DEFAULT_METHOD",
    "FixedInterval",
    "METHODS",
    "NoRebalance",
    "Placement",
    "SimulationResult",
    "Topology",
    "TransferPlan",
    "dispatch",
    "held_out",
    "lower_bound",
    "lower_bounds",
    "pareto",
    "plan",
    "rebalance_experts",
    "sglang_like",
    "simulate",
    "sweep",
    "transfer_plan",
    "vllm_like",
    "warmup",
]
