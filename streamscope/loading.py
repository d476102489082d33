"""`streamscope.load`: a checkpoint named by a folder, a GGUF file, a hub id or ``"smollm2"``, on an engine by name,
and what a load refuses before the engine reads a weight (an unknown dtype, a model that is not a decoder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from .engine_registry import MODULES, engine_module
from .input_checks import local_folder
from .models import resolve

#: dtype names both engines take besides torch's own (``"float32"``, ``"bfloat16"``, ...).
DTYPE_WORDS = ("auto", "half", "float")


def check_load(path: str | Path, kwargs: dict[str, Any]) -> None:
    """Raise a clear error for what would fail later, or load the wrong thing, on either engine."""
    check_dtype(kwargs.get("dtype", kwargs.get("torch_dtype")))
    folder = local_folder(path)
    if folder is not None:
        check_decoder(folder)


def check_dtype(dtype: Any) -> None:
    """A dtype a model's weights can have: a floating torch dtype, its name, or ``"auto"``."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if dtype in DTYPE_WORDS or (isinstance(named, torch.dtype) and named.is_floating_point):
            return
    raise ValueError(
        f"dtype={dtype!r} is not a floating-point dtype: use 'float32' (the default; exact against the "
        f"oracle), 'bfloat16' or 'float16', a torch dtype such as torch.bfloat16, or 'auto' for the checkpoint's own."
    )


def check_decoder(folder: Path) -> None:
    """Refuse an encoder (BERT's masked LM) or an encoder-decoder (T5) before any weight is read."""
    # transformers' table of masked LMs, reached through its lazy module (read here, not when streamscope imports).
    masked_lm_types = transformers.models.auto.modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # the engine's own loader says what is wrong with the file
    model_type = config.get("model_type")
    encoder = config.get("is_encoder_decoder") or (
        model_type in masked_lm_types and not config.get("is_decoder"))
    if encoder:
        kind = "an encoder-decoder" if config.get("is_encoder_decoder") else "an encoder (a masked language model)"
        raise ValueError(
            f"{folder} is a {model_type!r} checkpoint, {kind}: streamscope maps decoder-only language models, "
            f"whose blocks run left to right over a residual stream (Llama, GPT-2, Gemma, ...). Load a "
            f"causal LM checkpoint, or use nnsight's NNsight(model) to reach this model's modules directly."
        )


def load(path: str | Path, engine: str = "transformers", **kwargs: Any) -> Any:
    """Load a decoder-only model under streamscope's names.

    Args:
        path: A checkpoint folder; ``"smollm2"`` (SmolLM2-135M-Instruct, fetched and converted once, as the
            command line takes it); a ``.gguf`` file (converted once to a float32 checkpoint); or a hub
            repository id, fetched as transformers and vLLM fetch it (where the hub cannot be reached,
            this fails at once saying what to do).
        engine: ``"transformers"`` or ``"vllm"``.
        **kwargs: Passed to the engine (``dtype``, ``device_map``; vLLM's
            engine arguments). A vLLM engine starts quietly (vLLM's warnings only); ``verbose=True`` prints
            vLLM's log (`streamscope.vllm.model.load`).
    """
    if engine not in MODULES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(MODULES)}")
    if isinstance(path, (str, Path)):
        path = resolve(path)
    check_load(path, kwargs)
    return engine_module(engine).load(path, **kwargs)
