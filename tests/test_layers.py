"""Issue 7: the project's modules import one way only.

Every import of a project module counts — at module level, inside a function, or under
``TYPE_CHECKING`` — because a function-local import that closes a circle hides the circle
without removing it. A cycle fails the test with its path.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import ROOT

PACKAGES = ("project", "machines_app", "sessions_app", "attention_app", "api_app")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" not in path.parts:
                found[module_name(path)] = path
    return found


def imports_of(name: str, source: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The project modules that module ``name`` (whose text is ``source``) imports, anywhere."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the submodule when there is one.
            candidates = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_function_local_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    known = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
    assert imports_of("pkg.a", "def f():\n    from . import b\n", known) == {"pkg", "pkg.b"}
    assert imports_of("pkg.sub.c", "from ..b import x\nimport pkg.sub\n", known) == {"pkg.b", "pkg.sub"}
    assert imports_of("pkg.a", "if TYPE_CHECKING:\n    from pkg.sub.c import Y\n", known) == {"pkg.sub.c"}


def test_no_import_circle_among_the_projects_modules():
    modules = project_modules()
    graph = {
        name: imports_of(name, path.read_text(), set(modules), is_package=path.name == "__init__.py")
        for name, path in modules.items()
    }
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph))
