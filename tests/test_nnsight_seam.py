"""streamscope reaches nnsight's internals only through `streamscope.nnsight_seam` (a package: one module per part
of nnsight it adapts), which refuses another release."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import nnsight
import pytest

from streamscope import nnsight_seam

#: The seam is a package: every module in its folder may reach nnsight's internals, no module elsewhere may.
SEAM = Path(nnsight_seam.__file__).parent
PACKAGE = SEAM.parent


def in_seam(path: Path) -> bool:
    """Whether `path` is one of the seam package's modules."""
    return SEAM in path.parents


def public_names() -> dict[str, frozenset[str]]:
    """nnsight's public API as the seam defines it: each public module and the names it exports (``__all__``).

    ``nnsight.modeling.vllm``'s ``__all__`` is read from its source: importing
    it would start vLLM's import.
    """
    vllm_init = Path(nnsight.__file__).parent / "modeling" / "vllm" / "__init__.py"
    vllm_all: frozenset[str] = frozenset()
    for node in ast.parse(vllm_init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            vllm_all = frozenset(ast.literal_eval(node.value))
    return {"nnsight": frozenset(nnsight.__all__), "nnsight.modeling.vllm": vllm_all}


def nnsight_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """Every import of nnsight in `path`, at any depth (inside functions too): ``(line, module, name)``.

    ``import nnsight.x`` gives name None; ``from nnsight.x import y`` gives
    ``y``; ``importlib.import_module("nnsight.x")`` and ``__import__`` with a
    literal name count as imports of the module.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names
                      if alias.name.split(".")[0] == "nnsight"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "nnsight":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and node.args[0].value.split(".")[0] == "nnsight"
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.lineno, node.args[0].value, None))
    return found


def private_imports(path: Path) -> list[tuple[int, str]]:
    """The imports in `path` that reach past nnsight's public API: ``(line, module[.name])``, in line order."""
    public = public_names()
    bad = []
    for line, module, name in sorted(nnsight_imports(path), key=lambda found: found[0]):
        if module == "nnsight" and name is None:
            continue  # `import nnsight`: the package itself
        if module in public and name is not None and name in public[module]:
            continue
        bad.append((line, f"{module}{'.' + name if name else ''}"))
    return bad


def test_only_the_seam_imports_nnsight_internals():
    public = public_names()
    assert "Envoy" in public["nnsight"] and "TransformersModel" in public["nnsight"]
    assert public["nnsight.modeling.vllm"] == {"VLLM"}
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} {name}" for path in sorted(PACKAGE.rglob("*.py"))
           if not in_seam(path) for line, name in private_imports(path)]
    assert not bad, ("these modules import nnsight internals; route them through streamscope/nnsight_seam/:\n"
                     + "\n".join(bad))


def test_the_import_check_sees_every_kind_of_import(tmp_path):
    # The check itself must be able to fail: each way of reaching an internal is caught, public names pass.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib\n"
        "import nnsight\n"
        "from nnsight import Envoy, TransformersModel\n"
        "from nnsight.modeling.vllm import VLLM\n"
        "from nnsight.intervention.interleaver import Mediator\n"
        "def later():\n"
        "    from nnsight.modeling.vllm.envoys import parallel_envoys\n"
        "    import nnsight.tracing.tracer\n"
        "    return importlib.import_module('nnsight.modeling.vllm.vllm')\n"
        "from nnsight.modeling.vllm import NotExported\n"
    )
    assert [name for _, name in private_imports(probe)] == [
        "nnsight.intervention.interleaver.Mediator", "nnsight.modeling.vllm.envoys.parallel_envoys",
        "nnsight.tracing.tracer", "nnsight.modeling.vllm.vllm", "nnsight.modeling.vllm.NotExported"]


# ---- nnsight's private names: reached only through the seam. ----

#: The methods of nnsight's model classes that streamscope's engine model classes override (nnsight calls them;
#: an override cannot live elsewhere), with the modules allowed to define them and call their parent's.
OVERRIDES = {
    "streamscope/transformers/model.py": {"_batch"},
    "streamscope/vllm/model.py": {"_call", "_collect", "_resolve_taps"},
}
#: Private names of vLLM's classes that nnsight's subclasses override (its runner's ``_update_states``): the vLLM
#: seam reaches them as vLLM's, and only it (`tests/test_vllm_seam.py`).
VLLM_NAMES = {"streamscope/vllm_seam.py": frozenset({"_update_states"})}


