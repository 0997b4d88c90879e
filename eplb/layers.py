"""The package's layers, lowest first: each is a folder of ``eplb/``, and a module imports only
from its own layer or the layers below it (``tests/project/test_layering.py`` checks every import, inside
functions too, and that no modules import each other in a circle). The modules at the root of
``eplb/`` are the top layer: the public names (``eplb/__init__.py``) and the entry points, with the
command line's package ``eplb/cli/`` (:data:`ROOT_FOLDERS`).

This map is the only copy: the layering test reads it, and the README's Design section shows it.
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, str], ...] = (
    ("model", "the deployment (one value: experts, topology, groups, dispatch rule), input checks, cost model"),
    ("kernels", "Numba over plain arrays, each file named by what it computes, in sub-packages by what they "
                "compute (KERNEL_PACKAGES)"),
    ("engines", "the serving engines, a package each (name, dispatch rules and the shares they give, files and "
                "adapter by name, notes) behind one registry, which holds every dispatch rule"),
    ("analysis", "numbers about loads and placements: Placement, loads (the one load function), metrics, "
                 "lower bounds and the searches "
                 "they share with the methods, dispatch (optimal and each engine's), the windows of a series"),
    ("planning", "plan() and rebalance_experts() as a pipeline of stages, methods/ (the registry and one module a method), "
                 "migration, locality, series objectives and the robust search, certificates"),
    ("serving", "the online Balancer, the policy seam (Policy and its registry), transfer plans, adapters/ (engines)"),
    ("simulation", "simulate, sweep, synthetic counts and series generators"),
    ("io", "formats/ (the registry and one module a family of formats: counts and placements in every engine's "
           "files), reports"),
    ("", "the root: public names (__init__), cli/ (the command line, a module per command), demo, precompile "
         "(warmup), this map"),
)
"""``(folder, what it holds)`` for every layer, lowest first; a layer's rank is its index. The
empty folder is the root of ``eplb/``."""

KERNEL_PACKAGES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("plumbing", "the cache of compiled code, helpers every kernel shares, the views of a placement, the load window", ()),
    ("bounds", "lower bounds on the max GPU load, the group -> node search that proves the hierarchical one",
     ("plumbing",)),
    ("search", "replication, packing and the searches over placements (best, tiny, capped, few changes, locality)",
     ("plumbing",)),
    ("split", "how tokens split among replicas (dispatch, fixed shares) and the loads and peaks that follow",
     ("plumbing",)),
    ("change", "what a deployment change or a failure asks: repair, weight copies, failure domains, spread",
     ("plumbing", "search")),
    ("engine_tables", "what an engine's own code computes: SGLang's dispatch table, DeepSeek's greedy", ("plumbing",)),
)
"""``(sub-package, what it holds, the sub-packages it may import)`` for every sub-package of
``eplb/kernels/``. Every kernel module lives in one of them (``eplb/kernels/__init__.py`` only
registers the cache); a module imports from its own sub-package and those listed, and the layers
above may import any of them."""

FOUNDATION: tuple[str, ...] = ("_version",)
"""Root modules every layer may import (rank 0): the version string, which file writers record."""

ROOT_FOLDERS: tuple[str, ...] = ("cli",)
"""Folders of ``eplb/`` in the root layer: the command line is an entry point beside ``demo`` and
``precompile`` (it imports them, and ``python -m eplb`` imports it), one package of modules."""

FOLDERS: dict[str, int] = {folder: rank for rank, (folder, _) in enumerate(LAYERS)} | \
    {folder: len(LAYERS) - 1 for folder in ROOT_FOLDERS}
"""Folder -> rank (the root layer's folders with the root's rank)."""


def layer_of(module: str) -> int:
    """The rank of ``module`` (a dotted name such as ``"eplb.planning.methods.best"``) in :data:`LAYERS`.

    Raises ``ValueError`` for a name outside the package."""
    parts = module.split(".")
    if parts[0] != "eplb":
        raise ValueError(f"module must be a module of eplb, got {module!r}")
    if len(parts) > 1 and parts[1] in FOUNDATION:
        return 0
    if len(parts) > 1 and parts[1] in FOLDERS and parts[1]:
        return FOLDERS[parts[1]]
    return FOLDERS[""]
