"""Where transformers' own modules compute each value, per family: the account the oracle reads with torch hooks.

This is the reference's side, not streamscope's: nothing here imports
streamscope's serving code. Each family's entry says, in the module names of
its transformers implementation, where each value is computed: ``(module path
relative to the block, "in" | "out")``, a tuple of such alternatives where
blocks differ (the first module the block has is used), ``None`` where the
block has no such value, and an optional third element, a function of the
config that scales the tensor (Granite's residual multiplier). Used by
`streamscope check` and by the test suite's oracle (tests/oracle.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

#: The residual stream's boundaries on a block, and what its sublayers add, in the order the block computes them
#: (the oracle's own list: it is checked against the block kinds' `streamscope.blocks.BOUNDARIES` by the tests).
BOUNDARIES = ("layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input", "layer_output")
CONTRIBUTIONS = ("attention_output", "mlp_output")
#: A dense MLP's hidden activation: the input of its nonlinearity, and the input of its down projection.
NEURONS = ("neurons_pre", "neurons")
#: Every block value the map places, in the order a block computes them.
BLOCK_VALUES = ("layer_input", "attention_norm_output", "attention_output", "layer_mid", "mlp_norm_output",
                "mlp_input", *NEURONS, "mlp_output", "layer_output")

# The neurons are read where the MLP's own activation module and down projection are called: a mixture of
# experts' block has neither (its experts are batched weights), so it has no such value.
_PRE_NORM = {
    "neurons_pre": ("mlp.act_fn", "in"),
    "neurons": ("mlp.down_proj", "in"),
    "layer_input": ("", "in"),
    "attention_norm_output": ("input_layernorm", "out"),
    "attention_output": ("self_attn", "out"),
    "layer_mid": ("post_attention_layernorm", "in"),
    "mlp_norm_output": ("post_attention_layernorm", "out"),
    "mlp_input": ("mlp", "in"),
    "mlp_output": ("mlp", "out"),
    "layer_output": ("", "out"),
}
_LLAMA_ROOT = {"layers": "model.layers", "token_embeddings": ("model.embed_tokens", "out"),
               "final_norm_output": ("model.norm", "out")}
_SANDWICH = {**_PRE_NORM, "attention_output": ("post_attention_layernorm", "out"),
             "layer_mid": ("pre_feedforward_layernorm", "in"),
             "mlp_norm_output": ("pre_feedforward_layernorm", "out"),
             "mlp_output": ("post_feedforward_layernorm", "out")}
_POST_NORM = {**_PRE_NORM, "attention_norm_output": None, "mlp_norm_output": None,
              "attention_output": ("post_attention_layernorm", "out"), "layer_mid": ("mlp", "in"),
              "mlp_output": ("post_feedforward_layernorm", "out")}
_residual = lambda config: config.residual_multiplier  # noqa: E731

ORACLE: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_ROOT, **_PRE_NORM},
    "mistral": {**_LLAMA_ROOT, **_PRE_NORM},
    "qwen2": {**_LLAMA_ROOT, **_PRE_NORM},
    "qwen3": {**_LLAMA_ROOT, **_PRE_NORM},
    "qwen3_moe": {**_LLAMA_ROOT, **_PRE_NORM},
    "mixtral": {**_LLAMA_ROOT, **_PRE_NORM},
    "gemma": {**_LLAMA_ROOT, **_PRE_NORM},
    "gemma2": {**_LLAMA_ROOT, **_SANDWICH},
    "gemma3_text": {**_LLAMA_ROOT, **_SANDWICH},
    "phi3": {**_LLAMA_ROOT, **_PRE_NORM, "neurons_pre": ("mlp.activation_fn", "in")},
    "granite": {**_LLAMA_ROOT, **_PRE_NORM, "token_embeddings": ("model.layers.0", "in"),
                "attention_output": ("self_attn", "out", _residual), "mlp_output": ("mlp", "out", _residual)},
    "olmo2": {**_LLAMA_ROOT, **_POST_NORM},
    "exaone4": {**_LLAMA_ROOT, **_POST_NORM},
    "cohere": {**_LLAMA_ROOT, **_PRE_NORM, "layer_mid": None, "mlp_norm_output": ("input_layernorm", "out")},
    "stablelm": {**_LLAMA_ROOT, **_PRE_NORM},
    "llama4_text": {**_LLAMA_ROOT, **_PRE_NORM, "mlp_input": ("feed_forward", "in"),
                    "mlp_output": ("feed_forward", "out"), "neurons_pre": ("feed_forward.activation_fn", "in"),
                    "neurons": ("feed_forward.down_proj", "in")},
    "qwen3_next": {**_LLAMA_ROOT, **_PRE_NORM,
                   "attention_output": (("self_attn", "out"), ("linear_attn", "out"))},
    "gpt2": {"layers": "transformer.h", "token_embeddings": ("transformer.wte", "out"),
             "final_norm_output": ("transformer.ln_f", "out"), **_PRE_NORM,
             "attention_norm_output": ("ln_1", "out"), "attention_output": ("attn", "out"),
             "layer_mid": ("ln_2", "in"), "mlp_norm_output": ("ln_2", "out"),
             "neurons_pre": ("mlp.act", "in"), "neurons": ("mlp.c_proj", "in")},
    "gptj": {"layers": "transformer.h", "token_embeddings": ("transformer.wte", "out"),
             "final_norm_output": ("transformer.ln_f", "out"), **_PRE_NORM,
             "attention_norm_output": ("ln_1", "out"), "attention_output": ("attn", "out"),
             "layer_mid": None, "mlp_norm_output": ("ln_1", "out"),
             "neurons_pre": ("mlp.act", "in"), "neurons": ("mlp.fc_out", "in")},
    "gpt_neox": {"layers": "gpt_neox.layers", "token_embeddings": ("gpt_neox.embed_in", "out"),
                 "final_norm_output": ("gpt_neox.final_layer_norm", "out"), **_PRE_NORM,
                 "attention_output": ("attention", "out"), "layer_mid": None,
                 "neurons_pre": ("mlp.act", "in"), "neurons": ("mlp.dense_4h_to_h", "in")},
    "opt": {"layers": "model.decoder.layers", "token_embeddings": ("model.decoder.embed_tokens", "out"),
            "final_norm_output": ("model.decoder.final_layer_norm", "out"), **_PRE_NORM,
            "attention_norm_output": ("self_attn_layer_norm", "out"),
            "layer_mid": ("final_layer_norm", "in"), "mlp_norm_output": ("final_layer_norm", "out"),
            "mlp_input": ("fc1", "in"), "mlp_output": ("fc2", "out"),
            "neurons_pre": ("activation_fn", "in"), "neurons": ("fc2", "in")},
    # three layouts, by the norms a block has: ln_attn and ln_mlp (parallel, the new layout), input_layernorm
    # alone (parallel, one norm: Falcon-7B), input_layernorm and post_attention_layernorm (sequential: Falcon-RW)
    "falcon": {"layers": "transformer.h", "token_embeddings": ("transformer.word_embeddings", "out"),
               "final_norm_output": ("transformer.ln_f", "out"), **_PRE_NORM,
               "attention_norm_output": (("ln_attn", "out"), ("input_layernorm", "out")),
               "attention_output": ("self_attention", "out"), "layer_mid": ("post_attention_layernorm", "in"),
               "mlp_norm_output": (("ln_mlp", "out"), ("post_attention_layernorm", "out"), ("input_layernorm", "out")),
               "neurons_pre": ("mlp.act", "in"), "neurons": ("mlp.dense_4h_to_h", "in")},
    "mamba": {"layers": "backbone.layers", "token_embeddings": ("backbone.embeddings", "out"),
              "final_norm_output": ("backbone.norm_f", "out"), **_PRE_NORM,
              "attention_norm_output": ("norm", "out"), "attention_output": ("mixer", "out"),
              "layer_mid": None, "mlp_norm_output": None, "mlp_input": None, "mlp_output": None,
              "neurons_pre": None, "neurons": None},
}

#: OPT with ``do_layer_norm_before=False`` (OPT-350m): a norm after each residual add, none at the end. The
#: stream between the halves is the attention half's norm output; what each sublayer adds is not a tensor of
#: the forward (the norm comes after the add).
OPT_POST_LN = {**ORACLE["opt"], "final_norm_output": None, "attention_norm_output": None, "mlp_norm_output": None,
               "attention_output": None, "mlp_output": None, "layer_mid": ("self_attn_layer_norm", "out")}


def module_at(root: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    """The submodule at dotted `path` (the root for ""), or None where the model has none."""
    module: Any = root
    for part in filter(None, path.split(".")):
        module = getattr(module, part, None)
        if not isinstance(module, torch.nn.Module):
            return None
    return module


class UnknownFamily(KeyError):
    """A model type the oracle has no map for: it cannot say where that family's modules hold any value."""

    def __str__(self) -> str:
        return str(self.args[0])


