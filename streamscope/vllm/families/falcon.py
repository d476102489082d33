"""Falcon on vLLM (vllm.model_executor.models.falcon): a whole-stream block, ``forward(positions, hidden_states)``.

The tree and the three layouts are transformers' (`streamscope.blocks.parallel.FalconLayer`);
the block returns the stream as a tensor. The attention and the
MLP return ``(output, bias)``; the values read the output. With ``bias=True``
on a parallel layout vLLM adds both biases after the MLP (one all-reduce
for both sublayers), so there attention_output and mlp_output lack their
biases and the identity does not hold.
"""

from ...blocks import Mlp
from ...blocks.parallel import FalconLayer
from ...families import FamilySpec
from ...families.renames import FALCON
from ..attention import VllmAttention
from ..blocks import VllmLayer


class VllmFalconLayer(VllmLayer, FalconLayer):
    """One of Falcon's three layouts; the block returns a tensor."""

    RETURNS_TUPLE = False


SPEC = FamilySpec(rename=FALCON, envoys={"layers.*": VllmFalconLayer, "self_attn": VllmAttention, "mlp": Mlp})
