"""Falcon on vLLM (vllm.model_executor.models.falcon): a whole-stream block, ``forward(positions, hidden_states)``.

The tree and the three layouts are transformers' (`streamscope.blocks.parallel.FalconLayer`);
the block returns the stream as a tensor. The attention and the MLP return
``(output, bias)`` and the block adds each bias itself (on a parallel layout
both after the MLP, for one all-reduce), so with ``bias=True`` (Falcon-RW)
neither sublayer's output is what it adds to the stream: the block serves
neither contribution there, and says why.

With ALiBi (Falcon-RW) on a GPU the engine runs vLLM's Triton attention kernel
unless the caller picks one (`alibi_kernel`).
"""

from collections.abc import Mapping
from typing import Any, Optional

from vllm.platforms import current_platform

from ...blocks.envoy import module_config
from ...blocks.parallel import FalconLayer
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import WholeStream


#: Why a Falcon block with biases serves no contribution on vLLM.
BIASES_ADDED_LATER = ("vLLM's Falcon block adds the attention's and the MLP's output biases itself, after the "
                      "sublayers return (bias=True), so neither sublayer's output is what it adds to the stream; "
                      "layer_mid and layer_output hold the stream with the biases. engine='transformers' serves both")


class BiasesAddedLaterLayer(FalconLayer):
    """One of Falcon's three layouts, where a block with biases adds them after its sublayers return (vLLM's)."""

    def reason(self, name: str) -> Optional[str]:
        if name in ("self_attn.attention_output", "mlp.mlp_output") and getattr(module_config(self), "bias", False):
            return BIASES_ADDED_LATER
        return super().reason(name)


def alibi_kernel(config: Any, asked: Mapping[str, Any]) -> dict[str, Any]:
    """The attention kernel for ALiBi on a GPU: Triton's, where the caller chose none.

    vLLM 0.22 on Hopper picks FlashAttention for 16-bit models; for ALiBi it runs
    FlashAttention 2 on metadata scheduled for version 3, and every forward fails
    ("FA2 does not support scheduler_metadata"). Float32 runs Triton's kernel already.
    """
    if not getattr(config, "alibi", False) or "attention_backend" in asked or "attention_config" in asked:
        return {}
    return {"attention_backend": "TRITON_ATTN"} if current_platform.is_cuda() else {}


SPEC = derive(NEUTRAL["falcon"], envoys={"layers.*": BiasesAddedLaterLayer},
              layout=WholeStream(),  # the stream after the positions, returned as a tensor
              checkpoint_defaults=alibi_kernel)
