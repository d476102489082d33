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
