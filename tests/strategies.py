"""Hypothesis strategies: placement configurations and expert counts, realistic and nasty."""

import numpy as np
from hypothesis import strategies as st


@st.composite
def configs(draw, max_experts=32, max_gpus=8, max_slots_per_gpu=6, hierarchical=None):
    """A valid ``dict(num_experts, num_slots, num_gpus, num_nodes, num_groups)``."""
    num_nodes = draw(st.sampled_from([1, 2, 4]))
    num_gpus = num_nodes * draw(st.integers(1, max(1, max_gpus // num_nodes)))
    num_groups = draw(st.sampled_from([None, 1, 2, 4, 8]))
    unit = num_groups or 1
    num_experts = unit * draw(st.integers(1, max(1, max_experts // unit)))
    min_k = -(-num_experts // num_gpus)
    k = draw(st.integers(min_k, max(min_k, max_slots_per_gpu)))
    config = dict(num_experts=num_experts, num_slots=num_gpus * k, num_gpus=num_gpus,
                  num_nodes=num_nodes, num_groups=num_groups)
    if hierarchical is not None:
        is_hier = num_groups is not None and num_groups % num_nodes == 0
        from hypothesis import assume

        assume(is_hier == hierarchical)
    return config


@st.composite
def counts_for(draw, num_experts, num_layers=None):
    """Counts ``[L, E]``: skewed, uniform, with zeros, ties, all-zero (dense) layers, huge values."""
    num_layers = num_layers or draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["random", "skewed", "ties", "zeros", "dense", "huge", "one_hot"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = (num_layers, num_experts)
    if kind == "random":
        counts = rng.integers(0, 1000, shape).astype(float)
    elif kind == "skewed":
        counts = np.floor(rng.pareto(0.8, shape) * 100)
    elif kind == "ties":
        counts = rng.choice([0.0, 5.0, 10.0], shape)
    elif kind == "zeros":
        counts = rng.integers(0, 100, shape) * (rng.random(shape) < 0.3)
    elif kind == "dense":
        counts = np.zeros(shape)
    elif kind == "huge":
        counts = rng.random(shape) * 1e12
    else:
        counts = np.zeros(shape)
        counts[np.arange(num_layers), rng.integers(0, num_experts, num_layers)] = 1e6
    return counts.astype(np.float64)


@st.composite
def problems(draw, **kwargs):
    """``(config, counts)`` pairs."""
    config = draw(configs(**kwargs))
    return config, draw(counts_for(config["num_experts"]))


def small_loads(draw, num_experts: int, hot_low: int, tail_high: int) -> np.ndarray:
    """``[num_experts]`` float64 small integer loads of a drawn kind: any, ties (0, 3, 6), one hot
    expert (``hot_low``..400 beside loads up to ``tail_high``), all equal, or all zero but one."""
    kind = draw(st.sampled_from(["any", "ties", "hot", "equal", "zeros"]))
    if kind == "equal":
        w = [draw(st.integers(1, 9))] * num_experts
    elif kind == "ties":
        w = draw(st.lists(st.sampled_from([0, 3, 6]), min_size=num_experts, max_size=num_experts))
    elif kind == "hot":
        w = [draw(st.integers(hot_low, 400))] + draw(st.lists(st.integers(0, tail_high), min_size=num_experts - 1,
                                                               max_size=num_experts - 1))
    elif kind == "zeros":
        w = [0] * (num_experts - 1) + [draw(st.integers(1, 30))]
    else:
        w = draw(st.lists(st.integers(0, 60), min_size=num_experts, max_size=num_experts))
    return np.asarray(w, dtype=np.float64)

