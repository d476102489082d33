"""Granite on vLLM (vllm.model_executor.models.granite): Llama's tree, a whole-stream block with multipliers.

``forward(positions, hidden_states)`` returns the stream; each sublayer's
output is scaled by ``residual_multiplier`` before its add (served scaled, as
on transformers). The model multiplies the embeddings by
``embedding_multiplier`` in place, after ``embed_tokens``, so token_embeddings
is read where the scaled embeddings are first called with: block 0's input norm.
"""

from ...transformers.families.granite import GraniteAttention, GraniteMlp
from ...values import INPUT
from ..blocks import Layer
from .llama import RENAME

ENVOYS = {"layers.*": Layer, "self_attn": GraniteAttention, "mlp": GraniteMlp}
ROOT_SITES = {"token_embeddings": ("layers.0.input_layernorm", INPUT)}

__all__ = ["ENVOYS", "RENAME", "ROOT_SITES"]
