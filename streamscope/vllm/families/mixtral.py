"""Mixtral on vLLM (vllm.model_executor.models.mixtral): Llama's fused block; the MoE is `block_sparse_moe`.

vLLM names every block's mixture of experts `block_sparse_moe` (transformers:
`mlp`), aliased to `mlp` here. Its routing runs inside vLLM's fused MoE kernel:
the routing values say so (`streamscope.vllm.moe`).
"""

from dataclasses import replace

from ..moe import VllmMlp
from . import llama

SPEC = replace(llama.SPEC, rename={**llama.SPEC.rename, "block_sparse_moe": "mlp"},
               envoys={**llama.SPEC.envoys, "mlp": VllmMlp})
