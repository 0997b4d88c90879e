"""The code conventions of ARCHITECTURE section 5, measured by ``bench/code_shape.py``: no function
in ``eplb/`` over 100 lines, none with over 10 positional parameters outside the CLI's click
commands, and no private helper imported from one kernel file into another (shared helpers live in
``eplb/kernels/plumbing/common.py``)."""

from __future__ import annotations

import importlib

code_shape = importlib.import_module("code_shape")  # bench/ is on sys.path (conftest)

MAX_LINES = 100
MAX_POSITIONAL = 10


def test_measures_the_whole_package():
    shapes = code_shape.all_functions()
    modules = {s.module for s in shapes}
    assert "eplb.kernels.split.shares" in modules and "eplb.cli.plan_command" in modules
    names = {(s.module, s.name) for s in shapes}
    assert ("eplb.kernels.split.shares", "optimal_shares") in names


def test_no_function_over_100_lines():
    long = sorted(f"{s.module}.{s.name}: {s.lines} lines" for s in code_shape.all_functions() if s.lines > MAX_LINES)
    assert long == []


def test_at_most_10_positional_parameters_outside_click_commands():
    wide = sorted(f"{s.module}.{s.name}: {s.positional} positional" for s in code_shape.all_functions()
                  if s.positional > MAX_POSITIONAL and not s.click_command)
    assert wide == []


def test_no_private_helper_imported_across_kernel_files():
    crossing = sorted(f"{i.module}:{i.lineno} imports {i.source}.{i.name}" for i in code_shape.all_private_imports()
                      if i.module.startswith("eplb.kernels.") and i.source.startswith("eplb.kernels."))
    assert crossing == []


def test_the_command_line_is_a_module_per_command_each_at_most_500_lines():
    """Issue 48: ``eplb/cli/`` holds a module per command, the shared options and readers, and the
    figures' wording; none over 500 lines."""
    from pathlib import Path

    import eplb.cli

    folder = Path(eplb.cli.__file__).parent
    sizes = {path.name: len(path.read_text().splitlines()) for path in folder.glob("*.py")}
    assert {f"{name}_command.py" for name in ("plan", "validate", "report", "simulate", "sweep", "recommend",
                                              "compare", "warmup", "demo")} <= set(sizes)
    assert {"shared.py", "wording.py"} <= set(sizes)
    assert {name: lines for name, lines in sizes.items() if lines > 500} == {}
    assert sorted(eplb.cli.main.commands) == ["compare", "demo", "plan", "recommend", "report", "simulate", "sweep",
                                              "validate", "warmup"]
