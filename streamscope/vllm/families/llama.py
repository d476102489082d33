"""Llama on vLLM (vllm.model_executor.models.llama): the fused block every fused family shares."""

from ...blocks import Attention, Layer, Mlp
from ...families import FamilySpec
from ...families.renames import LLAMA
from ..blocks import FUSED

SPEC = FamilySpec(rename=LLAMA, envoys={"layers.*": Layer, "self_attn": Attention, "mlp": Mlp}, layout=FUSED)
