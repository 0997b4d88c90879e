"""Kernels of the online balancer's load window: check and store one forward pass without allocating."""

import numpy as np
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _fence(typingctx):
    """A sequentially consistent memory fence (LLVM ``fence seq_cst``): neither the compiler nor the
    CPU moves this thread's memory accesses across it. x86 keeps stores in order anyway; aarch64
    (e.g. Grace Hopper hosts) does not, so a counter that hands shared memory over to another
    process is written after a fence, and read before one."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True)
def memory_fence():
    """:func:`_fence` for Python code: between filling shared memory and writing the counter that
    hands it to another process, and between reading such a counter and reading what it hands over."""
    _fence()


@njit(cache=True, error_model="numpy")
def first_bad_count(counts, limit):
    """Index (flattened) of the first entry of ``counts [L, X]`` that is negative, NaN or above
    ``limit`` (float64; ``inf`` allows any finite value, a finite limit refuses ``inf`` too), or -1.

    Keeps the GIL (microseconds of work, on the engine's thread every pass): releasing it would
    hand a busy scheduler thread the interpreter for up to a switch interval (5 ms) per pass."""
    rows, cols = counts.shape
    for i in range(rows):
        for j in range(cols):
            v = counts[i, j]
            if not (v >= 0) or v > limit or v == np.inf:
                return i * cols + j
    return -1


STAGED_DTYPES = tuple(np.dtype(name) for name in ("int16", "int32", "int64", "uint16", "uint32", "uint64",
                                                    "float32", "float64"))
"""Native dtypes :func:`copy_counts` is compiled for (by the warm-up): engines record counts in these."""


@njit(cache=True, error_model="numpy")
def copy_counts(counts, out, limit):
    """``out [L, X]`` float64 ``= counts [L, X]`` (a C-contiguous array of a :data:`STAGED_DTYPES`
    dtype); returns whether a value is negative, NaN or above ``limit`` (float64, finite)
    (:func:`first_bad_count` finds it).

    One pass and no early exit, so the loop vectorises: a pass's counts at DeepSeek-V3 size are
    staged in a tenth of the time of a numpy cast followed by the check. Keeps the GIL, as
    :func:`first_bad_count` does."""
    rows, cols = counts.shape
    bad = False
    for i in range(rows):
        for j in range(cols):
            value = np.float64(counts[i, j])
            out[i, j] = value
            bad |= (not (value >= 0)) | (value > limit)
    return bad


@njit(cache=True, error_model="numpy")
def stage_pass(counts, out, header, field, value, limit):
    """``out [L, X] = counts [L, X]`` (the same dtype, one of :data:`STAGED_DTYPES`) and, unless a
    value is negative, NaN or above ``limit`` (float64, finite), ``header[field] = value``
    (``header`` int64: the shared counter that hands the pass over); returns whether a value was bad.

    The caller's whole per-pass work in one call: after the engine's GPU step the caller's core
    runs cold, and each further NumPy call costs microseconds. Keeps the GIL, as
    :func:`first_bad_count` does."""
    rows, cols = counts.shape
    bad = False
    for i in range(rows):
        for j in range(cols):
            v = counts[i, j]
            out[i, j] = v
            bad |= (not (v >= 0)) | (v > limit)
    if not bad:
        _fence()  # the row before the counter, on every CPU
        header[field] = value
    return bad


def warm_copy_counts() -> None:
    """Compile (or load from the cache) :func:`copy_counts` and :func:`stage_pass` for every
    :data:`STAGED_DTYPES` dtype and :func:`first_bad_count`: what a balancer's ``record`` calls on
    the caller's thread."""
    out, limit = np.zeros((1, 1)), np.finfo(np.float64).max
    for dtype in STAGED_DTYPES:
        copy_counts(np.zeros((1, 1), dtype), out, limit)
        stage_pass(np.zeros((1, 1), dtype), np.zeros((1, 1), dtype), np.zeros(1, np.int64), 0, 0, limit)
        first_bad_count(np.zeros((1, 1), dtype), limit)
    memory_fence()


@njit(cache=True, nogil=True, error_model="numpy")
def store_logical(counts, out):
    """``out [L, E] = counts [L, E]`` (any numeric dtype, converted to float64)."""
    rows, cols = counts.shape
    for i in range(rows):
        for j in range(cols):
            out[i, j] = counts[i, j]


@njit(cache=True, nogil=True, error_model="numpy")
def store_physical(counts, phy2log, out):
    """``out [L, E]``: per-slot counts ``[L, S]`` summed over the slots of each expert (``phy2log [L, S]``)."""
    rows, slots = counts.shape
    out[:, :] = 0.0
    for i in range(rows):
        for s in range(slots):
            out[i, phy2log[i, s]] += counts[i, s]


@njit(cache=True, nogil=True, error_model="numpy")
def weighted_window(buffer, weights, out):
    """``out [L, E] = sum_t weights[t] * buffer[t]`` over a ring buffer ``[W, L, E]``."""
    out[:, :] = 0.0
    for t in range(buffer.shape[0]):
        wt = weights[t]
        if wt == 0.0:
            continue
        for i in range(buffer.shape[1]):
            for j in range(buffer.shape[2]):
                out[i, j] += wt * buffer[t, i, j]


@njit(cache=True, nogil=True, error_model="numpy")
def window_residuals(buffer, weights, ages, level, slope, scale, out):
    """``out [L, E] = sum_t w_t ((x_t - level - slope * a_t) / scale)^2`` over a ring buffer
    ``[W, L, E]`` with row weights and ages ``[W]``: the weighted squared residuals of a line per
    entry (``level``, ``slope`` and ``scale`` ``[L, E]``; dividing by ``scale``, e.g. the entry's
    mean, keeps the squares of huge counts finite)."""
    out[:, :] = 0.0
    for t in range(buffer.shape[0]):
        wt = weights[t]
        if wt == 0.0:
            continue
        a = ages[t]
        for i in range(buffer.shape[1]):
            for j in range(buffer.shape[2]):
                r = (buffer[t, i, j] - level[i, j] - slope[i, j] * a) / scale[i, j]
                out[i, j] += wt * r * r
