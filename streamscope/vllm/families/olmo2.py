"""OLMo 2 on vLLM: no native class, so vLLM's Transformers backend runs transformers' own modules.

The tree is Llama's (``model.layers``, ``model.embed_tokens``, ``model.norm``,
``lm_head`` on the root) and the block transformers' post-norm block (see
the transformers family); values are ``[1, tokens, hidden]`` already.
"""

from ...blocks import PostNormLayer
from ..blocks import PostNormedAttention, PostNormedMlp, VllmSkip
from .llama import RENAME


class Olmo2Layer(VllmSkip, PostNormLayer):
    """OLMo 2's post-norm block, with vLLM's per-request skip."""


ENVOYS = {"layers.*": Olmo2Layer, "self_attn": PostNormedAttention, "mlp": PostNormedMlp}

__all__ = ["ENVOYS", "RENAME"]