def nnsight_private_names() -> frozenset[str]:
    """The private names (``_x``, not dunders) nnsight's classes define: methods, class attributes, ``self._x =``."""
    names: set[str] = set()
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    for path in Path(nnsight.__file__).parent.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(), str(path))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(item.name):
                    names.add(item.name)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) and private(item.attr):
                    names.add(item.attr)
                elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store) and private(item.id):
                    names.add(item.id)
    return frozenset(names)


def private_accesses(path: Path, names: frozenset[str], overrides: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """Where `path` reaches one of nnsight's private `names`: ``(line, what)``.

    An attribute read or write (``envoy._module``, ``runner._update_states = ...``)
    and a method definition (an override nnsight would call; a module's own
    functions, and the methods of its classes without a base, are its
    business) count; in a
    module allowed `overrides`, defining one of those and calling the parent's
    (``super()._batch(...)`` inside ``def _batch``) does not.
    """
    found: list[tuple[int, str]] = []
    tree = ast.parse(path.read_text(), str(path))
    # A method of a class with no base is the module's own (no nnsight class can be among its ancestors): its
    # definition and its calls are not nnsight's, whatever the name.
    own = {item.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and not node.bases
           for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = names - own

    def visit(node: ast.AST, function: str | None, in_class: bool = False) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if in_class and node.name in names and node.name not in overrides:
                found.append((node.lineno, f"def {node.name}"))
            function = node.name
        elif isinstance(node, ast.Attribute) and node.attr in names:
            calls_parent = (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                            and node.value.func.id == "super" and node.attr == function)
            if not (calls_parent and node.attr in overrides):
                found.append((node.lineno, f".{node.attr}"))
        for child in ast.iter_child_nodes(node):
            visit(child, function, isinstance(node, ast.ClassDef))

    visit(tree, None)
    return sorted(found)


def test_only_the_seam_reaches_nnsight_private_names():
    names = nnsight_private_names()
    assert {"_module", "_child_map", "_update", "_location", "_batch"} <= names  # the walk reads nnsight's classes
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if in_seam(path):
            continue
        where = str(path.relative_to(PACKAGE.parent))
        bad += [f"{where}:{line} {what}" for line, what in
                private_accesses(path, names - VLLM_NAMES.get(where, frozenset()), frozenset(OVERRIDES.get(where, ())))]
    assert not bad, ("these modules reach nnsight's private names; add a function to streamscope/nnsight_seam/ "
                     "and call it instead:\n" + "\n".join(bad))


def test_the_private_name_check_sees_every_kind_of_access(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "class Model(Base):\n"
        "    def _batch(self, invokes):\n"
        "        return super()._batch(invokes)\n"
        "    def _update(self, module):\n"
        "        super()._update(module)\n"
        "        return self._batch([])\n"
        "def _module(envoy, runner):\n"
        "    runner._update_states = None\n"
        "    return envoy._module, envoy._own\n"
        "class Client:\n"
        "    def _call(self):\n"
        "        return self._call()\n"
    )
    names = frozenset({"_batch", "_update", "_update_states", "_module", "_call"})
    assert private_accesses(probe, names) == [
        (2, "def _batch"), (3, "._batch"), (4, "def _update"), (5, "._update"), (6, "._batch"),
        (8, "._update_states"), (9, "._module")]
    # An allowed override may define the method and call its parent's, nothing more.
    assert private_accesses(probe, names, frozenset({"_batch"})) == [
        (4, "def _update"), (5, "._update"), (6, "._batch"), (8, "._update_states"), (9, "._module")]


#: The seam's modules, each adapting one part of nnsight (the package's docstring says which): a module added to
#: the seam is exempt from the checks above, so adding one is a change to this list.
SEAM_MODULES = ["__init__.py", "backward.py", "envoys.py", "mediator.py", "vllm_modeling.py"]


def test_the_seam_is_its_package_and_the_trace_transport_is_checked_as_any_module():
    assert sorted(path.name for path in SEAM.rglob("*.py")) == SEAM_MODULES
    # streamscope's own transport of a vLLM trace's saves and invokes plugs into nnsight through the seam only.
    transport = PACKAGE / "vllm" / "trace_transport.py"
    assert transport.exists() and not in_seam(transport)
    assert private_imports(transport) == []
    assert private_accesses(transport, nnsight_private_names()) == []
    assert "nnsight_seam.vllm_modeling" in {module for _, module in _relative_imports(transport)}


def _relative_imports(path: Path) -> list[tuple[int, str]]:
    """The package-relative imports in `path`, ``(line, module)`` with the leading dots dropped."""
    return [(node.lineno, node.module or "") for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ImportFrom) and node.level]


def patching_functions(path: Path) -> list[str]:
    """The public functions of `path` that write an attribute of an object they did not create: an assignment to
    ``x.y`` (``self`` aside) or a ``setattr`` call, at any depth of the function."""
    found = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        for item in ast.walk(node):
            targets = item.targets if isinstance(item, ast.Assign) else []
            writes = any(isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                                    and target.value.id == "self")
                         for target in targets)
            calls = (isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.func.id == "setattr")
            if writes or calls:
                found.append(node.name)
                break
    return found


