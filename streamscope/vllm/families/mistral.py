"""Mistral on vLLM (vllm.model_executor.models.mistral): Llama's names and Llama's fused block."""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import FUSED

SPEC = derive(NEUTRAL["mistral"], layout=FUSED)
