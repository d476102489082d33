"""Write a stand-in ``humming`` package where the lent H200's vLLM 0.22 needs one to resolve any quantization method.

vLLM 0.22's ``get_quantization_config`` imports every method's module, and on CUDA
``quantization/humming.py`` and ``fused_moe/experts/fused_humming_moe.py`` import the ``humming`` kernel package
at module level. That package is not on the package registry and is not among the carried wheels, so an FP8
checkpoint (vLLM's ``fp8`` method, which never calls humming) stops at the engine's configuration with
``ModuleNotFoundError: No module named 'humming'``. The stand-in answers every name those imports ask for with a
placeholder class (so the modules' class statements can subclass it); calling anything of it raises, naming
this file, so a run that did reach humming would say so instead of computing with it.

    python3 scripts/humming_stub.py /tmp/site      # then import vllm with /tmp/site on sys.path
"""

from __future__ import annotations

import sys
from pathlib import Path

MODULES = ("humming", "humming.dtypes", "humming.layer", "humming.schema", "humming.config", "humming.utils",
           "humming.utils.weight")

STAND_IN = '''"""A stand-in for the humming kernel package, written by streamscope's scripts/humming_stub.py (see there)."""


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"humming.{cls.__name__} was called, but humming here is streamscope's stand-in "
                           f"(scripts/humming_stub.py): this run needs the real humming package.")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (), {})
'''


def write(root: Path) -> list[Path]:
    """The stand-in's files under `root` (a folder on ``sys.path``); an installed real ``humming`` is left alone."""
    if (root / "humming").exists() and not (root / "humming" / "STAND_IN").exists():
        return []
    written = []
    for name in MODULES:
        parts = name.split(".")
        folder = root.joinpath(*parts)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text(STAND_IN)
        written.append(folder / "__init__.py")
    (root / "humming" / "STAND_IN").write_text("streamscope scripts/humming_stub.py\n")
    return written


if __name__ == "__main__":
    if len(sys.argv) > 2 or any(argument.startswith("-") for argument in sys.argv[1:]):
        sys.exit(f"usage: python3 {sys.argv[0]} [SITE_FOLDER]  (default /tmp/site)\n\n{__doc__}")
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/site")
    print(f"humming stand-in: {len(write(target))} modules under {target}")
