"""`cache.logit_attrs`'s default against the model's own logits, shared by both engines' tests (issue 38, item 5).

The oracle is transformers' float32 forward of the same checkpoint (`oracle.values`): its logits, and its final
norm's and head's parameters read with plain torch. Summed over `decompose_resid`'s parts and the appended bias
row, the default attributions are the model's logit; where the head soft-caps (Gemma 2), the logit before the cap.
"""

from __future__ import annotations

from typing import Any, Sequence

import pytest
import torch

import oracle
from access import relative_error

#: float32 on the CPU: the parts are the same products as the model's, summed in another order.
RELATIVE = 1e-5
#: Gemma 2's soft cap on its tiny checkpoint: small enough to bend its logits (up to about 2) well past the tolerance, not so small that they saturate.
SMALL_CAP = {"final_logit_softcapping": 2.0}
#: Token ids attributed: a few, so a sum that holds for one token by chance does not pass.
TOKENS = (7, 11, 42)


def uncapped(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """The head's logits before its soft cap (the cap's inverse), or as they are where it has none."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else (torch.atanh(logits.double() / cap) * cap).float()


def check_sums_to_the_logit(cache: Any, reference: torch.nn.Module, family: str, ids: Sequence[torch.Tensor],
                            expected: Sequence[dict], engine_tolerance: float = RELATIVE) -> None:
    """Every token's attributions at every real position of every prompt sum to the model's logit: the cache's
    own logits to `RELATIVE`, the reference's to `engine_tolerance` (what the engine's kernels keep from it)."""
    parts, labels = cache.decompose_resid(return_labels=True)
    config = reference.config
    for token in TOKENS:
        attrs = cache.logit_attrs(parts, tokens=token)
        assert attrs.shape == (parts.shape[0] + 1, *parts.shape[1:3]), "one row per part, then the bias row"
        for row, (prompt_ids, values) in enumerate(zip(ids, expected)):
            real = cache.mask[row]  # the cache pads on either side: its mask says where the prompt is
            assert int(real.sum()) == prompt_ids.shape[1]
            logit = values["logits"][0, :, token]
            if getattr(config, "final_logit_softcapping", None) is not None:  # the cap must bend these logits
                assert relative_error(logit, uncapped(logit, config)) > 100 * RELATIVE, "choose a smaller cap"
            total = attrs[:, row, real].sum(0)
            error = relative_error(total, uncapped(logit, config))
            assert error <= engine_tolerance, (family, token, row, error)
            # The same against the logits the cache itself holds (the engine's own head).
            assert relative_error(total, uncapped(cache.logits[row, real, token], config)) <= RELATIVE
    # The bias row: the final norm's bias through the unembedding plus the head's bias, times the head's
    # linear scale, read off transformers' modules.
    norm = oracle.site(reference, family, "final_norm_output")[0]
    head = reference.get_output_embeddings()
    token = TOKENS[0]
    constant = torch.zeros(())
    if getattr(norm, "bias", None) is not None:
        constant = constant + norm.bias.detach() @ head.weight.detach()[token]
    if getattr(head, "bias", None) is not None:
        constant = constant + head.bias.detach()[token]
    scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    bias_row = cache.logit_attrs(parts, tokens=token)[-1]
    assert torch.allclose(bias_row, torch.full_like(bias_row, float(constant) * scale), rtol=RELATIVE,
                          atol=RELATIVE * max(1.0, abs(float(constant)))), family


def check_differences_and_forms(cache: Any, reference: torch.nn.Module, expected: Sequence[dict],
                                engine_tolerance: float = RELATIVE) -> None:
    """A logit difference (`incorrect_tokens`) and one token per prompt (``[batch]``) sum to the reference's."""
    parts = cache.decompose_resid()
    config = reference.config
    difference = cache.logit_attrs(parts, tokens=7, incorrect_tokens=11).sum(0)
    per_prompt = cache.logit_attrs(parts, tokens=torch.tensor([7, 11])).sum(0)
    for row, values in enumerate(expected):
        real = cache.mask[row]
        logits = uncapped(values["logits"][0], config)
        assert relative_error(difference[row, real], logits[:, 7] - logits[:, 11]) <= 2 * engine_tolerance
        assert relative_error(per_prompt[row, real], logits[:, [7, 11][row]]) <= engine_tolerance


def check_conventions(cache: Any) -> None:
    """TransformerLens's numbers one argument away; arguments that do not fit the convention refused."""
    parts = cache.decompose_resid()
    tl = cache.logit_attrs(parts, tokens=7, convention="transformer_lens")
    assert tl.shape == parts.shape[:3]
    # TL's convention: each part centred (where the norm centres) over the final stream's scale, no weight.
    final = cache[f"layers.{cache.num_layers - 1}.layer_output"]
    centred = cache.final_norm.centred
    stream = final - final.mean(-1, keepdim=True) if centred else final
    scale = (stream.pow(2).mean(-1, keepdim=True) + cache.final_norm.eps).sqrt()
    row = cache.tokens_to_residual_directions(7)
    pieces = parts - parts.mean(-1, keepdim=True) if centred else parts
    assert relative_error(tl, (pieces / scale) @ row) <= RELATIVE
    with pytest.raises(ValueError, match="convention='transformer_lens', norm_weight=True"):
        cache.logit_attrs(parts, tokens=7, norm_weight=True)
    with pytest.raises(ValueError, match="choose 'logit'"):
        cache.logit_attrs(parts, tokens=7, convention="tl")
    # A refused call leaves the cache answering the next.
    assert cache.logit_attrs(parts, tokens=7).shape[0] == parts.shape[0] + 1
