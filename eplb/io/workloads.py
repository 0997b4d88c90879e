"""Workloads to compare methods on, by name: files, synthetic families, the real traces.

A workload spec is one of:

- a path: counts in any format eplb reads (:func:`eplb.io.formats.read_counts`; ``[L, E]`` is one
  window, ``[T, L, E]`` a series);
- ``synthetic:FAMILY[:LxExT]``: a drifting series of ``T`` windows (default ``16x256x8``) of a family
  of :data:`eplb.simulation.synthetic.FAMILIES`, from the comparison's seed;
- ``trace:NAME``: one of :data:`TRACES` in the shared traces folder (``EPLB_TRACES``, else
  ``../shared/data/traces`` from the working folder or from the package's checkout); absent ->
  :class:`WorkloadMissing` (callers skip it with a note).

:func:`tile_experts` widens a workload to more experts (e.g. a DeepSeek-V3-sized 256) by
interleaving the experts of consecutive layers.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..simulation.comparison import Workload
from ..simulation.synthetic import FAMILIES, drifting_counts
from .formats import read_counts

TRACES = {
    "gpt-oss-20b": ("gpt_oss_20b_benchmark_windows.npz", "benchmark"),
    "olmoe-1b-7b": ("olmoe_1b7b_domains_layers0-7-15.npz", None),
    "mixtral-8x7b": ("mixtral_8x7b_domains_layers0-7-15.npz", None),
}
"""Trace name -> (file, the key whose labels group windows, or ``None``: one window per recorded
window). gpt-oss-20b's 703 groups of sequences are summed by benchmark (11 windows); OLMoE's and
Mixtral's windows are text domains."""

TRACE_DEPLOYMENTS = {
    "gpt-oss-20b": dict(num_slots=40, num_gpus=8, num_nodes=1, num_groups=None),
    "olmoe-1b-7b": dict(num_slots=80, num_gpus=8, num_nodes=1, num_groups=None),
    "mixtral-8x7b": dict(num_slots=12, num_gpus=4, num_nodes=1, num_groups=None),
}
"""A deployment fitting each trace's model, used when the comparison is given none."""

SYNTHETIC_SIZE = (16, 256, 8)
"""``(L, E, T)`` of a ``synthetic:FAMILY`` workload without a size."""


class WorkloadMissing(LookupError):
    """A named trace is not on this machine (the message says where it was looked for)."""


def traces_dir() -> Path:
    """The shared traces folder: ``EPLB_TRACES``, else the first ``../shared/data/traces`` that
    exists, from the working folder or from the checkout holding the package."""
    if os.environ.get("EPLB_TRACES"):
        return Path(os.environ["EPLB_TRACES"])
    candidates = [Path.cwd().parent / "shared" / "data" / "traces",
                  Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"]
    return next((path for path in candidates if path.is_dir()), candidates[0])


def _trace(name: str) -> Workload:
    if name not in TRACES:
        raise ValueError(f"workload trace:{name}: the trace must be one of {sorted(TRACES)}")
    file, group_by = TRACES[name]
    path = traces_dir() / file
    if not path.is_file():
        raise WorkloadMissing(f"trace:{name}: {path} is absent (set EPLB_TRACES to the traces folder)")
    with np.load(path, allow_pickle=False) as data:
        counts = data["counts"].astype(np.float64)
        if group_by is None:
            names = [str(n) for n in data["window_names"]]
        else:
            labels = np.asarray([str(label) for label in data[group_by]])
            names = sorted(set(labels.tolist()))
            counts = np.stack([counts[labels == label].sum(axis=0) for label in names])
    return Workload(f"trace:{name}", counts, tuple(names), str(path))


def _synthetic(spec: str, seed: int) -> Workload:
    _, _, rest = spec.partition(":")
    family, _, size = rest.partition(":")
    if family not in FAMILIES:
        raise ValueError(f"workload {spec}: the family must be one of {FAMILIES}")
    try:
        layers, experts, windows = (int(v) for v in size.split("x")) if size else SYNTHETIC_SIZE
    except ValueError:
        raise ValueError(f"workload {spec}: the size must be LxExT (layers x experts x windows), "
                         f"e.g. synthetic:{family}:16x256x8") from None
    if min(layers, experts, windows) < 1 or layers * experts * windows > 50_000_000:
        raise ValueError(f"workload {spec}: layers, experts and windows must be >= 1 and their product "
                         "at most 50,000,000")
    counts = drifting_counts(windows, layers, experts, family=family, seed=seed).astype(np.float64)
    return Workload(f"synthetic:{family}:{layers}x{experts}x{windows}", counts,
                    tuple(f"window {t}" for t in range(windows)), f"drifting_counts(family={family!r}, seed={seed})")


def read_workload(spec: str, *, seed: int = 0, input_format: str | None = None) -> Workload:
    """The workload ``spec`` names (see the module docstring)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"workload must be a path, synthetic:FAMILY[:LxExT] or trace:NAME, got {spec!r}")
    if spec.startswith("trace:"):
        return _trace(spec.partition(":")[2])
    if spec.startswith("synthetic:"):
        return _synthetic(spec, seed)
    data = read_counts(spec, input_format)
    names = tuple(f"window {t}" for t in range(data.counts.shape[0]))
    return Workload(Path(spec).name, np.asarray(data.counts, dtype=np.float64), names, f"{data.path} ({data.format})")


def tile_experts(workload: Workload, num_experts: int) -> Workload:
    """``workload`` with ``num_experts`` experts: each new layer interleaves ``m = num_experts / E``
    consecutive layers of ``counts [T, L, E]`` (``[T, L // m, m * E]``, the last ``L % m`` layers
    dropped): new expert ``e * m + i`` is expert ``e`` of the ``i``-th of them.

    Interleaved, a group of consecutive new experts gathers a few experts of every recorded layer,
    so groups differ in load as under group-limited routing. (Side by side instead, each group
    would be one recorded layer, and every group would carry the same tokens x top-k: ties no real
    router makes, where a float32 implementation and a float64 one order the groups differently.)
    """
    counts = workload.counts
    num_windows, num_layers, experts = counts.shape
    if num_experts % experts or num_experts < experts:
        raise ValueError(f"tile_experts must be a multiple of the workload's {experts} experts "
                         f"({workload.name}), got {num_experts}")
    factor = num_experts // experts
    if num_layers < factor:
        raise ValueError(f"tile_experts {num_experts} needs at least {factor} layers of {workload.name}, "
                         f"which has {num_layers}")
    rows = num_layers // factor
    blocks = counts[:, :rows * factor].reshape(num_windows, rows, factor, experts)  # [T, L/m, i, e]
    tiled = blocks.transpose(0, 1, 3, 2).reshape(num_windows, rows, num_experts)  # e * m + i
    return Workload(f"{workload.name} tiled to {num_experts}", np.ascontiguousarray(tiled), workload.window_names,
                    f"{workload.source}; {factor} consecutive layers interleaved")


__all__ = ["SYNTHETIC_SIZE", "TRACES", "TRACE_DEPLOYMENTS", "WorkloadMissing", "read_workload", "tile_experts",
           "traces_dir"]
