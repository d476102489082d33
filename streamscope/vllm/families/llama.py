"""Llama on vLLM (vllm.model_executor.models.llama): the fused block every fused family shares."""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import FUSED

SPEC = derive(NEUTRAL["llama"], layout=FUSED)
