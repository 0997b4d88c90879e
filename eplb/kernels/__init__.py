"""Numba kernels over plain arrays (compiled lazily on first call, cached on disk, GIL released).

Every kernel is compiled with ``error_model="numpy"``: a division then carries no zero check that
raises (no kernel divides by zero: the callers validate their inputs, and the test suite ran with
the checking model). The checks cost more than the arithmetic: refreshing the per-replica loads of
256 experts took 20x longer with them, and the migration search ran 10-25% slower.

The kernels sit in sub-packages by what they compute (:data:`eplb.layers.KERNEL_PACKAGES` is the
map, with what each may import; ``tests/project/test_layering.py`` checks it):

- ``plumbing/``: the disk cache and compile notice, the helpers every kernel shares (``common``),
  the views of a placement (``layout``) and the balancer's load window;
- ``bounds/``: lower bounds on the max GPU load and the group -> node search that proves them;
- ``search/``: replication, packing and the searches over placements (``best``, ``balanced``, the
  tiny exact search, the capped packing, few changes from a placement in service, locality);
- ``split/``: how tokens split among replicas (optimal dispatch, fixed shares) and the loads,
  work and expected peaks that follow;
- ``change/``: what a deployment change or a failure costs: repair, weight copies, failure domains;
- ``engine_tables/``: what an engine's own code computes (SGLang's dispatch table, DeepSeek's greedy).
"""

import os as _os

from .plumbing._cache import PACKAGE_DIR as _PACKAGE_DIR, SHIPPED_ROOT as _SHIPPED_ROOT
from .plumbing._cache import register as _register_cache_locator, shipped_id as _shipped_id, shipped_tag as _shipped_tag
from .plumbing._compile_notice import install as _install_compile_notice

# before any kernel module is imported: Numba picks a function's cache folder when it is decorated
_register_cache_locator()
# one line on stderr when compiling on first use takes more than a couple of seconds (a checkout)
_install_compile_notice(_shipped_id(_os.path.join(_SHIPPED_ROOT, _shipped_tag())) is not None, _PACKAGE_DIR)
