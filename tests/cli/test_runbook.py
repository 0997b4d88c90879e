"""Every ``eplb`` line of ``docs/runbook.md`` runs (issue 47 item 1): the page's bash blocks, in
order, in a temporary folder holding DeepSeek-V3-sized synthetic counts, each command exiting 0
and writing what it names."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from eplb.simulation.synthetic import drifting_counts

from cli_runner import invoke

PAGE = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"


def runbook_commands() -> list[list[str]]:
    """The ``eplb ...`` lines of the page's ```` ```bash ```` blocks, split as a shell would."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.DOTALL)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if line.startswith("eplb ")]


def test_the_runbook_names_every_change_and_engine():
    text = PAGE.read_text()
    commands = [" ".join(c) for c in runbook_commands()]
    for section in ("## vLLM", "## TensorRT-LLM", "## SGLang"):
        assert section in text
    assert any("--lost-gpus 5 " in c for c in commands) and any("--lost-gpus 24,25" in c for c in commands)
    assert any("--gpus 40" in c for c in commands) and any("--fail-gpu" in c for c in commands)


@pytest.mark.slow
def test_issue_47_item_1_every_runbook_line_runs(tmp_path):
    pytest.importorskip("yaml", reason="TensorRT-LLM's YAML needs the optional 'trtllm' extra")
    np.save(tmp_path / "counts.npy", drifting_counts(4, 58, 256, num_groups=8, seed=7))
    for command in runbook_commands():
        out, _ = invoke(*command[1:], cwd=tmp_path)
        if "-o" in command:
            assert (tmp_path / command[command.index("-o") + 1]).exists(), command
        if "--transfer" in command:
            assert (tmp_path / command[command.index("--transfer") + 1]).exists(), command
        if command[1] == "validate":
            assert out.startswith("valid ")
