"""Gemma 3 (text) on vLLM (vllm.model_executor.models.gemma3): Gemma 2's fused sandwich-norm block."""

from .gemma2 import SPEC

__all__ = ["SPEC"]
