"""vLLM adapter: an EPLB policy with the interface of vLLM's ``AbstractEplbPolicy``.

vLLM asks its policy for a new placement with::

    phy2log = Policy.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                       old_global_expert_indices)

where ``weight`` is ``[layers, num_logical_experts]`` expert loads, ``old_global_expert_indices``
the placement in service (``[layers, num_replicas]``, physical slot -> logical expert) or ``None``,
and the result is ``physical_to_logical_map [layers, num_replicas]`` as an int64 torch tensor.
:class:`EplbPolicy` answers with eplb's default method and, when the current placement is given,
plans close to it (:func:`eplb.plan` with ``previous=``) so few expert weights move.

Install it before the engine starts (vLLM picks policies from ``EPLB_POLICIES``)::

    from vllm.distributed.eplb import policy
    from eplb.adapters.vllm import EplbPolicy
    policy.EPLB_POLICIES["default"] = EplbPolicy.configured(tolerance=0.005)
"""

from __future__ import annotations

import numpy as np

from .._validation import as_counts
from ..api import make_problem
from ..methods import DEFAULT_METHOD, get_method
from ..migration import plan_near


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError("the vLLM adapter returns torch tensors: pip install torch") from exc
    return torch


class EplbPolicy:
    """vLLM EPLB policy backed by eplb (class attributes set the planning; see :meth:`configured`).

    Attributes:
        method: planning method (one of ``eplb.METHODS``).
        tolerance, max_moves: migration trade-off when vLLM passes the current placement: accept a
            max GPU load up to ``1 + tolerance`` times planning from scratch, change at most
            ``max_moves`` slots per layer.
        options: passed to the method.
    """

    method: str = DEFAULT_METHOD
    tolerance: float | None = 0.005
    max_moves: int | None = None
    options: dict = {}

    @classmethod
    def configured(cls, *, method: str = DEFAULT_METHOD, tolerance: float | None = 0.005, max_moves=None,
                   **options) -> type["EplbPolicy"]:
        """A subclass with these settings (vLLM instantiates nothing: it calls the classmethod)."""
        get_method(method)
        return type(cls.__name__, (cls,), {"method": method, "tolerance": tolerance, "max_moves": max_moves,
                                            "options": dict(options)})

    @classmethod
    def rebalance_experts(cls, weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                          old_global_expert_indices=None):
        """New placement for the loads ``weight``.

        Args:
            weight: ``[L, E]`` load of each logical expert (torch tensor or array).
            num_replicas: physical experts (slots) ``S``, a multiple of ``num_ranks``.
            num_groups: expert groups (hierarchical placement when divisible by ``num_nodes``);
                ``None`` or 0 for models without groups.
            num_nodes: nodes; num_ranks: EP ranks (GPUs), a multiple of ``num_nodes``.
            old_global_expert_indices: ``[L, S]`` the placement in service, or ``None``. Ignored
                (plan from scratch) when its shape differs, e.g. after the EP size changed.
        Returns:
            ``phy2log [L, S]`` int64 torch tensor, on ``weight``'s device when it is a tensor.
        """
        torch = _torch()
        weights = as_counts(weight, "weight", ndims=(2,))
        problem = make_problem(weights.shape[1], num_replicas, num_ranks, num_nodes, num_groups or None)
        previous = None
        if old_global_expert_indices is not None:
            old = old_global_expert_indices
            if isinstance(old, torch.Tensor):
                old = old.detach().cpu().numpy()
            old = np.asarray(old)
            if old.shape == (weights.shape[0], problem.topology.num_slots):
                from ..migration import as_previous

                previous = as_previous(old, weights.shape[1], problem, weights.shape[0])
        phy2log, _ = plan_near(weights, problem, previous, method=cls.method, tolerance=cls.tolerance,
                               max_moves=cls.max_moves, options=cls.options)
        result = torch.from_numpy(np.ascontiguousarray(phy2log, dtype=np.int64))
        if isinstance(weight, torch.Tensor):
            result = result.to(weight.device)
        return result
