"""Mixtral on vLLM (vllm.model_executor.models.mixtral): Llama's fused block; the MoE is `block_sparse_moe`.

vLLM names every block's mixture of experts `block_sparse_moe` (transformers:
`mlp`), aliased to `mlp` here. Its routing runs inside vLLM's fused MoE kernel:
the routing values say so (`streamscope.vllm.moe`).
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import FUSED
from ..moe import VllmMlp

SPEC = derive(NEUTRAL["mixtral"], rename={"block_sparse_moe": "mlp"}, envoys={"mlp": VllmMlp}, layout=FUSED)
