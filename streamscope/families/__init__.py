"""Finding a family module by ``config.model_type``, for each engine's ``families`` package.

A family module states what it maps as a `FamilySpec` (``SPEC``), checked
when a model loads (`spec_of`); `streamscope.families.renames` holds the
``rename=`` maps both engines use.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

from .spec import FamilySpec, FamilySpecError, spec_of


def find_family(package: str, model_type: str) -> Optional[ModuleType]:
    """The module ``<package>.<model_type>``, or None where the package has none.

    An import error inside an existing family module is raised, not taken for a missing family.
    """
    name = f"{package}.{model_type}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        return None


def known_families(package: str) -> list[str]:
    """The model types `package` has a family module for, sorted."""
    import pkgutil

    return sorted(info.name for info in pkgutil.iter_modules(importlib.import_module(package).__path__))


def named_family(package: str, name: str, engine: str) -> ModuleType:
    """The family module called `name`; a ValueError listing the known ones where there is none."""
    family = find_family(package, name)
    if family is None:
        default = ", or pass family='default' for the best-effort default" if engine == "transformers" else ""
        raise ValueError(
            f"streamscope has no {engine} family called {name!r}. Known families: "
            f"{', '.join(known_families(package))}. Leave `family` out to use the checkpoint's own model type"
            f"{default}."
        )
    return family


__all__ = ["FamilySpec", "FamilySpecError", "find_family", "known_families", "named_family", "spec_of"]
