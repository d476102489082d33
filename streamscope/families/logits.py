"""The last steps a family's transformers head applies to the unembedding's output (`FamilySpec.logit_scaling`)."""

from __future__ import annotations

from typing import Any

import torch


def soft_capped(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """Gemma 2 and 3: ``tanh(logits / cap) * cap`` with the config's ``final_logit_softcapping``, where it sets one."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def divided_by_logits_scaling(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """Granite: the logits divided by the config's ``logits_scaling``, where it sets one."""
    scaling = getattr(config, "logits_scaling", None)
    return logits if scaling is None else logits / scaling


def times_logit_scale(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """Cohere: the logits times the config's ``logit_scale``, where it sets one."""
    scale = getattr(config, "logit_scale", None)
    return logits if scale is None else logits * scale


def as_the_config_says(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """A family streamscope does not map (the default family): every step above its config asks for.

    Cohere's scale only on a Cohere config: ``logit_scale`` means something
    else elsewhere (CLIP's, say).
    """
    logits = divided_by_logits_scaling(config, soft_capped(config, logits))
    return times_logit_scale(config, logits) if config.model_type == "cohere" else logits


def scaling_in_words(config: Any) -> str | None:
    """What a head applies to the unembedding's output under `config`, in words (None where nothing): the steps
    above that `as_the_config_says` takes, which both engines' heads apply (vLLM's logits processor reads the same
    config fields). A TransformerLens ``hook_unembed`` is before them."""
    steps = []
    if getattr(config, "final_logit_softcapping", None) is not None:
        cap = config.final_logit_softcapping
        steps.append(f"final soft cap (tanh(x / {cap}) * {cap})")
    if getattr(config, "logits_scaling", None) is not None:
        steps.append(f"division by logits_scaling ({config.logits_scaling})")
    if getattr(config, "logit_scale", None) is not None and config.model_type == "cohere":
        steps.append(f"multiplication by logit_scale ({config.logit_scale})")
    return " and ".join(steps) or None
