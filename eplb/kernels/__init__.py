"""Numba kernels over plain arrays (compiled lazily on first call, cached on disk, GIL released)."""
