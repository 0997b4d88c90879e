"""The ``eplb`` command line: ``plan``, ``validate``, ``report``, ``simulate``, ``sweep``,
``recommend``, ``compare``, ``warmup`` and ``demo``, a module each (``<name>_command``; ``plan``
with :mod:`~eplb.cli.plan_inputs`, :mod:`~eplb.cli.plan_summary` and, across a deployment change,
:mod:`~eplb.cli.change_flags` and :mod:`~eplb.cli.plan_change`), the options and readers they
share in :mod:`~eplb.cli.shared`, the figures' wording in :mod:`~eplb.cli.wording`.

Exit codes: 0 success; 2 the command line is wrong (unknown option, missing argument, a value of
the wrong type, a deployment change that cannot be made); 1 the command could not be done (a file
missing, unreadable or invalid, counts with NaN or the wrong shape, a configuration that does not
fit the counts, a missing optional dependency). Errors are one line naming the file and the
problem, never a traceback.
"""

from __future__ import annotations

from . import (demo_command, plan_command, recommend_command, report_command, simulate_command, sweep_command,
               validate_command, warmup_command)
from .compare_command import compare
from .group import main
from .plan_command import plan_with_progress

main.add_command(compare)

__all__ = ["main", "plan_with_progress"]
__commands__ = (demo_command, plan_command, recommend_command, report_command, simulate_command, sweep_command,
                validate_command, warmup_command)  # each adds its command to main when imported

if __name__ == "__main__":  # pragma: no cover
    main()