def sites(model: Any, family: str) -> dict[str, Any]:
    """The family's map for this model: OPT's post-LN layout (``do_layer_norm_before=False``) has its own.

    A family the oracle does not know is refused (`UnknownFamily`, naming the
    known ones): no other family's map is a safe guess of where its modules
    hold each value.
    """
    if family not in ORACLE:
        raise UnknownFamily(
            f"the oracle has no map of where {family!r} models hold each value (known: {', '.join(ORACLE)}); "
            f"add the family to streamscope/testing/oracle.py (ORACLE) to check it")
    if family == "opt" and not model.config.do_layer_norm_before:
        return OPT_POST_LN
    return ORACLE[family]


def site(model: torch.nn.Module, family: str, name: str, block: Optional[int] = None):
    """(module, "in" | "out", scale) where `name` is computed, or None where the model has no such value."""
    spec = sites(model, family)[name]
    if spec is None:
        return None
    alternatives = spec if isinstance(spec[0], tuple) else (spec,)
    prefix = "" if block is None else f"{ORACLE[family]['layers']}.{block}."
    for alternative in alternatives:
        path, where, *scale = alternative
        module = module_at(model, (prefix + path).rstrip("."))
        if module is not None:
            factor = scale[0](model.config) if scale else None
            return module, where, factor
    return None


