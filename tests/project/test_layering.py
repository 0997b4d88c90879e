"""The package's layers (ARCHITECTURE section 5): a module imports only from its own layer or the
layers below it, counting imports inside functions too, and no modules import each other in a
circle. Optional heavy dependencies imported inside functions are outside the package and not
checked here.

The layers are the folders of ``eplb/``; their order is written once, in :mod:`eplb.layers`
(``LAYERS``), which this test reads.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from eplb.layers import FOLDERS, KERNEL_PACKAGES, LAYERS, layer_of

PACKAGE = Path(__file__).resolve().parents[2] / "eplb"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


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


def test_every_folder_is_a_layer():
    """Every folder of ``eplb/`` holding code is a layer of :data:`eplb.layers.LAYERS` and every layer
    is a folder, so no module falls into the root layer by accident."""
    folders = {p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py") if len(p.relative_to(PACKAGE).parts) > 1}
    assert folders == set(FOLDERS) - {""}
    assert all((PACKAGE / folder / "__init__.py").is_file() for folder in folders)


def test_layer_of_reads_the_folder():
    assert layer_of("eplb.kernels.split.shares") == FOLDERS["kernels"]
    assert layer_of("eplb.planning.methods.best") == FOLDERS["planning"] > FOLDERS["analysis"]
    assert layer_of("eplb.cli") == layer_of("eplb") == len(LAYERS) - 1
    assert layer_of("eplb.cli.plan_command") == layer_of("eplb.demo") == len(LAYERS) - 1  # the command line's folder
    with pytest.raises(ValueError, match="module must be a module of eplb"):
        layer_of("numpy.linalg")


def test_at_most_ten_modules_at_the_root():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 10, root


def test_a_file_name_lives_at_one_level():
    """No two modules share a file name (``__init__.py`` aside): a kernel is named by what it
    computes, not after the module that calls it."""
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert sorted(name for name, count in names.items() if count > 1) == []


def test_no_public_name_shadows_a_module():
    """``eplb.dispatch``, ``eplb.simulate``, ... are functions only: no module of that name sits at
    the root of ``eplb/``, so ``import eplb.dispatch`` cannot swap the function for a module."""
    import eplb

    clashes = [name for name in eplb.__all__
               if (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()]
    assert clashes == []


KERNEL_IMPORTS = {name: {name, *allowed} for name, _, allowed in KERNEL_PACKAGES}


def test_every_kernel_module_is_in_a_kernel_package():
    """``eplb/kernels/`` holds sub-packages only (:data:`eplb.layers.KERNEL_PACKAGES`), each a
    package whose docstring says what it holds and what may use it; no kernel file lies flat."""
    kernels = PACKAGE / "kernels"
    assert sorted(p.name for p in kernels.glob("*.py")) == ["__init__.py"]
    folders = {p.parent.relative_to(kernels).parts[0] for p in kernels.rglob("*.py") if p.parent != kernels}
    assert folders == set(KERNEL_IMPORTS)
    for folder in folders:
        doc = ast.get_docstring(ast.parse((kernels / folder / "__init__.py").read_text()))
        assert doc and "May use it" in doc, folder


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("eplb.kernels.")))
def test_a_kernel_package_imports_only_the_kernel_packages_it_may(module):
    own = module.split(".")[2]
    outside = sorted(other for other in GRAPH[module]
                     if other.count(".") < 2 or other.split(".")[1] != "kernels"
                     or other == "eplb.kernels" or other.split(".")[2] not in KERNEL_IMPORTS[own])
    assert outside == [], f"{module} ({own}) may import only {sorted(KERNEL_IMPORTS[own])}: {outside}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_from_a_higher_layer(module):
    rank = layer_of(module)
    upward = sorted(f"{other} ({LAYERS[layer_of(other)][0] or 'root'})" for other in GRAPH[module]
                    if layer_of(other) > rank)
    assert upward == [], f"{module} ({LAYERS[rank][0] or 'root'}) imports from a higher layer: {upward}"


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
    path = PACKAGE / "analysis" / "bounds.py"
    assert "eplb.kernels.bounds.load_bounds" in imported_modules("eplb.analysis.bounds", path)
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from .methods.balanced import x\n")
    assert imported_modules("eplb.planning.probe", source) == {"eplb.planning.methods.balanced"}


def test_the_design_page_shows_the_map():
    """The documentation's Design page lists the layers of :data:`eplb.layers.LAYERS`, in order."""
    import re

    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (?:`(\w+)/`|root) \|", design, re.MULTILINE)
    assert [(int(rank), folder) for rank, folder in rows] == [(rank, folder) for rank, (folder, _) in enumerate(LAYERS)]
