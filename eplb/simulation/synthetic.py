"""Realistic synthetic expert loads for the demo, tests and benchmarks.

Real MoE routers give skewed loads: a few hot experts carry several times the mean, hot groups
exist under group-limited routing, the hot set moves when the traffic changes, and dense layers
record nothing. These generators reproduce those features from a seed (same seed, same counts).
"""

from __future__ import annotations

import numpy as np

from ..model._validation import as_int

FAMILIES = ("lognormal", "zipf", "uniform", "hot")


def expert_popularity(num_layers: int, num_experts: int, *, family: str = "lognormal", skew: float = 0.7,
                      num_groups: int | None = None, rng: np.random.Generator) -> np.ndarray:
    """Routing probabilities ``[L, E]`` (rows sum to 1).

    Families:
        ``lognormal``: log-popularity ~ N(0, skew^2), plus a per-group factor when ``num_groups``.
        ``zipf``: popularity ~ rank^-skew, ranks shuffled per layer.
        ``uniform``: every expert equally popular.
        ``hot``: uniform, except ``max(1, E // 32)`` experts that are ``skew``-times 10 as popular.
    """
    if family == "lognormal":
        logits = rng.normal(0.0, skew, size=(num_layers, num_experts))
        if num_groups:
            group_factor = rng.normal(0.0, skew / 3, size=(num_layers, num_groups))
            logits += np.repeat(group_factor, num_experts // num_groups, axis=1)
        weights = np.exp(logits)
    elif family == "zipf":
        ranks = np.argsort(rng.random((num_layers, num_experts)), axis=1) + 1.0
        weights = ranks ** (-skew)
    elif family == "uniform":
        weights = np.ones((num_layers, num_experts))
    elif family == "hot":
        weights = np.ones((num_layers, num_experts))
        num_hot = max(1, num_experts // 32)
        for layer in range(num_layers):
            weights[layer, rng.choice(num_experts, num_hot, replace=False)] = 10.0 * skew
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return weights / weights.sum(axis=1, keepdims=True)


def skewed_counts(num_layers: int, num_experts: int, *, family: str = "lognormal", skew: float = 0.7,
                  tokens: int = 16384, top_k: int = 8, num_groups: int | None = None,
                  dense_layers: tuple[int, ...] = (), seed: int = 0) -> np.ndarray:
    """Token counts ``[L, E]`` int64: ``tokens * top_k`` routings per layer drawn from
    :func:`expert_popularity`; the layers in ``dense_layers`` are all zero."""
    num_layers = as_int(num_layers, "num_layers", minimum=1)
    num_experts = as_int(num_experts, "num_experts", minimum=1)
    rng = np.random.default_rng(seed)
    probs = expert_popularity(num_layers, num_experts, family=family, skew=skew, num_groups=num_groups, rng=rng)
    counts = np.stack([rng.multinomial(tokens * top_k, p) for p in probs]).astype(np.int64)
    counts[list(dense_layers)] = 0
    return counts


def drifting_counts(num_windows: int, num_layers: int, num_experts: int, *, drift: float = 0.1,
                    family: str = "lognormal", skew: float = 0.7, tokens: int = 4096, top_k: int = 8,
                    num_groups: int | None = None, seed: int = 0) -> np.ndarray:
    """A series ``[T, L, E]`` int64 whose hot experts move: each window, every expert's
    log-popularity takes a random step of size ``drift * skew`` (a random walk around the start)."""
    num_windows = as_int(num_windows, "num_windows", minimum=1)
    rng = np.random.default_rng(seed)
    probs = expert_popularity(num_layers, num_experts, family=family, skew=skew, num_groups=num_groups, rng=rng)
    logits = np.log(probs)
    series = np.empty((num_windows, num_layers, num_experts), np.int64)
    for t in range(num_windows):
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        series[t] = np.stack([rng.multinomial(tokens * top_k, row) for row in p])
        logits = logits + rng.normal(0.0, drift * max(skew, 0.1), size=logits.shape)
    return series


# The built-in example: a DeepSeek-V3-sized model (58 MoE layers x 256 routed experts, 8 groups,
# top-8) on 32 GPUs in 4 nodes with 288 slots (9 per GPU, 32 redundant replicas).
DEEPSEEK_V3 = dict(num_layers=58, num_experts=256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8, top_k=8)


def deepseek_v3_counts(seed: int = 0) -> np.ndarray:
    """Realistic skewed counts ``[58, 256]`` for the DeepSeek-V3-sized example."""
    c = DEEPSEEK_V3
    return skewed_counts(c["num_layers"], c["num_experts"], num_groups=c["num_groups"], top_k=c["top_k"], seed=seed)
