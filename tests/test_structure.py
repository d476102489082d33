"""The package's structure: what its modules may import, and what its classes are called."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "streamscope"


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# ---- Engines and classes: no vLLM module imports the transformers engine; class names are unique. ----


def _imported(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, anywhere in it (functions included), as absolute names, with the line."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module))
            # `from .. import transformers` imports a module by its name too.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_no_vllm_module_imports_the_transformers_engine():
    offending = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
                 for path in _modules(PACKAGE / "vllm") for line, name in _imported(path)
                 if name == "streamscope.transformers" or name.startswith("streamscope.transformers.")]
    assert not offending, ("what both engines need belongs under streamscope/blocks or streamscope/families, "
                           "not in the transformers engine:\n" + "\n".join(offending))


def test_the_importer_resolves_relative_imports():
    # The check above is only as good as its reading of `from ...transformers.families import x`.
    path = PACKAGE / "vllm" / "families" / "llama.py"
    names = {name for _, name in _imported(path)}
    assert "streamscope.blocks" in names and "streamscope.vllm.blocks" in names, names


def test_class_names_are_unique_across_the_package():
    defined: dict[str, list[str]] = defaultdict(list)
    for path in _modules(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                defined[node.name].append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    repeated = {name: places for name, places in defined.items() if len(places) > 1}
    assert not repeated, f"class names defined more than once (name an engine's own kind Vllm...): {repeated}"
