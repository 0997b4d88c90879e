"""Numba kernels over plain arrays (compiled lazily on first call, cached on disk, GIL released).

Every kernel is compiled with ``error_model="numpy"``: a division then carries no zero check that
raises (no kernel divides by zero: the callers validate their inputs, and the test suite ran with
the checking model). The checks cost more than the arithmetic: refreshing the per-replica loads of
256 experts took 20x longer with them, and the migration search ran 10-25% slower.
"""

from ._cache import register as _register_cache_locator

# before any kernel module is imported: Numba picks a function's cache folder when it is decorated
_register_cache_locator()
