"""Llama 4 (text): Llama's pre-norm block; the feed-forward is `feed_forward`, aliased to `mlp`.

Every `interleave_moe_layer_step`-th block's feed-forward is a mixture of
experts (routed experts plus a shared expert) that works on flattened tokens,
the others a dense MLP. The mixture's router (`router`) returns its scores
and logits: router_logits is served from it (an edit re-routes), the chosen
experts and their weights recomputed from the logits as the router does
(`Llama4Mlp`). The shared expert (`shared_expert`, aliased to
`shared_experts`) is a dense MLP, an `Mlp` too (`SharedExpert`): its
mlp_output is what it adds, unscaled, besides the routed experts.
"""

from dataclasses import replace

from ... import nnsight_seam as seam
from ...attention import Spec
from ...blocks import Layer
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import INPUT
from ..attention import KernelAttention
from ..moe import Llama4Mlp


class Llama4Layer(Layer):
    """Llama 4's block as transformers writes it: its MoE works on flattened tokens (vLLM's tokens are flat)."""

    FLATTENS_TOKENS = True


class Llama4Attention(KernelAttention):
    """iRoPE attention: a rotary block (``no_rope_layers[i] == 1``) rotates, L2-norms its queries and keys and
    attends within chunks of ``attention_chunk_size``; a NoPE block does neither, attends over the whole prefix,
    and scales its queries by the temperature tuning (served in the queries: the kernel receives them scaled).
    The pre-rotary queries and keys are the complex rotary's inputs, [batch, seq, heads, head_dim], before the
    L2 norm (which follows the rotary here)."""

    ROTARY_SITES = {"queries_pre_rotary": ("apply_rotary_emb_0", INPUT, (0, "xq")),
                    "keys_pre_rotary": ("apply_rotary_emb_0", INPUT, (1, "xk"))}
    ROTARY_LAYOUT = "bshd"

    def spec(self, inputs: tuple) -> Spec:
        spec = super().spec(inputs)
        config = seam.module_of(self).config
        types = getattr(config, "layer_types", None)
        if types is not None and types[seam.module_of(self).layer_idx] == "chunked_attention":
            return replace(spec, chunk_size=config.attention_chunk_size)
        return spec


SPEC = derive(NEUTRAL["llama4_text"], envoys={"layers.*": Llama4Layer, "self_attn": Llama4Attention, "mlp": Llama4Mlp})
