"""The last steps a family's transformers head applies to the unembedding's output (`FamilySpec.logit_scaling`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

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


def scale_and_cap(scaling: Optional[Callable[[Any, torch.Tensor], torch.Tensor]],
                  config: Any) -> tuple[float, Optional[float]]:
    """``(scale, soft_cap)`` such that ``scaling(config, z)`` is ``scale * soft_cap * tanh(z / soft_cap)`` (``scale
    * z`` where `soft_cap` is None): the linear and the non-linear part of a family's `FamilySpec.logit_scaling`.

    Read from the config fields the functions above read, then checked against `scaling` itself on a few
    values, so a function this cannot express is refused rather than misread.
    """
    if scaling is None:
        return 1.0, None
    capped = scaling in (soft_capped, as_the_config_says)
    cap = getattr(config, "final_logit_softcapping", None) if capped else None
    scale = 1.0
    if scaling in (divided_by_logits_scaling, as_the_config_says) and getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    cohere = scaling is times_logit_scale or (scaling is as_the_config_says and config.model_type == "cohere")
    if cohere and getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    probe = torch.linspace(-4.0, 4.0, 9, dtype=torch.float64)
    expected = scale * (probe if cap is None else torch.tanh(probe / cap) * cap)
    if not torch.allclose(scaling(config, probe), expected, rtol=1e-9, atol=1e-12):
        raise ValueError(f"the head's scaling {getattr(scaling, '__name__', scaling)!r} is not a scale after a "
                         f"soft cap: logit_attrs cannot split it into per-component parts")
    return scale, None if cap is None else float(cap)


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
