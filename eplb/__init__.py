"""eplb: expert-parallel load balancing for Mixture-of-Experts serving."""

from .planning.api import held_out, pareto, plan, rebalance_experts
from .serving.balancer import Balancer
from .serving.worker import BalancerProcess
from .serving.background import BackgroundBalancer
from .analysis.bounds import lower_bound, lower_bounds
from .model.cost import CostModel
from .analysis.dispatch import dispatch
from .planning.methods import DEFAULT_METHOD, METHODS
from .analysis.placement import Placement
from .serving.policy import BalancerPolicy, FixedInterval, NoRebalance, Policy, sglang_like, vllm_like
from .simulation.simulate import SimulationResult, simulate
from .simulation.sweep import sweep
from .simulation.pools import recommend
from .model.topology import Topology
from .model.deployment import Deployment
from .model.change import DeploymentChange
from .serving.transfer import TransferPlan, transfer_plan
from .precompile import warmup
from .method_comparison import compare
from ._version import __version__

# Modules the README reaches by attribute after `import eplb` (eplb.analysis.engine_dispatch.engine_shares,
# eplb.planning.certificate.certify); the others it names are imported above through the public names.
from .analysis import engine_dispatch as _engine_dispatch  # noqa: E402,F401
from .planning import certificate as _certificate  # noqa: E402,F401

__all__ = [
    "BackgroundBalancer",
    "Balancer",
    "BalancerPolicy",
    "BalancerProcess",
    "CostModel",
    "DEFAULT_METHOD",
    "Deployment",
    "DeploymentChange",
    "FixedInterval",
    "METHODS",
    "NoRebalance",
    "Placement",
    "Policy",
    "SimulationResult",
    "Topology",
    "TransferPlan",
    "compare",
    "dispatch",
    "held_out",
    "lower_bound",
    "lower_bounds",
    "pareto",
    "plan",
    "rebalance_experts",
    "recommend",
    "sglang_like",
    "simulate",
    "sweep",
    "transfer_plan",
    "vllm_like",
    "warmup",
]
