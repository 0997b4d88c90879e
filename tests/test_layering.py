"""The package's layers (ARCHITECTURE section 5): a module imports only from its own layer or the
layers below it, counting imports inside functions too, and no modules import each other in a
circle. Optional heavy dependencies imported inside functions are outside the package and not
checked here.

Layers, lowest first (a module's layer is the first pattern in :data:`LAYERS` that names it):

0. model: input validation, the topology, the problem configuration (``Problem``);
1. kernels: Numba over plain arrays;
2. searches shared by bounds and methods (the group -> node search, the capped descent);
3. bounds and metrics: numbers about loads and placements, the ``Placement`` result type (it
   answers questions about itself through the metrics), synthetic loads;
4. methods: one module per method, and the exact method's CP-SAT model (``eplb.exact``);
5. planning: ``plan``, migration-aware and locality-aware planning, dispatch and the objectives
   built on it, certificates;
6. serving: the online balancer, transfer plans, simulation, engine adapters;
7. edges: file formats, reports, the CLI, warm-up, and the package's public names (``eplb``).
"""

from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "eplb"

LAYERS = [
    ("model", ["eplb._validation", "eplb.topology", "eplb.problem", "eplb.dispatch_rules"]),
    ("kernels", ["eplb.kernels", "eplb.kernels.*"]),
    ("searches", ["eplb.searches"]),
    ("bounds and metrics", ["eplb.bounds", "eplb.metrics", "eplb.placement", "eplb.synthetic", "eplb.series",
                            "eplb.cost", "eplb.rule_shares"]),
    ("methods", ["eplb.methods", "eplb.methods.*", "eplb.exact"]),
    ("planning", ["eplb.api", "eplb.migration", "eplb.exact_migration", "eplb.certificate",
                  "eplb.dispatch", "eplb.engine_dispatch", "eplb.engine_planning", "eplb.objectives", "eplb.robust", "eplb.windows", "eplb.locality"]),
    ("serving", ["eplb.balancer", "eplb.transfer", "eplb.simulate", "eplb.sweep", "eplb.adapters", "eplb.adapters.*"]),
    ("edges", ["eplb.formats", "eplb.formats.*", "eplb.report", "eplb.cli", "eplb.demo", "eplb.__main__",
               "eplb.warmup", "eplb.simulation_report", "eplb"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    for rank, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch(module, pattern) for pattern in patterns):
            return rank
    return None


def imported_modules(module: str, path: Path) -> set[str]:
    """The eplb modules ``module`` imports anywhere in its file (module level and inside functions)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "eplb"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "eplb":
                continue
            for alias in node.names:  # `from package import module` imports that module
                child = f"{source}.{alias.name}"
                found.add(child if child in MODULES else source)
    return {name for name in found if name in MODULES}


GRAPH = {module: imported_modules(module, path) for module, path in MODULES.items()}


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_from_a_higher_layer(module):
    rank = layer_of(module)
    upward = sorted(f"{other} ({LAYERS[layer_of(other)][0]})" for other in GRAPH[module]
                    if layer_of(other) is not None and rank is not None and layer_of(other) > rank)
    assert upward == [], f"{module} ({LAYERS[rank][0]}) imports from a higher layer: {upward}"


def test_no_import_circles():
    """Within a layer too (a package importing its own submodules, e.g. to register methods, is not
    a circle: the submodules may import the package's names)."""
    def edges(module):
        return {other for other in GRAPH[module]
                if not (MODULES[module].name == "__init__.py" and other.startswith(module + "."))}

    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module):
        state[module] = 1
        stack.append(module)
        for other in sorted(edges(module)):
            if state.get(other) == 1:
                circles.append(stack[stack.index(other):] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module)
    assert circles == []


def test_the_checker_sees_imports_inside_functions(tmp_path):
    path = PACKAGE / "bounds.py"
    assert "eplb.kernels.bounds" in imported_modules("eplb.bounds", path)
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from .methods.balanced import x\n")
    assert imported_modules("eplb.probe", source) == {"eplb.methods.balanced"}
