"""Qwen3 on vLLM (vllm.model_executor.models.qwen3): Llama's names and Llama's fused block."""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import FUSED

SPEC = derive(NEUTRAL["qwen3"], layout=FUSED)
