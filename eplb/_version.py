"""The package version (one place: the package, file writers and ``eplb --version`` read it)."""

__version__ = "0.1.0"
