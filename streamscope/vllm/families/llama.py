"""Llama on vLLM (vllm.model_executor.models.llama): the fused block every fused family shares."""

from ...blocks import Mlp
from ...families import FamilySpec
from ...families.renames import LLAMA
from ..attention import VllmAttention
from ..blocks import FusedLayer

SPEC = FamilySpec(rename=LLAMA, envoys={"layers.*": FusedLayer, "self_attn": VllmAttention, "mlp": Mlp})
