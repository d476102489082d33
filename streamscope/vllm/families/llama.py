"""Llama on vLLM (vllm.model_executor.models.llama): the fused block every fused family shares."""

from ...blocks import Mlp
from ...families.renames import LLAMA as RENAME
from ..attention import VllmAttention
from ..blocks import FusedLayer

ENVOYS = {"layers.*": FusedLayer, "self_attn": VllmAttention, "mlp": Mlp}
