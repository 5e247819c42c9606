"""No function in ``moeserve/`` runs over 80 lines (from its ``def`` line to the last line of
its body, nested functions included in their parent's count): a longer one is split into
named steps. Only pure data tables (a function that just returns a literal) may be longer;
they are listed in ``DATA_TABLES``, each with why."""

from __future__ import annotations

import ast
from pathlib import Path

import moeserve

MAX_LINES = 80

# "path/inside/moeserve.py:QualifiedName": why it is a data table. Empty: there are none.
DATA_TABLES: dict[str, str] = {}

PACKAGE = Path(moeserve.__file__).parent


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in a file, nested ones too."""
    found: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                found.append((name, child.end_lineno - child.lineno + 1))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(encoding="utf-8"), str(path)), "")
    return found


def test_the_checker_counts_from_def_to_the_last_line(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "@decorator\n"
        "def f(\n    x,\n):\n    return x\n\n\n"
        "class C:\n    def g(self):\n        def h():\n            pass\n        return h\n"
    )
    assert function_lengths(src) == [("f", 4), ("C.g", 4), ("C.g.h", 2)]


def test_no_function_is_over_80_lines():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for name, lines in function_lengths(path):
            if lines > MAX_LINES and f"{rel}:{name}" not in DATA_TABLES:
                too_long.append(f"moeserve/{rel}:{name} ({lines} lines)")
    assert too_long == [], f"split these into named steps of at most {MAX_LINES} lines: {too_long}"


def test_the_allow_list_names_only_functions_that_exist():
    known = {
        f"{p.relative_to(PACKAGE).as_posix()}:{name}"
        for p in PACKAGE.rglob("*.py")
        for name, _ in function_lengths(p)
    }
    assert set(DATA_TABLES) <= known
