"""The package's shape: no import circles in ``streamrover/``, and the master's and the worker's modules apart.

Read from the source with :mod:`ast` (nothing is imported, so it takes well under a second). An import counts
wherever it is written (module level or inside a function: a lazy import is still a dependency at run time),
except under ``if TYPE_CHECKING:``, which never runs. ``lint-imports`` (pyproject.toml) checks the same
contracts; this test keeps them without the import-linter package.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "streamrover"
MASTER = "streamrover.shard_service.master"
CLIENT = "streamrover.shard_service.client"


def _modules(package: Path) -> dict[str, Path]:
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, type_checking: bool) -> Iterator[tuple[str, str]]:
    """Each import of ``tree`` as (module, name): ``import a.b`` is ("a.b", ""), ``from a import b`` ("a", "b")."""

    def walk(node: ast.AST) -> Iterator[ast.stmt]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in [*(child.body if type_checking else []), *child.orelse]:
                    yield stmt
                    yield from walk(stmt)
                continue
            if isinstance(child, ast.stmt):
                yield child
            yield from walk(child)

    for stmt in walk(tree):
        if isinstance(stmt, ast.Import):
            yield from ((alias.name, "") for alias in stmt.names)
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - stmt.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield from ((base, alias.name) for alias in stmt.names)


@functools.cache
def _parsed(package: Path) -> dict[str, tuple[Path, ast.Module]]:
    return {name: (path, ast.parse(path.read_text(), str(path))) for name, path in _modules(package).items()}


def import_graph(package: Path, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports.

    ``from a import b`` imports module ``a.b`` when there is one, else the name ``b`` of module ``a`` (as
    import-linter's grimp counts it); a name outside the package's modules is left out.
    """
    modules = _parsed(package)
    graph: dict[str, set[str]] = {}
    for name, (path, tree) in modules.items():
        targets = set()
        for base, imported in _imports(tree, name, path.name == "__init__.py", type_checking):
            target = f"{base}.{imported}" if f"{base}.{imported}" in modules else base
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan), as the path ``a -> ... -> a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # the package's import depth is small: recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for group in groups:  # a shortest circle through the group's first module, for the message
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        found: list[str] | None = None
        while frontier and found is None:
            nxt_frontier = []
            for node in frontier:
                for nxt in sorted(graph[node] & group):
                    if nxt == start:
                        found = [*paths[node], start]
                        break
                    if nxt not in paths:
                        paths[nxt] = [*paths[node], nxt]
                        nxt_frontier.append(nxt)
                if found:
                    break
            frontier = nxt_frontier
        cycles.append(found or sorted(group))
    return cycles


def _describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    group = {m for m in _reach(graph, cycle[0]) if cycle[0] in _reach(graph, m)}
    others = sorted(group - set(cycle))
    return " -> ".join(cycle) + (f" (and through {', '.join(others)})" if others else "")


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """Each import from master/ into client/ or back, as ``module imports target``."""
    sides = {MASTER: CLIENT, CLIENT: MASTER}
    for side in sides:
        assert side in graph, f"{side} is missing: shard_service/ keeps the master's and the worker's modules apart"
    return [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        for side, other in sides.items()
        if module == side or module.startswith(side + ".")
        for target in sorted(targets)
        if target == other or target.startswith(other + ".")
    ]


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph(PACKAGE)
    cycles = import_cycles(graph)
    assert not cycles, "import circles (break them: a type-only import goes under `if TYPE_CHECKING:`, or the " \
        "shared piece moves down to a module both import):\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_master_and_client_never_import_each_other() -> None:
    for side in ("master", "client"):
        assert (PACKAGE / "shard_service" / side / "__init__.py").is_file(), \
            f"shard_service/{side}/ is missing: the master's and the worker's modules live in two folders"
    found = crossings(import_graph(PACKAGE, type_checking=True))  # not even for types
    assert not found, "master/ runs only in the job master and client/ only in workers; move what both " \
        "need up to streamrover/shard_service/ (beside api.py):\n" + "\n".join(found)


def test_the_checks_see_a_circle_and_a_crossing(tmp_path: Path) -> None:
    pkg = tmp_path / "streamrover"
    (pkg / "shard_service" / "master").mkdir(parents=True)
    (pkg / "shard_service" / "client").mkdir()
    files = {
        "__init__.py": "",
        "a.py": "from streamrover import b\n",
        "b.py": "def later() -> None:\n    from streamrover.c import x\n",  # a lazy import counts
        "c.py": "from typing import TYPE_CHECKING\nimport streamrover.a\nif TYPE_CHECKING:\n    import streamrover.d\n",
        "d.py": "import streamrover.c\n",  # d -> c, but c -> d only for types: no circle
        "shard_service/__init__.py": "",
        "shard_service/master/__init__.py": "",
        "shard_service/client/__init__.py": "",
        "shard_service/client/x.py": "from ..master import core\n",
        "shard_service/master/core.py": "",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert import_cycles(import_graph(pkg)) == [["streamrover.a", "streamrover.b", "streamrover.c", "streamrover.a"]]
    assert import_cycles(import_graph(pkg, type_checking=True)) != []
    assert crossings(import_graph(pkg)) == [
        "streamrover.shard_service.client.x imports streamrover.shard_service.master.core"]
