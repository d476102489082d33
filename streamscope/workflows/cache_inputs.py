"""What `model.cache` takes and reads off the model: prompts as token ids (`_token_ids`), TransformerLens's
``names_filter``, the output projections (`_output_weights`) and the stream each norm reads (`norm_inputs`).

Kept apart from `streamscope.workflows.cache`, which imports both (and `serve.remote_cache` from it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..blocks.parallel import SharedNormParallelLayer
from ..blocks.sublayers import PostNormedAttention, PostNormedMlp
from ..engine import encode
from ..errors import Unavailable, code_of


def _token_ids(model: Any, prompts: Any, prepend_bos: Optional[bool] = None) -> list[list[int]]:
    """Each prompt's token ids: strings are tokenized (the tokenizer's own BOS rule, or `prepend_bos`'s:
    `streamscope.engine.encode`); token ids (a ``[batch, seq]`` or ``[seq]`` tensor, a list of ints or of lists)
    are taken as they are, every id a token (give a padded batch as a list of unpadded id lists)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype.is_floating_point or prompts.dim() not in (1, 2):
            raise ValueError(f"token ids must be an integer tensor [batch, seq] or [seq], not {prompts.dtype} "
                             f"{tuple(prompts.shape)}")
        prompts = prompts.reshape(-1, prompts.shape[-1]).tolist()
    prompts = list(prompts)
    if prompts and all(isinstance(item, int) for item in prompts):
        prompts = [prompts]
    if not prompts:
        raise ValueError("model.cache needs at least one prompt")
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            encoded.append(encode(model.tokenizer, prompt, prepend_bos))
        elif isinstance(prompt, (list, tuple, torch.Tensor)) and len(prompt) and all(
                isinstance(item, int) for item in torch.as_tensor(prompt).tolist()):
            ids = [int(item) for item in torch.as_tensor(prompt).tolist()]
            bad = [item for item in ids if not 0 <= item < model.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{model.vocab_size - 1})")
            if prepend_bos is not None:
                raise ValueError(f"prepend_bos={prepend_bos!r} applies to text; token ids run as given (add or drop "
                                 f"the BOS id in them, or pass the text)")
            encoded.append(ids)
        else:
            raise TypeError(f"model.cache takes a prompt (a string, or a non-empty list of token ids) or a list of "
                            f"them, not {prompt!r:.80}")
    return encoded


def _names_filter(names_filter: Any) -> Optional[Any]:
    """TransformerLens's names_filter as a predicate: a callable, a name, or a list of names."""
    if names_filter is None or callable(names_filter):
        return names_filter
    if isinstance(names_filter, str):
        return lambda name: name == names_filter
    wanted = set(names_filter)
    return lambda name: name in wanted


def _output_weights(model: Any) -> Callable[[], list]:
    """What a cache reads TransformerLens's ``W_O`` with: the engine's output projections, or per block the reason
    a head's result cannot be computed from its output where the family gates it (`FamilySpec.gated_head_outputs`)."""
    gated = model.family_spec.gated_head_outputs
    if gated is None:
        return model.engine.output_projections
    reason = (f"{gated}: read self_attn.head_results instead, which is taken at the projection's input "
              f"(model.cache(prompt, values=['self_attn.head_results']), or in a trace)")
    return lambda: [reason] * model.num_layers


def norm_inputs(model: Any) -> dict[int, dict[str, str]]:
    """Per block: the stream (a cache key) its attention norm (``ln1``) and MLP norm (``ln2``) read, else why none."""
    found = {}
    for index in range(model.num_layers):
        rows = model.layers[index].support().rows
        attention = rows.get("attention_norm_output", "this block has no attention norm")
        mlp = rows.get("mlp_norm_output", "this block has no MLP norm")
        mid = rows.get("layer_mid", "no stream between the sublayers")
        ln1 = f"layers.{index}.layer_input" if attention is None else attention
        if isinstance(model.layers[index], SharedNormParallelLayer):
            ln2 = ("this block has one norm (ln1), which the attention and the MLP both read: "
                   "its scale is blocks.{i}.ln1.hook_scale (mlp_input=False)").replace("{i}", str(index))
        elif mlp is not None:
            ln2 = mlp
        elif mid is None:
            ln2 = f"layers.{index}.layer_mid"
        else:
            ln2 = f"layers.{index}.layer_input" if code_of(mid) == "parallel" else mid
        found[index] = {"ln1": ln1, "ln2": ln2}
        # A sublayer whose output passes a norm before the add (Gemma 2's sandwich, OLMo 2's post-norm): its parts
        # (heads, neurons) add up to what it adds only through that norm (`tl_decomposition`).
        for role, kind, key in (("self_attn", PostNormedAttention, "attention_post_norm"),
                                ("mlp", PostNormedMlp, "mlp_post_norm")):
            try:
                sublayer = getattr(model.layers[index], role)
            except (AttributeError, Unavailable):
                sublayer = None
            if isinstance(sublayer, kind):
                found[index][key] = f"block {index} normalizes its {role}'s output before adding it to the stream"
    return found
