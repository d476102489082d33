"""Phi-3 on vLLM (vllm.model_executor.models.phi3): `Phi3ForCausalLM` is vLLM's Llama, so Llama's family."""

from .llama import SPEC

__all__ = ["SPEC"]
