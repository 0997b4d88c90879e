"""Issue 44, item 7: the README's Quick start tests with the fast tier, which still tests every module
of the package; the full suite is one documented command, and CI runs both."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
FAST_TIER = 'pip install ".[test]" && pytest -m "not slow"'


def quick_start_commands() -> list[str]:
    block = README[README.index("## Quick start"):].split("```")[1]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("pip install")]


def test_item7_the_quick_start_is_two_commands_the_second_the_fast_tier():
    commands = quick_start_commands()
    assert commands == ["pip install . && eplb demo", FAST_TIER]


def test_item7_ci_runs_the_quick_start_as_written_then_the_full_suite():
    lines = [line.strip() for line in CI.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    demo, fast = (lines.index(command) for command in quick_start_commands())
    assert demo < fast < lines.index("pytest")  # the full suite: the one command, as the README documents it


def test_item7_the_readme_documents_the_full_suite_as_one_command():
    develop = README[README.index("## Develop"):]
    assert re.search(r"^pytest +# the full suite", develop, re.MULTILINE)
    assert "The full test\nsuite, `pytest`" in README or "full test suite, `pytest`" in " ".join(README.split())


def _is_slow_mark(node) -> bool:
    return "slow" in ast.unparse(node)


def test_item7_the_fast_tier_tests_every_module():
    """Every test file of the package's layers (``tests/<layer>/``; ``tests/project/`` checks the
    repository: install, docs, benchmarks) keeps tests outside the slow tier: none is slow as a
    whole, and each has a test without the slow mark."""
    checked = 0
    for path in sorted(ROOT.glob("tests/*/test_*.py")):
        if path.parent.name == "project":
            continue
        tree = ast.parse(path.read_text())
        whole = [node for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)]
        assert not any(_is_slow_mark(node.value) for node in whole), f"{path.name}: slow as a whole"
        tests = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
        fast = [node for node in tests if not any(_is_slow_mark(d) for d in node.decorator_list)]
        assert fast, f"{path.relative_to(ROOT)}: every test is marked slow, so the fast tier does not test its module"
        checked += 1
    assert checked > 50
