"""GPT-NeoX (Pythia) on vLLM: no native class, so vLLM's Transformers backend runs transformers' own modules.

The tree is transformers' block under vLLM's root: ``model`` is the
``GPTNeoXModel`` (``model.layers``, ``model.embed_in``,
``model.final_layer_norm``) and ``lm_head`` sits on the root. Values are
``[1, tokens, hidden]`` already. The block is transformers' (see the
transformers family), with vLLM's per-request skip.
"""

from ...transformers.families.gpt_neox import GPTNeoXLayer as _TransformersGPTNeoXLayer
from ..blocks import Attention, Mlp, VllmSkip

RENAME = {
    "model.layers": "layers", "model.embed_in": "embed_tokens", "model.final_layer_norm": "norm",
    "attention": "self_attn",
}


class GPTNeoXLayer(VllmSkip, _TransformersGPTNeoXLayer):
    """Parallel or sequential, as the block's ``use_parallel_residual`` says."""


ENVOYS = {"layers.*": GPTNeoXLayer, "self_attn": Attention, "mlp": Mlp}
