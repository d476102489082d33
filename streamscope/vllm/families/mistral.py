"""Mistral on vLLM (vllm.model_executor.models.mistral): Llama's names and Llama's fused block."""

from .llama import SPEC

__all__ = ["SPEC"]
