"""GPT-2 on vLLM (vllm.model_executor.models.gpt2): a whole-stream pre-norm block, ``forward(hidden_states)``.

The tree is transformers' (``transformer.h``, ``ln_1``, ``attn``, ``ln_2``,
``mlp``); the block takes the stream alone and returns it. The attention
is aliased by class: its kernel inside is also called ``attn``. vLLM's
GPT-2 has neither of transformers' attention variants below (it asserts so
while starting): a checkpoint that sets one is refused before the engine starts.
"""

from vllm.model_executor.models.gpt2 import GPT2Attention

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import WholeStream
from . import options_not_implemented

SPEC = derive(
    NEUTRAL["gpt2"], rename={"attn": None, GPT2Attention: "self_attn"},
    layout=WholeStream(stream=(0, "hidden_states")),
    cannot_run=options_not_implemented("GPT-2", {
        "scale_attn_by_inverse_layer_idx": "attention scores scaled down by the block's index",
        "reorder_and_upcast_attn": "attention computed in float32 in another order",
        "add_cross_attention": "cross-attention to an encoder"}),
)
