"""OPT: Llama's pre-norm block with LayerNorms (``self_attn_layer_norm``, ``final_layer_norm``) and no MLP module.

The MLP half runs ``fc2(act(fc1(.)))`` on the stream flattened to
``[batch*seq, hidden]``: `fc2` is served as `mlp`, fc1's input is mlp_input,
and every value there is served as ``[batch, seq, hidden]``. With
``do_layer_norm_before=False`` (OPT-350m) a norm follows each residual add
(`streamscope.blocks.post_norm.OPTLayer`).
"""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["opt"]
