"""Every name and path the README and the documentation site (``docs/``) give exists as written: ``eplb.x.y`` attribute chains in its
code blocks resolve after a plain ``import eplb`` (in a fresh process, so no other test's imports
help), every other dotted name it mentions imports, and every ``eplb/...`` file it cites exists.
The docstrings of the package, the benchmarks and the notebooks cite existing names too."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the README and every page of the documentation site, read as one text
README = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
NAME = re.compile(r"(?<![\w./-])eplb(?:\.[A-Za-z_]\w*)+")


def code_lines() -> list[str]:
    lines, inside = [], False
    for line in README.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def test_attribute_chains_in_code_resolve_after_import_eplb():
    chains = sorted({name for line in code_lines() if not re.match(r"\s*(from|import)\s", line)
                     for name in NAME.findall(line)})
    assert "eplb.plan" in chains  # the parser sees the code blocks
    probe = ("import functools, json, sys\nimport eplb\nbad = []\n"
             "for chain in json.loads(sys.argv[1]):\n"
             "    try:\n        functools.reduce(getattr, chain.split('.')[1:], eplb)\n"
             "    except AttributeError:\n        bad.append(chain)\n"
             "print(json.dumps(bad))\n")
    out = subprocess.run([sys.executable, "-c", probe, json.dumps(chains)], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert json.loads(out.stdout) == []


def _resolve(name: str):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(name)


def test_every_dotted_name_and_import_exists():
    names = set(NAME.findall(README))
    for line in code_lines():
        match = re.match(r"\s*from\s+(eplb[\w.]*)\s+import\s+([\w, ]+)", line)
        if match:
            names |= {f"{match.group(1)}.{n.strip()}" for n in match.group(2).split(",") if n.strip()}
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert missing == []


def test_every_cited_file_exists():
    paths = set(re.findall(r"(?<![\w./-])eplb/[\w/]+\.py", README))
    assert paths  # the README cites kernel and solver files
    assert sorted(p for p in paths if not (ROOT / p).is_file()) == []
    tests = set(re.findall(r"(?<![\w./-])tests/[\w/]+\.py", README))
    assert tests  # and the tests that check what it says
    assert sorted(p for p in tests if not (ROOT / p).is_file()) == []


def test_the_package_bench_and_notebooks_cite_existing_names():
    """A module moved or renamed leaves no docstring pointing at its old path."""
    sources = [*sorted((ROOT / "eplb").rglob("*.py")), *sorted((ROOT / "bench").rglob("*.py")),
               *sorted((ROOT / "notebooks").glob("*.ipynb"))]
    stale = []
    for path in sources:
        for name in sorted(set(NAME.findall(path.read_text()))):
            try:
                _resolve(name)
            except (ImportError, AttributeError):
                stale.append(f"{path.relative_to(ROOT)}: {name}")
    assert stale == []
