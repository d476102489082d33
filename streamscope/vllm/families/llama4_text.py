"""Llama 4, text (Llama4ForCausalLM) on vLLM (vllm.model_executor.models.llama4): Llama's fused block.

The feed-forward is `feed_forward`, aliased to `mlp` as on transformers: a
dense MLP on some blocks, on every `interleave_moe_layer_step`-th a mixture of
experts (`Llama4MoE`) whose output, the shared expert's plus the routed
experts', is what the block adds; the routing runs inside vLLM's fused MoE
kernel, and the routing values say so. The shared expert (`shared_expert`,
aliased to `shared_experts`) is the dense MLP's class, an `Mlp` too; vLLM's
fused MoE layer calls it and adds its output, so its mlp_output is
unavailable (`streamscope.vllm.moe`). vLLM's blocks take and return
``[tokens, hidden]``, so nothing needs the stream's shape (transformers'
`Llama4Layer` flattens tokens for its MoE).

One difference from transformers is in vLLM's model, not here: vLLM applies
the NoPE blocks' attention temperature tuning only when the generation config
says ``attn_temperature_tuning`` or ``max_model_len`` exceeds 32K, whatever the
model config says (pass ``override_generation_config={"attn_temperature_tuning":
True}`` to match transformers on long prompts). The tuning scales queries by
``log(floor((position + 1) / floor_scale) + 1) * attn_scale + 1``, which is 1 for
the first ``floor_scale - 1`` positions (8191 by default), so prompts shorter
than that agree either way.

vLLM cuts each attention chunk (``attention_chunk_size``) into whole KV blocks:
on the CPU, whose default block (128 tokens) does not divide every chunk, the
engine takes blocks that do (`blocks_within_chunks`); a chunk shorter than the
smallest block is refused before the engine starts (`cannot_run`). vLLM
cannot capture chunked attention in a CUDA graph, so a tapped engine of a
checkpoint with chunks records none and runs eagerly (it warns when it loads).
"""

import math
from typing import Any, Mapping, Optional

from vllm.platforms import current_platform

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..attention import VllmAttention
from ..blocks import FUSED
from ..moe import VllmMlp, VllmSharedExpert


class VllmLlama4Attention(VllmAttention):
    """iRoPE attention on vLLM. A rotary block (``no_rope_layers[i] == 1``) rotates, L2-norms its queries and
    keys and attends within chunks (vLLM's `ChunkedLocalAttention`, whose chunk size the recomputed scores
    take); a NoPE block does neither and attends over the whole prefix. On every block vLLM permuted each
    head's q and k channels at load (the even channels, then the odd ones): queries and keys are served in
    transformers' order and edits go back in vLLM's (`streamscope.vllm.attention.pairs_first`)."""

    CHANNELS_PERMUTED = True


#: The CPU attention backend's default KV block, in tokens.
CPU_BLOCK = 128


def smallest_block() -> int:
    """The fewest tokens a KV block of this platform's attention backends holds (the CPU's: multiples of 32)."""
    return 32 if current_platform.is_cpu() else 16


def cannot_run(config: Any) -> Optional[str]:
    """Why vLLM cannot run this checkpoint: attention chunks that are not whole KV blocks (vLLM's chunked local
    attention cuts each chunk into whole blocks)."""
    chunk, block = getattr(config, "attention_chunk_size", None), smallest_block()
    if chunk and chunk % block:
        return (f"this Llama 4 checkpoint attends within chunks of {chunk} tokens (attention_chunk_size), and vLLM's "
                f"chunked attention needs each chunk to be whole KV blocks, of {block} tokens at least here (it "
                f"would fail at the first step). Load it with engine='transformers'.")
    return None


def blocks_within_chunks(config: Any, asked: Mapping[str, Any]) -> dict[str, Any]:
    """A KV block size that divides the attention chunk, on the CPU, whose default block does not divide every chunk
    (a GPU's default of 16 divides every chunk `cannot_run` lets through), unless the caller chose one."""
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk or "block_size" in asked or not current_platform.is_cpu() or chunk % CPU_BLOCK == 0:
        return {}
    return {"block_size": math.gcd(chunk, CPU_BLOCK)}


SPEC = derive(NEUTRAL["llama4_text"],
              envoys={"self_attn": VllmLlama4Attention, "mlp": VllmMlp, "shared_experts": VllmSharedExpert},
              layout=FUSED, cannot_run=cannot_run, checkpoint_defaults=blocks_within_chunks)
