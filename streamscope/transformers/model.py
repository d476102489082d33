"""streamscope on Hugging Face transformers: nnsight's TransformersModel with the family's names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from nnsight.modeling.transformers import TransformersModel
from transformers import AutoConfig

from ..model import Standardized
from .families import family_for


class StandardizedTransformers(Standardized, TransformersModel):
    """A transformers causal LM under streamscope's names: `model.layers[i].layer_mid` and the rest."""

    ENGINE = "transformers"

    def __init__(self, path: str | Path, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("config") or AutoConfig.from_pretrained(str(path), trust_remote_code=kwargs.get("trust_remote_code", False))
        # Set before the tree is built: the root's values consult the family.
        object.__setattr__(self, "family", family_for(config.model_type))
        kwargs.setdefault("rename", self.family.RENAME)
        kwargs.setdefault("envoys", self.family.ENVOYS)
        kwargs.setdefault("dtype", torch.float32)
        kwargs.setdefault("dispatch", True)
        kwargs.setdefault("task", "text-generation")
        super().__init__(str(path), *args, **kwargs)


def load(path: str | Path, **kwargs: Any) -> StandardizedTransformers:
    """Load a causal LM from a folder or repository on transformers, float32 unless `dtype` says otherwise.

    Keyword arguments go to nnsight's TransformersModel (and from it to
    ``from_pretrained``): ``dtype``, ``device_map``, ``attn_implementation``,
    ``dispatch=False`` to load the weights at the first trace.
    """
    return StandardizedTransformers(path, **kwargs)
