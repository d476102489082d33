"""Each family as the model is, whichever engine runs it: `NEUTRAL`, one engine-neutral `FamilySpec` per model type.

What is stated here is the checkpoint's: its module names (transformers'
names, which vLLM's own model classes keep), the block kinds of
`streamscope.blocks` that serve its blocks, its learned positions, the sizes
it has none of, its gated heads. Each engine's family module
(``streamscope.<engine>.families.<model_type>``) starts from its entry and adds
only what is that engine's (`derive`): vLLM its module classes aliased by
class, its ``layout``, its attention kinds, ``cannot_run``; transformers its
kernel-call attention kinds, its routers, its logit scaling.
``tests/test_families_neutral.py`` fails where both engines state the same
value that this table does not.
"""

from __future__ import annotations

from typing import Union

from ..blocks import (Attention, HybridLayer, Layer, LinearAttention, Mlp, PostNormedAttention, PostNormedMlp,
                      PostNormLayer, SandwichLayer, SharedExpert, SharedNormParallelLayer, StateSpaceLayer)
from ..blocks.parallel import ConfigParallelLayer, FalconLayer
from ..blocks.post_norm import OPTLayer
from ..blocks.scaled import GraniteAttention, GraniteMlp
from ..blocks.state_space import HEADLESS
from .spec import FamilySpec, derive

#: Llama's tree, shared by every family built like it (``model.layers``, ``model.embed_tokens``, ``model.norm``).
LLAMA_NAMES: dict[Union[str, type], str] = {
    "model.embed_tokens": "embed_tokens", "model.layers": "layers", "model.norm": "norm"}

#: GPT-NeoX's tree (Pythia).
GPT_NEOX_NAMES: dict[Union[str, type], str] = {
    "gpt_neox.layers": "layers", "gpt_neox.embed_in": "embed_tokens", "gpt_neox.final_layer_norm": "norm",
    "embed_out": "lm_head",  # older transformers name the unembedding embed_out
    "attention": "self_attn",
}

#: Qwen3-Next's attention multiplies the heads' mix by a sigmoid output gate (the other half of `q_proj`) before the
#: output projection (`FamilySpec.gated_head_outputs`).
QWEN3_NEXT_GATED_HEAD_OUTPUTS = ("Qwen3-Next's attention scales each head's output (head_outputs) by a sigmoid "
                                 "output gate before the output projection, so head_outputs times W_O is not what a "
                                 "head adds")

_LLAMA = FamilySpec(rename=LLAMA_NAMES, envoys={"layers.*": Layer, "self_attn": Attention, "mlp": Mlp})
_POST_NORM = derive(_LLAMA, envoys={"layers.*": PostNormLayer, "self_attn": PostNormedAttention,
                                    "mlp": PostNormedMlp})
# Gemma 2's sandwich norms: each sublayer's output passes a post-norm before its add.
_SANDWICH = derive(_LLAMA, envoys={"layers.*": SandwichLayer, "self_attn": PostNormedAttention, "mlp": PostNormedMlp})

#: The engine-neutral spec of each model type in `streamscope.families.MODEL_TYPES`. An MoE's ``mlp`` is an `Mlp`
#: here: its router is read where each engine runs it (transformers' router module, vLLM's fused kernel).
NEUTRAL: dict[str, FamilySpec] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "phi3": _LLAMA, "gemma": _LLAMA,
    "stablelm": _LLAMA, "qwen3_moe": _LLAMA, "mixtral": _LLAMA,
    "gemma2": _SANDWICH, "gemma3_text": _SANDWICH,
    # OLMo 2 and EXAONE 4: a post-norm block, x + norm(attn(x)) then + norm(mlp(.)).
    "olmo2": _POST_NORM, "exaone4": _POST_NORM,
    # Cohere: a parallel block with one norm feeding both sublayers.
    "cohere": derive(_LLAMA, envoys={"layers.*": SharedNormParallelLayer}),
    # Granite: each sublayer's output is scaled by residual_multiplier before its add.
    "granite": derive(_LLAMA, envoys={"self_attn": GraniteAttention, "mlp": GraniteMlp}),
    "llama4_text": derive(_LLAMA, rename={"feed_forward": "mlp", "shared_expert": "shared_experts"},
                          envoys={"shared_experts": SharedExpert}),
    # A hybrid: each block mixes with softmax attention or a gated delta net; a mixture with a gated shared expert.
    "qwen3_next": FamilySpec(
        rename={**LLAMA_NAMES, "shared_expert": "shared_experts"},
        envoys={"layers.*": HybridLayer, "self_attn": Attention, "linear_attn": LinearAttention, "mlp": Mlp,
                "shared_experts": SharedExpert},
        gated_head_outputs=QWEN3_NEXT_GATED_HEAD_OUTPUTS),
    "gpt2": FamilySpec(
        rename={"transformer.h": "layers", "transformer.wte": "embed_tokens", "transformer.ln_f": "norm",
                "attn": "self_attn", "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"},
        envoys={"layers.*": Layer, "self_attn": Attention, "mlp": Mlp}, learned_positions=True),
    "gptj": FamilySpec(
        rename={"transformer.h": "layers", "transformer.wte": "embed_tokens", "transformer.ln_f": "norm",
                "attn": "self_attn", "ln_1": "input_layernorm"},
        envoys={"layers.*": SharedNormParallelLayer, "self_attn": Attention, "mlp": Mlp}),
    "gpt_neox": FamilySpec(rename=GPT_NEOX_NAMES,
                           envoys={"layers.*": ConfigParallelLayer, "self_attn": Attention, "mlp": Mlp}),
    "opt": FamilySpec(
        rename={"model.decoder.layers": "layers", "model.decoder.embed_tokens": "embed_tokens",
                "model.decoder.final_layer_norm": "norm", "self_attn_layer_norm": "input_layernorm",
                "final_layer_norm": "post_attention_layernorm", "fc2": "mlp"},
        envoys={"layers.*": OPTLayer, "self_attn": Attention, "mlp": Mlp}, learned_positions=True),
    "falcon": FamilySpec(
        rename={"transformer.h": "layers", "transformer.word_embeddings": "embed_tokens", "transformer.ln_f": "norm",
                "self_attention": "self_attn", "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"},
        envoys={"layers.*": FalconLayer, "self_attn": Attention, "mlp": Mlp}),
    # A state-space block, x + mixer(norm(x)); block keys first: "norm" must not bind on the root, where "norm" is
    # the final norm's alias.
    "mamba": FamilySpec(rename={"norm": "input_layernorm", "mixer": "linear_attn", "backbone.layers": "layers",
                                "backbone.embeddings": "embed_tokens", "backbone.norm_f": "norm"},
                        envoys={"layers.*": StateSpaceLayer, "linear_attn": LinearAttention}, unserved=HEADLESS),
}

__all__ = ["GPT_NEOX_NAMES", "LLAMA_NAMES", "NEUTRAL", "QWEN3_NEXT_GATED_HEAD_OUTPUTS"]
