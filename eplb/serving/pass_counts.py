"""One forward pass's token counts on their way into a balancer's window: checked for shape
(:func:`check_counts`, numpy or torch, any real dtype), for the largest count a window's sums take
(:func:`pass_count_limit`), staged as float64 and refused when not finite and non-negative
(:func:`stage_counts`, :func:`bad_count_error`), and per-slot counts summed per expert
(:func:`fold_pass`). The :class:`~eplb.serving.balancer.Balancer`, its worker process and the
background balancer all check a pass here."""

from __future__ import annotations

import numpy as np

from ..kernels.plumbing.load_window import STAGED_DTYPES, copy_counts, first_bad_count, store_physical


def check_counts(counts, num_layers: int, num_experts: int, num_slots: int, physical: bool | None):
    """One forward pass's counts checked for shape (:meth:`Balancer.record`): returns ``(counts,
    physical)``, ``counts`` a numpy array ``[L, E]`` (``physical=False``) or ``[L, S]`` (``True``);
    ``physical=None`` is inferred from the shape unless ``E == S``."""
    if type(counts) is not np.ndarray or counts.dtype not in STAGED_DTYPES:  # else already a real numpy array
        counts = _counts_array(counts)
    if counts.ndim != 2 or counts.shape[0] != num_layers or counts.shape[1] not in (num_experts, num_slots):
        raise ValueError(
            f"counts must have shape [L, E] = [{num_layers}, {num_experts}] or per slot "
            f"[L, S] = [{num_layers}, {num_slots}], got {counts.shape}"
        )
    if physical is None:
        if num_experts == num_slots:
            raise ValueError("E == S: pass physical=True (per-slot counts) or physical=False (per expert)")
        return counts, counts.shape[1] == num_slots
    expected = num_slots if physical else num_experts
    if counts.shape[1] != expected:
        raise ValueError(f"counts must have {expected} columns with physical={physical}, got {counts.shape[1]}")
    return counts, bool(physical)


FLOAT64_MAX = float(np.finfo(np.float64).max)


COUNT_HEADROOM = 1024.0
"""Room :func:`pass_count_limit` leaves above the largest sum of a window: what is computed from
the sums (a forecast along a trend, the hedged plan's sub-window peaks, prices) stays finite."""


def pass_count_limit(window: int, forecast: int, num_experts: int, num_slots: int) -> float:
    """The largest count a balancer's ``record`` takes: float64's largest value over
    ``COUNT_HEADROOM * (window + forecast) * max(E, S)``, so a layer's total over the window, carried
    ``forecast`` passes along its trend, cannot overflow (about 1e300 at DeepSeek-V3 size; counts are
    scale-free, so only values no engine records are refused)."""
    return FLOAT64_MAX / (COUNT_HEADROOM * (window + forecast) * max(num_experts, num_slots))


def bad_count_error(counts: np.ndarray, staged: np.ndarray, limit: float) -> ValueError:
    """The ``ValueError`` for a pass ``counts`` whose staged copy ``staged`` (the same shape) holds a
    value :func:`~eplb.kernels.plumbing.load_window.first_bad_count` refuses under ``limit``."""
    bad = first_bad_count(staged, limit)
    value = staged.flat[bad]
    if value >= 0 and np.isfinite(value):  # finite and non-negative: too large
        return ValueError(f"counts must be at most {limit:.3g} (beyond it the window's sums overflow float64; "
                          f"counts are scale-free: divide them by a common factor), found {counts.flat[bad]} at "
                          f"flat index {bad}")
    return ValueError(f"counts must be finite and non-negative, found {counts.flat[bad]} at flat index {bad}")


def stage_counts(counts: np.ndarray, staged: np.ndarray, limit: float) -> None:
    """Copy ``counts`` (any real dtype) into ``staged``, float64 of the same shape, and refuse
    (``ValueError``) a value that is not finite and non-negative or is above ``limit``
    (:func:`pass_count_limit`)."""
    if counts.dtype in STAGED_DTYPES and counts.flags.c_contiguous and counts.flags.writeable:
        if not copy_counts(counts, staged, limit):  # the engine's case: one compiled pass
            return
    else:
        # any other real dtype (float16, longdouble, big-endian, any integer width) or layout to
        # float64 in place: values beyond float64's range become inf and are refused just below
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(staged, counts, casting="unsafe")
        if first_bad_count(staged, limit) < 0:
            return
    raise bad_count_error(counts, staged, limit)


def fold_pass(counts: np.ndarray, phy2log: np.ndarray, staged: np.ndarray, out: np.ndarray, limit: float) -> None:
    """One pass's counts per slot ``counts [L, S]``, checked and copied into ``staged [L, S]``
    float64 (:func:`stage_counts`), summed per expert into ``out [L, E]`` float64 through
    ``phy2log [L, S]``: what :meth:`Balancer.record` keeps of a pass per slot. A worker whose
    staging rows are narrower than a grown deployment's slots hands the pass over so. ``limit``: the
    largest count accepted (:func:`pass_count_limit`)."""
    stage_counts(counts, staged, limit)
    store_physical(staged, phy2log, out)


def _counts_array(counts) -> np.ndarray:
    """One forward pass's counts as a numpy array of real numbers (not copied when already one).

    Torch tensors: dense, on any real device; bfloat16 (which numpy lacks) is widened on the
    tensor's device first. Sparse, meta and complex inputs get a ``ValueError``.
    """
    if type(counts).__module__.split(".")[0] == "torch":
        layout = str(getattr(counts, "layout", "torch.strided"))
        if layout != "torch.strided":
            raise ValueError(f"counts must be a dense tensor, got layout {layout} (call .to_dense() first)")
        if counts.device.type == "meta":
            raise ValueError("counts is a meta tensor (shape only, no values): pass a tensor holding the counts")
        if counts.is_complex():
            raise ValueError(f"counts must hold real numbers, got dtype {counts.dtype}")
        counts = counts.detach()
        if str(counts.dtype) == "torch.bfloat16":
            counts = counts.float()
        counts = counts.cpu().numpy()
    counts = np.asarray(counts)
    if counts.dtype.kind == "c":
        raise ValueError(f"counts must hold real numbers, got complex dtype {counts.dtype}")
    if counts.dtype.kind not in "biuf":
        raise ValueError(f"counts must hold numbers, got dtype {counts.dtype}")
    return counts
