"""The engine's unembedding and logits, computed on a vLLM model's own modules (in the worker, or on its tree)."""

from __future__ import annotations

import torch


def engine_logits(module: torch.nn.Module, normed: torch.Tensor) -> torch.Tensor:
    """Logits of final-norm outputs ``[..., hidden]`` as the engine computes them, ``[..., vocab_size]``: its own
    unembedding, with the bias the model's compute_logits passes (GPT-J's and the Transformers backend's heads
    have one), then its soft cap and scale. Run in the worker, on the engine's modules."""
    processor = module.logits_processor
    head = unembedding(module)
    logits = processor._get_logits(normed, head, getattr(head, "bias", None))
    if processor.soft_cap is not None:
        logits = torch.tanh(logits / processor.soft_cap) * processor.soft_cap
    if processor.scale != 1.0:
        logits = logits * processor.scale
    return logits


def unembedding(module: torch.nn.Module) -> torch.nn.Module:
    """The engine's unembedding: ``lm_head`` (GPT-NeoX: ``embed_out``), or the tied embeddings where vLLM keeps no head."""
    for name in ("lm_head", "embed_out"):
        if isinstance(getattr(module, name, None), torch.nn.Module):
            return getattr(module, name)
    return module.model.embed_tokens
