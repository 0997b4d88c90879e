"""Research code behind ``bench/fewest_changes.py``: an exact combinatorial search for the fewest
slot changes within a load cap (global mode), with proven lower bounds.

Not part of the package: eplb keeps one solver of each kind (the fast heuristic of
:mod:`eplb.planning.migration` and the CP-SAT model of :mod:`eplb.planning.exact_migration`). This search proves
more layers than CP-SAT on gpt-oss-20b's 40 slots, which is what the benchmark measures. Its
tests are ``tests/planning/test_fewest_changes.py`` (``tests/conftest.py`` puts ``bench/`` on the path).
"""

from .kernels import FOUND, OUT_OF_WORK, REFUTED, fewest_changes_exact
from .search import follows_rules, prove_fewest_changes, prove_layer

__all__ = ["FOUND", "OUT_OF_WORK", "REFUTED", "fewest_changes_exact", "follows_rules", "prove_fewest_changes",
           "prove_layer"]
