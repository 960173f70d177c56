"""Count public definitions in streamrover/ without a docstring (issue 9: public definitions documented).

Public: classes, functions and methods whose name does not start with ``_``, at module level or in public
classes; ``@overload`` stubs and the generated ``v1/`` code are left out. A method without a docstring of
its own counts as documented when it overrides a documented method of a streamrover base class (``help()``
and ``inspect.getdoc`` show that one). Exits 1 when any is missing.

    .venv/bin/python scripts/count-docstrings.py [-v]   # -v lists them
"""

from __future__ import annotations

import ast
import pathlib
import sys

Def = tuple[str, "str | None", str, bool, bool]  # where, owner class, name, has its own docstring, is a class


def collect(root: pathlib.Path) -> tuple[list[Def], dict[str, tuple[list[str], dict[str, bool]]]]:
    """Every public definition, and per class name its bases and which of its methods have docstrings."""
    classes: dict[str, tuple[list[str], dict[str, bool]]] = {}
    defs: list[Def] = []

    def walk(body: list[ast.stmt], owner: str | None, public: bool, path: pathlib.Path) -> None:
        for n in body:
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            documented = ast.get_docstring(n) is not None
            if owner is not None and not isinstance(n, ast.ClassDef):
                methods = classes[owner][1]
                methods[n.name] = documented or methods.get(n.name, False)
            if isinstance(n, ast.ClassDef):
                classes.setdefault(n.name, ([ast.unparse(b).split(".")[-1] for b in n.bases], {}))
            stub = any(ast.unparse(d).endswith("overload") for d in n.decorator_list)
            shown = public and not n.name.startswith("_") and not stub
            if shown:
                defs.append((f"{path}:{n.lineno}", owner, n.name, documented, isinstance(n, ast.ClassDef)))
            if isinstance(n, ast.ClassDef):
                walk(n.body, n.name, shown, path)

    for path in sorted(root.rglob("*.py")):
        if "v1" not in path.parts:
            walk(ast.parse(path.read_text()).body, None, True, path)
    return defs, classes


def main() -> int:
    """Print the count (and with -v every definition missing a docstring); 1 if any is missing."""
    defs, classes = collect(pathlib.Path("streamrover"))

    def inherited(owner: str, name: str, seen: tuple[str, ...] = ()) -> bool:
        for base in classes.get(owner, ([], {}))[0]:
            if base not in seen and (classes.get(base, ([], {}))[1].get(name) or inherited(base, name, (*seen, base))):
                return True
        return False

    own = [d for d in defs if not d[3]]
    missing = [d for d in own if not (d[1] and not d[4] and inherited(d[1], d[2]))]
    print(
        f"{len(missing)} of {len(defs)} public definitions have no docstring "
        f"({len(own)} have none of their own; {len(own) - len(missing)} override a documented base method)"
    )
    if "-v" in sys.argv:
        for where, owner, name, _, _ in missing:
            print(where, f"{owner}.{name}" if owner else name)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
