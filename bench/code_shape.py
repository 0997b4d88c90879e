"""The shape of the package's code: every function in ``eplb/`` with its length and its positional
parameters, and the private names a module imports from another module of the package.

``python bench/code_shape.py`` prints the functions over a length or parameter threshold and the
private imports; ``tests/project/test_code_shape.py`` enforces the kernel conventions of ARCHITECTURE
section 5 with the same measures (at most 100 lines a function, at most 10 positional parameters
outside the CLI's click commands, no private helper imported across kernel files).

Measures:
- *lines*: from the ``def`` line (decorators excluded) to the function's last line, blank lines and
  docstring included;
- *positional parameters*: positional-only and positional-or-keyword parameters (``*args`` and
  keyword-only parameters excluded; ``self`` and ``cls`` of methods excluded);
- *private import*: ``from <eplb module> import _name`` in another module of ``eplb/`` (a leading
  underscore on the name, not on the module);
- *deployment keywords*: the public names (``eplb.__all__``) whose signature spells the deployment
  as its parts (``num_slots``, ``num_gpus``, ``num_nodes``, ``num_groups``, ``topology``,
  ``num_replicas``) instead of taking one :class:`eplb.Deployment`.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "eplb"


@dataclass(frozen=True)
class FunctionShape:
    """One function (or method, or nested function) of the package."""

    module: str  # dotted module name, e.g. "eplb.kernels.split.shares"
    name: str  # qualified inside its module, e.g. "Balancer.observe" or "outer.<locals>.inner"
    lineno: int
    lines: int
    positional: int
    click_command: bool  # decorated with @<group>.command(...) or @click.command(...)


@dataclass(frozen=True)
class PrivateImport:
    """``from source import name`` in ``module`` where ``name`` starts with an underscore."""

    module: str
    source: str
    name: str
    lineno: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_click_command(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr in ("command", "group"):
            return True
    return False


def _positional(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    names = [a.arg for a in node.args.posonlyargs + node.args.args]
    if in_class and names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names)


def function_shapes(path: Path) -> list[FunctionShape]:
    """Every function defined in the file at ``path``, nested ones and methods included."""
    module = module_name(path)
    found: list[FunctionShape] = []

    def visit(node: ast.AST, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append(FunctionShape(module, name, child.lineno, child.end_lineno - child.lineno + 1,
                                           _positional(child, in_class), _is_click_command(child)))
                visit(child, name + ".<locals>.", False)
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".", True)
            else:
                visit(child, prefix, in_class)

    visit(ast.parse(path.read_text(), str(path)), "", False)
    return found


def private_imports(path: Path) -> list[PrivateImport]:
    """The private names the file at ``path`` imports from other modules of ``eplb``."""
    module = module_name(path)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != "eplb" or source == module:
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(PrivateImport(module, source, alias.name, node.lineno))
    return found


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def all_functions() -> list[FunctionShape]:
    return [shape for path in package_files() for shape in function_shapes(path)]


def all_private_imports() -> list[PrivateImport]:
    return [imp for path in package_files() for imp in private_imports(path)]


DEPLOYMENT_PARTS = ("num_slots", "num_gpus", "num_nodes", "num_groups", "topology", "num_replicas")


def deployment_signatures() -> dict[str, list[str]]:
    """Public name -> the deployment's parts its signature takes (only names that take some)."""
    import inspect

    import eplb

    found = {}
    for name in eplb.__all__:
        value = getattr(eplb, name)
        if not callable(value) or name in ("Deployment", "Topology", "Placement", "TransferPlan"):
            continue  # the values themselves, built from their parts
        try:
            parameters = inspect.signature(value).parameters
        except (TypeError, ValueError):
            continue
        parts = [part for part in DEPLOYMENT_PARTS if part in parameters]
        if parts:
            found[name] = parts
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100, help="list functions longer than this (default 100)")
    parser.add_argument("--params", type=int, default=8,
                        help="list functions with more positional parameters than this (default 8)")
    args = parser.parse_args()
    shapes = all_functions()
    print(f"{len(shapes)} functions in eplb/")
    print(f"\nlongest (over {args.lines} lines):")
    for s in sorted(shapes, key=lambda s: -s.lines):
        if s.lines > args.lines:
            print(f"  {s.lines:4d} lines  {s.positional:3d} pos  {s.module}.{s.name}  (line {s.lineno})")
    print(f"\nmost positional parameters (over {args.params}):")
    for s in sorted(shapes, key=lambda s: (-s.positional, -s.lines)):
        if s.positional > args.params:
            tag = "  [click command]" if s.click_command else ""
            print(f"  {s.positional:3d} pos  {s.lines:4d} lines  {s.module}.{s.name}  (line {s.lineno}){tag}")
    imports = all_private_imports()
    print(f"\nprivate names imported from another module ({len(imports)}):")
    for imp in imports:
        print(f"  {imp.module}:{imp.lineno}  from {imp.source} import {imp.name}")
    spelled = deployment_signatures()
    print(f"\npublic signatures spelling the deployment's parts ({len(spelled)}):")
    for name, parts in spelled.items():
        print(f"  eplb.{name}: {', '.join(parts)}")
    print(f"\nmax lines {max(s.lines for s in shapes)}, "
          f"max positional (outside click commands) {max(s.positional for s in shapes if not s.click_command)}, "
          f"functions over 150 lines {sum(s.lines > 150 for s in shapes)}, "
          f"over 100 lines {sum(s.lines > 100 for s in shapes)}, "
          f"over 12 positional {sum(s.positional > 12 and not s.click_command for s in shapes)}")


if __name__ == "__main__":
    main()
