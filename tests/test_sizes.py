"""The package's sizes: no module over 800 lines and no function over 80 (issue 40, item 6), with the few still
over named, each with the work that removes it, so the list only shrinks.

A module is counted in lines (its newlines); a function from its ``def`` line to its last line, decorators
aside, a nested function inside its own and its outer function's count. The tests are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "streamscope"
#: The most lines a module may have.
MODULE_LINES = 800
#: The most lines a function (or method) may have.
FUNCTION_LINES = 80

#: Modules still over `MODULE_LINES` (path under streamscope/): what removes each.
LONG_MODULES: dict[str, str] = {}
#: Functions still over `FUNCTION_LINES` (``path:qualified name``): what removes each.
LONG_FUNCTIONS: dict[str, str] = {}


def module_lines(path: Path) -> int:
    """The lines of `path`: its newlines, as ``wc -l`` counts them."""
    return path.read_text().count("\n")


def long_functions(path: Path, limit: int = FUNCTION_LINES) -> dict[str, int]:
    """Every function of `path` over `limit` lines, by qualified name (``Class.method``, ``outer.inner``)."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > limit:
                        found[name] = lines
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_no_module_is_over_800_lines():
    over = {_name(path): module_lines(path) for path in _modules() if module_lines(path) > MODULE_LINES}
    new = {name: lines for name, lines in over.items() if name not in LONG_MODULES}
    assert not new, (f"modules over {MODULE_LINES} lines: {new}. Split each by what it holds (a module named for "
                     f"what it holds; the old import path re-exporting its public names).")
    done = sorted(set(LONG_MODULES) - set(over))
    assert not done, f"these modules are now {MODULE_LINES} lines or fewer: take them off LONG_MODULES: {done}"


def test_no_function_is_over_80_lines():
    over = {f"{_name(path)}:{name}": lines for path in _modules() for name, lines in long_functions(path).items()}
    new = {name: lines for name, lines in over.items() if name not in LONG_FUNCTIONS}
    assert not new, (f"functions over {FUNCTION_LINES} lines: {new}. Split each into steps with names that say "
                     f"what they do.")
    done = sorted(set(LONG_FUNCTIONS) - set(over))
    assert not done, f"these functions are now {FUNCTION_LINES} lines or fewer: take them off LONG_FUNCTIONS: {done}"


def test_the_size_checks_count_what_they_say(tmp_path):
    probe = tmp_path / "probe.py"
    body = "".join(f"    x{index} = {index}\n" for index in range(80))
    probe.write_text(f"class Outer:\n    @staticmethod\n    def long():\n{body.replace('    ', '        ')}"
                     f"        def inner():\n{body.replace('    ', '            ')}\n"
                     f"def fits():\n{body[:-len('    x79 = 79')-1]}\n")
    # long: its def, 80 lines of its own, inner's def and inner's 80 lines; inner: 81; fits: 80 (not over).
    assert long_functions(probe) == {"Outer.long": 162, "Outer.long.inner": 81}
    assert module_lines(probe) == probe.read_text().count("\n") == 246
