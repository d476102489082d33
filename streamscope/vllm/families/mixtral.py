"""Mixtral on vLLM (vllm.model_executor.models.mixtral): Llama's fused block; the MoE is `block_sparse_moe`.

vLLM names every block's mixture of experts `block_sparse_moe` (transformers:
`mlp`), aliased to `mlp` here. Its routing runs inside vLLM's fused MoE kernel:
the routing values say so (`streamscope.vllm.moe`).
"""

from ..moe import VllmMlp
from .llama import ENVOYS as LLAMA_ENVOYS, RENAME as LLAMA_RENAME

RENAME = {**LLAMA_RENAME, "block_sparse_moe": "mlp"}
ENVOYS = {**LLAMA_ENVOYS, "mlp": VllmMlp}

__all__ = ["ENVOYS", "RENAME"]
