"""Llama on vLLM (vllm.model_executor.models.llama): the fused block every fused family shares."""

from ..blocks import Attention, FusedLayer, Mlp

RENAME = {"model.embed_tokens": "embed_tokens", "model.layers": "layers", "model.norm": "norm"}
ENVOYS = {"layers.*": FusedLayer, "self_attn": Attention, "mlp": Mlp}
