"""Qwen3-MoE on vLLM (vllm.model_executor.models.qwen3_moe): Llama's names and Llama's fused block.

A block's `mlp` is a mixture of experts (`Qwen3MoeSparseMoeBlock`), or a dense
MLP on `mlp_only_layers`; the routing runs inside vLLM's fused MoE kernel, and the
routing values say so (`streamscope.vllm.moe`).
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import FUSED
from ..moe import VllmMlp

SPEC = derive(NEUTRAL["qwen3_moe"], envoys={"mlp": VllmMlp}, layout=FUSED)