@pytest.mark.parametrize("module", [name for name in SEAM_MODULES if name != "__init__.py"])
def test_each_seam_module_lists_what_it_patches_and_the_upstream_api_that_would_replace_it(module):
    path = SEAM / module
    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    patching = patching_functions(path)
    unlisted = [name for name in patching if f"`{name}`" not in text]
    assert not unlisted, f"streamscope/nnsight_seam/{module}'s docstring does not list what {unlisted} patch"
    assert "Upstream:" in text, f"streamscope/nnsight_seam/{module}'s docstring names no upstream API"


def test_the_patch_listing_check_finds_a_patch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def quiet(x):\n    return x.y\n"
                     "def patch(cls):\n    def inner():\n        cls.flush = None\n    inner()\n"
                     "def marked(f):\n    setattr(f, 'mark', True)\n"
                     "def _private(m):\n    m.x = 1\n"
                     "class Own:\n    def set(self):\n        self.x = 1\n")
    assert patching_functions(probe) == ["patch", "marked"]


def test_the_supported_version_passes():
    assert nnsight.__version__ == nnsight_seam.SUPPORTED == "0.8.1"
    nnsight_seam.check_version()


@pytest.mark.parametrize("other", ["0.8.2", "0.9.0", "0.8.0"])
def test_another_version_is_refused_with_the_fix(monkeypatch, other):
    monkeypatch.delenv(nnsight_seam.ALLOW_ENV, raising=False)
    monkeypatch.setattr(nnsight, "__version__", other)
    with pytest.raises(ImportError) as refused:
        nnsight_seam.check_version()
    message = str(refused.value)
    assert f"nnsight {other} is installed" in message
    assert "needs nnsight 0.8.1" in message
    assert "pip install nnsight==0.8.1" in message
    assert "STREAMSCOPE_ALLOW_NNSIGHT=1" in message


def test_the_escape_hatch_warns_instead(monkeypatch):
    monkeypatch.setattr(nnsight, "__version__", "0.9.0")
    monkeypatch.setenv(nnsight_seam.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"pip install nnsight==0\.8\.1"):
        nnsight_seam.check_version()
    monkeypatch.setenv(nnsight_seam.ALLOW_ENV, "0")
    with pytest.raises(ImportError):
        nnsight_seam.check_version()


def test_importing_streamscope_on_another_version_fails_at_import():
    # The check runs when the seam is imported, i.e. before any value or engine module can load.
    code = ("import nnsight; nnsight.__version__ = '0.9.0'\n"
            "try:\n"
            "    import streamscope.values\n"
            "except ImportError as error:\n"
            "    print('REFUSED', error)\n"
            "else:\n"
            "    print('LOADED')\n")
    env = {key: value for key, value in os.environ.items() if key != nnsight_seam.ALLOW_ENV}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=PACKAGE.parent, timeout=300)
    assert "REFUSED" in result.stdout, result.stdout + result.stderr
    assert "nnsight 0.9.0 is installed" in result.stdout and "pip install nnsight==0.8.1" in result.stdout