#: Where transformers' attention holds its queries and keys before the rotary embedding, per family (the oracle's
#: account of TransformerLens's hook_q / hook_k): ``("call", function, layout)``, the arguments ``(q, k, ...)`` of
#: the modeling module's `function`, in ``"bhsd"`` or ``"bshd"`` layout; or ``("modules", queries, keys)``, each a
#: tuple of ``(path relative to the attention, "out")`` alternatives (the first the module has is used) whose
#: output is ``[batch, heads, seq, head_dim]`` or the flat projection ``[batch, seq, heads * head_dim]``, for a
#: forward that rotates a slice of each head. A family absent here rotates nothing: its kernel's queries and keys
#: are the values, as on any block whose rotary call does not run (Llama 4's NoPE blocks, EXAONE 4's global ones,
#: Falcon with ALiBi).
_ROTARY_CALL = ("call", "apply_rotary_pos_emb", "bhsd")
PRE_ROTARY: dict[str, tuple] = {
    **{family: _ROTARY_CALL for family in (
        "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text", "phi3",
        "granite", "olmo2", "exaone4", "cohere", "qwen3_next", "gpt_neox", "falcon")},
    "llama4_text": ("call", "apply_rotary_emb", "bshd"),
    "stablelm": ("modules", (("q_layernorm", "out"), ("q_proj", "out")), (("k_layernorm", "out"), ("k_proj", "out"))),
    "gptj": ("modules", (("q_proj", "out"),), (("k_proj", "out"),)),
}


#: Where transformers' attention holds its query and key projections per head before a q/k norm that precedes the
#: rotary (the oracle's account of TransformerLens's hook_q / hook_k on such families): the input of the
#: attention's child module, the first of the alternatives the module has (Cohere's and StableLM's exist only with
#: the config's q/k norm on). A family absent here, or a block without the module, norms nothing before its rotary:
#: its projections are its pre-rotary values (`PRE_ROTARY`). (Llama 4's ``qk_norm`` follows its rotary.)
_QK_NORMS = ((("q_norm", "in"), ("q_layernorm", "in")), (("k_norm", "in"), ("k_layernorm", "in")))
PROJECTED: dict[str, tuple] = {family: _QK_NORMS for family in (
    "qwen3", "qwen3_moe", "gemma3_text", "olmo2", "exaone4", "qwen3_next", "cohere", "stablelm")}
