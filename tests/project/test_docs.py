"""The documentation site builds without a warning, documents every public name, and the README stays
the short front door it is meant to be (the manual lives in ``docs/``)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import eplb

pytestmark = pytest.mark.slow  # builds the documentation site

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_keeps_its_quick_start():
    assert len(README.splitlines()) <= 200
    quick = README[README.index("## Quick start"):]
    commands = re.findall(r"^pip install .*$", quick.split("```")[1], re.MULTILINE)
    assert len(commands) == 2  # one runs the demo, one the tests
    assert "eplb demo" in commands[0] and "pytest" in commands[1]


def test_readme_headline_has_at_most_twelve_rows():
    block = README.split("<!-- bench:headline:start -->")[1].split("<!-- bench:headline:end -->")[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    assert len(rows) <= 12


def test_every_public_name_is_in_the_api_reference():
    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: eplb\.(\w+)$", api, re.MULTILINE))
    assert documented == set(eplb.__all__)


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert {page for page in pages if page not in config} == set()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs and mkdocstrings are not installed (pip install 'eplb[docs]')")
def test_the_site_builds_with_no_warning(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("plan", "rebalance_experts", "Balancer", "Placement"):
        assert f'id="eplb.{name}"' in api  # the reference is generated from the docstrings
