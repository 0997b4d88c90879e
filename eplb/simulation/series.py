"""Realistic per-step series of expert counts ``[T, L, E]`` for the simulator.

A serving engine sees, every forward pass (step), a batch of tokens drawn from a traffic mix: several
workloads (chat, code, maths, ...) each with its own routing distribution ``[L, E]``, in proportions
that shift over time, part prompt tokens (prefill) and part generated tokens (decode). Each of the
step's ``tokens * top_k`` routings goes to an expert drawn from the step's mixture (a multinomial
per layer; the distinct-experts constraint of top-k routing is ignored), so a decode step of 64-256
tokens is noisy while a window of 1000 steps is not.

:class:`Series` generates the steps on demand, block by block (``block(start, stop)``), each block
from its own seed: the same seed gives the same counts whatever blocks are asked for, in any order,
and a 10,000-step DeepSeek-V3-sized series never has to sit in memory.

Workload distributions come from real traces (:func:`trace_workloads`, e.g. the domains of OLMoE,
the benchmarks of gpt-oss-20b) or from :func:`synthetic_workloads`; traffic paths from
:func:`mixture_path` and :func:`prefill_share_from_lengths`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..model._validation import as_int
from .synthetic import expert_popularity

BLOCK = 256  # steps drawn from one seed


def _probabilities(array, name: str, ndim: int) -> np.ndarray:
    """Non-negative finite array of rank ``ndim``, normalised over the last axis (zero rows stay 0)."""
    try:
        array = np.array(array, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a numeric array: {exc}") from None
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    if array.size == 0 or array.shape[-1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {array.shape}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError(f"{name} must be finite and non-negative")
    total = array.sum(axis=-1, keepdims=True)
    return np.divide(array, total, out=np.zeros_like(array), where=total > 0)


def _per_step(value, num_steps: int, name: str, *, integer: bool, upper: float | None = None) -> np.ndarray:
    """A scalar or ``[T]`` array as a ``[T]`` array, checked."""
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        array = np.full(num_steps, float(array))
    if array.shape != (num_steps,):
        raise ValueError(f"{name} must be a number or an array of shape [{num_steps}], got shape {array.shape}")
    if not np.isfinite(array).all() or (array < 0).any() or (upper is not None and (array > upper).any()):
        bound = f" and <= {upper}" if upper is not None else ""
        raise ValueError(f"{name} must be finite, >= 0{bound}")
    if integer:
        if (array != np.round(array)).any():
            raise ValueError(f"{name} must hold whole numbers of tokens")
        return array.astype(np.int64)
    return array


class Series:
    """Per-step token counts ``[T, L, E]`` drawn from a shifting traffic mix, generated on demand.

    Args:
        workloads: ``[K, L, E]`` routing distribution of each workload's prompt (prefill) tokens
            (non-negative; each row is normalised; an all-zero row is a dense layer: no counts).
        num_steps: ``T``.
        tokens_per_step: tokens in each step's batch, a number or ``[T]`` (whole numbers).
        top_k: routings per token.
        mixture: ``[T, K]`` share of each workload at each step (rows normalised; default: equal).
        prefill_share: share of a step's tokens that are prompt tokens, a number or ``[T]`` in [0, 1].
        decode_workloads: ``[K, L, E]`` distributions of generated (decode) tokens (default: the same
            as ``workloads``).
        seed: the same seed gives the same counts.
    """

    def __init__(self, workloads, *, num_steps: int, tokens_per_step, top_k: int, mixture=None,
                 prefill_share=0.0, decode_workloads=None, seed: int = 0):
        self.workloads = _probabilities(workloads, "workloads", 3)
        num_workloads = self.workloads.shape[0]
        self.decode_workloads = (self.workloads if decode_workloads is None
                                 else _probabilities(decode_workloads, "decode_workloads", 3))
        if self.decode_workloads.shape != self.workloads.shape:
            raise ValueError(f"decode_workloads must have the shape of workloads {self.workloads.shape}, "
                             f"got {self.decode_workloads.shape}")
        self.num_steps = as_int(num_steps, "num_steps", minimum=1)
        self.top_k = as_int(top_k, "top_k", minimum=1)
        self.seed = as_int(seed, "seed", minimum=0)
        self.tokens = _per_step(tokens_per_step, self.num_steps, "tokens_per_step", integer=True)
        share = _per_step(prefill_share, self.num_steps, "prefill_share", integer=False, upper=1.0)
        self.prefill_tokens = np.round(self.tokens * share).astype(np.int64)
        self.decode_tokens = self.tokens - self.prefill_tokens
        if mixture is None:
            mixture = np.ones((self.num_steps, num_workloads))
        self.mixture = _probabilities(mixture, "mixture", 2)
        if self.mixture.shape != (self.num_steps, num_workloads):
            raise ValueError(f"mixture must have shape [T, K] = [{self.num_steps}, {num_workloads}], "
                             f"got {self.mixture.shape}")
        if (self.mixture.sum(axis=1) == 0).any():
            raise ValueError("mixture must give every step a positive total")
        self._cached: tuple[int, np.ndarray] | None = None

    # -- shape -----------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.workloads.shape[1]

    @property
    def num_experts(self) -> int:
        return self.workloads.shape[2]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_steps, self.num_layers, self.num_experts)

    def __len__(self) -> int:
        return self.num_steps

    # -- counts ----------------------------------------------------------------------------------
    def probabilities(self, step: int, *, decode: bool = False) -> np.ndarray:
        """``[L, E]``: the routing distribution of step ``step``'s prompt (or generated) tokens."""
        table = self.decode_workloads if decode else self.workloads
        return np.tensordot(self.mixture[step], table, axes=1)

    def _block(self, index: int) -> np.ndarray:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, index])
        start, stop = index * BLOCK, min((index + 1) * BLOCK, self.num_steps)
        out = np.zeros((stop - start, self.num_layers, self.num_experts), np.int64)
        for i, step in enumerate(range(start, stop)):
            for tokens, decode in ((self.prefill_tokens[step], False), (self.decode_tokens[step], True)):
                if tokens == 0:
                    continue
                p = self.probabilities(step, decode=decode)
                rows = p.sum(axis=1)
                n = np.where(rows > 0, tokens * self.top_k, 0)
                p = np.divide(p, rows[:, None], out=np.zeros_like(p), where=rows[:, None] > 0)
                p[rows == 0, 0] = 1.0  # dense layers draw nothing (n = 0) from a valid distribution
                out[i] += rng.multinomial(n, p)
        self._cached = (index, out)
        return out

    def block(self, start: int, stop: int) -> np.ndarray:
        """``[stop - start, L, E]`` int64: the counts of steps ``start <= t < stop``."""
        start, stop = as_int(start, "start", minimum=0), as_int(stop, "stop", minimum=0)
        if not start <= stop <= self.num_steps:
            raise ValueError(f"need 0 <= start <= stop <= {self.num_steps}, got start={start}, stop={stop}")
        if stop == start:
            return np.zeros((0, self.num_layers, self.num_experts), np.int64)
        parts = []
        for index in range(start // BLOCK, (stop - 1) // BLOCK + 1):
            lo, hi = index * BLOCK, (index + 1) * BLOCK
            parts.append(self._block(index)[max(start, lo) - lo:min(stop, hi) - lo])
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    @property
    def compact_dtype(self) -> np.dtype:
        """The smallest unsigned integer dtype that holds any count of a step (its tokens x
        ``top_k``): ``uint16`` up to 65,535 routings per step."""
        return np.dtype(np.min_scalar_type(max(int(self.tokens.max()) * self.top_k, 1)))

    def to_array(self, dtype=None) -> np.ndarray:
        """``[T, L, E]``, every step, filled block by block into one array of ``dtype`` (default
        :attr:`compact_dtype`: 3000 DeepSeek-V3-sized steps of 4096 tokens take 89 MiB as uint16,
        357 MiB as int64). :func:`eplb.simulate` also takes the :class:`Series` itself and then
        never holds more than a block of steps."""
        dtype = self.compact_dtype if dtype is None else np.dtype(dtype)
        if dtype.kind not in "iuf" or (dtype.kind in "iu" and np.iinfo(dtype).max < int(self.tokens.max()) * self.top_k):
            raise ValueError(f"dtype must be a numeric dtype that holds {int(self.tokens.max()) * self.top_k} "
                             f"(the largest count of a step), got {dtype}")
        out = np.empty(self.shape, dtype)
        for index in range((self.num_steps + BLOCK - 1) // BLOCK):
            out[index * BLOCK:(index + 1) * BLOCK] = self._block(index)
        return out

    def __iter__(self):
        for index in range((self.num_steps + BLOCK - 1) // BLOCK):
            yield from self._block(index)


# ------------------------------------------------------------------------------------ traffic paths

def mixture_path(num_steps: int, num_workloads: int, *, order=None, transition: float = 0.5,
                 background: float = 0.0) -> np.ndarray:
    """``[T, K]``: traffic that moves through the workloads in ``order`` (default ``0 .. K-1``).

    The series is cut into ``len(order)`` equal segments; in each, the traffic sits on one
    workload and, over the last ``transition`` fraction of the segment, shifts linearly to the next.
    ``background`` is a share spread evenly over all workloads at every step.
    """
    num_steps = as_int(num_steps, "num_steps", minimum=1)
    num_workloads = as_int(num_workloads, "num_workloads", minimum=1)
    order = list(range(num_workloads)) if order is None else [as_int(k, "order entry") for k in order]
    if not order or min(order) < 0 or max(order) >= num_workloads:
        raise ValueError(f"order must list workload indices in [0, {num_workloads}), got {order}")
    if not 0.0 <= transition <= 1.0:
        raise ValueError(f"transition must be in [0, 1], got {transition}")
    if not 0.0 <= background <= 1.0:
        raise ValueError(f"background must be in [0, 1], got {background}")
    path = np.zeros((num_steps, num_workloads))
    position = np.arange(num_steps) * len(order) / num_steps  # segment index + fraction
    segment = np.floor(position).astype(np.int64)
    into = position - segment
    start_shift = 1.0 - transition
    ramp = np.clip((into - start_shift) / transition, 0.0, 1.0) if transition > 0 else np.zeros(num_steps)
    last = segment == len(order) - 1
    ramp[last] = 0.0
    here = np.asarray(order)[segment]
    there = np.asarray(order)[np.minimum(segment + 1, len(order) - 1)]
    rows = np.arange(num_steps)
    np.add.at(path, (rows, here), 1.0 - ramp)
    np.add.at(path, (rows, there), ramp)
    return (1.0 - background) * path + background / num_workloads


def prefill_share_from_lengths(prompt_tokens, output_tokens) -> np.ndarray:
    """Share of prompt tokens in a batch serving requests of these lengths: ``p / (p + o)``
    (numbers or ``[T]`` arrays: e.g. prompt lengths that grow over the day)."""
    prompt = np.asarray(prompt_tokens, dtype=np.float64)
    output = np.asarray(output_tokens, dtype=np.float64)
    if not (np.isfinite(prompt).all() and np.isfinite(output).all()) or (prompt < 0).any() or (output < 0).any():
        raise ValueError("prompt_tokens and output_tokens must be finite and non-negative")
    total = prompt + output
    if (total <= 0).any():
        raise ValueError("prompt_tokens + output_tokens must be positive")
    return prompt / total


# ------------------------------------------------------------------------------------ workloads

def synthetic_workloads(num_workloads: int, num_layers: int, num_experts: int, *, family: str = "lognormal",
                        skew: float = 0.7, shift: float = 0.5, num_groups: int | None = None,
                        seed: int = 0) -> np.ndarray:
    """``[K, L, E]`` routing distributions of related workloads: one base popularity
    (:func:`eplb.simulation.synthetic.expert_popularity`) whose log is moved per workload by
    ``N(0, (shift * skew)^2)`` per expert (``shift=0``: identical workloads)."""
    num_workloads = as_int(num_workloads, "num_workloads", minimum=1)
    if not (np.isfinite(shift) and shift >= 0):
        raise ValueError(f"shift must be a non-negative number, got {shift}")
    rng = np.random.default_rng(seed)
    base = np.log(expert_popularity(as_int(num_layers, "num_layers", minimum=1),
                                    as_int(num_experts, "num_experts", minimum=1), family=family, skew=skew,
                                    num_groups=num_groups, rng=rng))
    logits = base[None] + rng.normal(0.0, shift * max(skew, 0.1), size=(num_workloads,) + base.shape)
    weights = np.exp(logits - logits.max(axis=2, keepdims=True))
    return weights / weights.sum(axis=2, keepdims=True)


def trace_workloads(path, *, group_by: str | None = None) -> tuple[list[str], np.ndarray]:
    """Workload distributions from a recorded trace file (``.npz`` with ``counts [W, L, E]``, as in
    the project's shared traces).

    Args:
        path: the ``.npz`` file.
        group_by: a key of the file labelling each window (e.g. ``"benchmark"`` for gpt-oss-20b);
            windows with one label are summed into one workload. ``None``: one workload per window.
    Returns:
        ``(names [K], probabilities [K, L, E])``.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"path {path} does not exist")
    with np.load(path, allow_pickle=False) as data:
        counts = data["counts"].astype(np.float64)
        if group_by is None:
            names = [str(n) for n in data["window_names"]] if "window_names" in data.files \
                else [str(i) for i in range(len(counts))]
        else:
            if group_by not in data.files:
                raise ValueError(f"group_by must be a key of {path.name}: {sorted(data.files)}, got {group_by!r}")
            labels = np.asarray([str(x) for x in data[group_by]])
            names = sorted(set(labels.tolist()))
            counts = np.stack([counts[labels == name].sum(axis=0) for name in names])
    return names, _probabilities(counts, "counts", 3)


def mixture_windows(workloads, num_windows: int, *, concentration: float = 0.3, tokens: int = 524288,
                    seed: int = 0) -> np.ndarray:
    """``[T, L, E]`` int64 recording windows that differ as real traffic does: by structured shifts.

    Each window serves a mix of the workloads (request lengths, tasks, phases) drawn from a
    symmetric Dirichlet of ``concentration`` (small: most windows dominated by one or two
    workloads; large: every window close to the average mix), then ``tokens`` routings per layer
    drawn from that mix (multinomial: the sampling noise of a finite window). Independent noise
    around one popularity (:func:`synthetic_workloads` with one workload) is the hard case beside it.

    Args:
        workloads: ``[K, L, E]`` routing distributions (:func:`synthetic_workloads`,
            :func:`trace_workloads`); rows normalised, all-zero rows stay dense layers.
        num_windows: ``T``; concentration: ``> 0``; tokens: routings per layer and window (``>= 1``).
        seed: the same seed gives the same windows.
    """
    table = _probabilities(workloads, "workloads", 3)
    num_windows = as_int(num_windows, "num_windows", minimum=1)
    tokens = as_int(tokens, "tokens", minimum=1)
    if not (np.isfinite(concentration) and concentration > 0):
        raise ValueError(f"concentration must be a positive number, got {concentration!r}")
    rng = np.random.default_rng(as_int(seed, "seed", minimum=0))
    out = np.zeros((num_windows,) + table.shape[1:], np.int64)
    for t in range(num_windows):
        p = np.tensordot(rng.dirichlet(np.full(table.shape[0], float(concentration))), table, axes=1)  # [L, E]
        rows = p.sum(axis=1)
        for layer in np.flatnonzero(rows > 0):
            out[t, layer] = rng.multinomial(tokens, p[layer] / rows[layer])
    return out


def shift_structure(counts, *, components: int = 3) -> float:
    """How structured the differences between windows are: per layer, the share of the
    between-window variance of the experts' token shares (each scaled by the square root of its
    mean share, so sampling noise weighs every expert alike) that the ``components`` leading
    principal directions hold, averaged over layers with tokens.

    Mixtures of a few workloads give values near 1 (their windows move along a few directions);
    independent noise spreads the variance over all directions (about ``components / (T - 1)``).

    Args:
        counts: ``[T, L, E]`` with ``T >= 2``. components: ``>= 1``.
    Returns:
        float in ``[0, 1]``.
    """
    series = np.asarray(counts, dtype=np.float64)
    if series.ndim != 3 or series.shape[0] < 2:
        raise ValueError(f"counts must be [T, L, E] with T >= 2, got shape {series.shape}")
    components = as_int(components, "components", minimum=1)
    totals = series.sum(axis=2, keepdims=True)
    shares = np.divide(series, totals, out=np.zeros_like(series), where=totals > 0)
    fractions = []
    for layer in range(series.shape[1]):
        live = totals[:, layer, 0] > 0
        if live.sum() < 2:
            continue
        mean = shares[live, layer].mean(axis=0)
        # scaled by the square root of the mean share: sampling noise then weighs every expert alike
        centred = (shares[live, layer] - mean) / np.sqrt(np.where(mean > 0, mean, 1.0))
        values = np.linalg.svd(centred, compute_uv=False) ** 2
        if values.sum() > 0:
            fractions.append(values[:components].sum() / values.sum())
    return float(np.mean(fractions)) if fractions else 0.0


__all__ = ["Series", "mixture_path", "mixture_windows", "prefill_share_from_lengths", "shift_structure",
           "synthetic_workloads", "trace_workloads"]
