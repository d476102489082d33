"""Finding a family module by ``config.model_type``, for each engine's ``families`` package."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional


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
