"""Family modules for the vLLM engine, found by ``config.model_type``: ``RENAME`` and ``ENVOYS`` for vLLM's module tree.

The same contract as the transformers families (see
`streamscope.transformers.families`), stated against vLLM's classes in
``vllm.model_executor.models``: the block kinds of `streamscope.vllm.blocks`.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def family_for(model_type: str) -> ModuleType:
    """The vLLM family module of `model_type`; a clear error where streamscope has none."""
    try:
        return importlib.import_module(f"{__name__}.{model_type}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{model_type}":
            raise
        raise NotImplementedError(
            f"streamscope has no vLLM family module for model type {model_type!r}; load it with "
            f"engine='transformers', or add streamscope/vllm/families/{model_type}.py (RENAME and ENVOYS)."
        ) from None
