"""Qwen2 on vLLM (vllm.model_executor.models.qwen2): Llama's names and Llama's fused block."""

from .llama import SPEC

__all__ = ["SPEC"]
