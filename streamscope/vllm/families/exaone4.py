"""EXAONE 4 on vLLM (vllm.model_executor.models.exaone4): a whole-stream post-norm block, no input norm.

``x + post_attention_layernorm(attn(x))`` then ``+ post_feedforward_layernorm(mlp(.))``;
``forward(positions, hidden_states, residual)`` ignores the residual and
returns ``(hidden_states, residual)``: the whole stream first, layer_mid
second; the values read the first.
"""

from dataclasses import replace

from ...blocks import PostNormedMlp, PostNormLayer
from ..attention import VllmPostNormedAttention
from ..blocks import VllmLayer
from . import llama


class Exaone4Layer(VllmLayer, PostNormLayer):
    """EXAONE 4's block: post-norm, the stream first in a tuple."""

    RETURNS_TUPLE = True


SPEC = replace(llama.SPEC, envoys={"layers.*": Exaone4Layer, "self_attn": VllmPostNormedAttention,
                                   "mlp": PostNormedMlp})
