"""Cohere (Command R) on vLLM (vllm.model_executor.models.commandr): a parallel block with one norm.

``forward(positions, hidden_states, residual)`` ignores the residual it is
given and returns ``(hidden_states, residual)``: the whole stream first, the
block's input second; the values read the first. Its norm returns
``(normed, residual)``. There is no ``lm_head``: the logits use embed_tokens.
"""

from dataclasses import replace

from ...blocks import SharedNormParallelLayer
from ...blocks import Mlp
from ..attention import VllmAttention
from ..blocks import VllmLayer
from . import llama


class CohereLayer(VllmLayer, SharedNormParallelLayer):
    """Cohere's block: one norm for both sublayers, the stream first in a tuple."""

    RETURNS_TUPLE = True


SPEC = replace(llama.SPEC, envoys={"layers.*": CohereLayer, "self_attn": VllmAttention, "mlp": Mlp})
