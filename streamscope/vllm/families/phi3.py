"""Phi-3 on vLLM (vllm.model_executor.models.phi3): `Phi3ForCausalLM` is vLLM's Llama: Llama's names and Llama's fused block."""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import FUSED

SPEC = derive(NEUTRAL["phi3"], layout=FUSED)
