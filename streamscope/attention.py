"""Attention scores and patterns recomputed from queries and keys, for kernels that fuse them (any engine).

Everything here works on plain tensors in transformers' layout, queries
``[batch, heads, q_seq, head_dim]`` and keys ``[batch, kv_heads, k_seq,
head_dim]``, with a `Spec` of the family's attention: its scale, logit soft
cap, sliding window, chunked local attention, ALiBi slopes. An engine builds
the `Spec` and the positions from what it knows; nothing here reads a model.

The mask is the one transformers' ``masking_utils`` builds: causal
(``k <= q``), a sliding window (``q - k < window``), chunks
(``k // chunk == q // chunk``), and an optional extra mask from the engine
(padding). Masked scores are ``-inf``, so masked pattern entries are exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Spec:
    """What a family's attention computes between queries and keys, beyond ``q @ k.T``.

    Attributes:
        scale: The factor on ``q @ k.T`` (``head_dim ** -0.5`` on most families;
            Gemma 2's ``query_pre_attn_scalar ** -0.5``, Granite's
            ``attention_multiplier``, 1 where the queries come scaled: OPT).
        softcap: ``softcap * tanh(scores / softcap)`` after scaling (Gemma 2), or None.
        sliding_window: A query sees the keys less than this many positions
            back, itself included (Mistral, Gemma 2 and 3's sliding layers), or None.
        chunk_size: A query sees only the keys of its own chunk of this many
            positions (Llama 4's chunked layers), or None.
        alibi_slopes: ``[heads]``, adding ``slope * (k - q)`` to the scaled scores, or None.
        causal: Whether a query sees only the keys at or before its position.
    """

    scale: float
    softcap: Optional[float] = None
    sliding_window: Optional[int] = None
    chunk_size: Optional[int] = None
    alibi_slopes: Optional[torch.Tensor] = None
    causal: bool = True


def positions(queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of the queries and keys of one call: the queries are the last ``q_seq`` of ``k_seq``."""
    q_len, k_len = queries.shape[-2], keys.shape[-2]
    key_positions = torch.arange(k_len, device=keys.device)
    return key_positions[k_len - q_len:], key_positions


def allowed(spec: Spec, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Which keys each query sees, ``[q_seq, k_seq]`` (or with the positions' leading dimensions), as booleans."""
    q = query_positions.unsqueeze(-1)
    k = key_positions.unsqueeze(-2)
    seen = torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool, device=q.device)
    if spec.causal:
        seen &= k <= q
    if spec.sliding_window is not None:
        seen &= q - k < spec.sliding_window
    if spec.chunk_size is not None:
        seen &= torch.div(k, spec.chunk_size, rounding_mode="floor") == torch.div(
            q, spec.chunk_size, rounding_mode="floor")
    return seen


def repeat_kv(keys: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, kv_heads, seq, dim]`` with each key head repeated for its group of query heads (GQA)."""
    kv_heads = keys.shape[1]
    if kv_heads == heads:
        return keys
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key heads evenly")
    return keys.repeat_interleave(heads // kv_heads, dim=1)


def scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    spec: Spec,
    query_positions: Optional[torch.Tensor] = None,
    key_positions: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The attention logits, ``[batch, heads, q_seq, k_seq]``, in float32; ``-inf`` where a query does not see a key.

    ``q @ k.T * scale``, soft-capped, plus ALiBi, masked. `mask` is an extra
    boolean mask broadcastable to the result (True: seen), such as padding.
    """
    if query_positions is None or key_positions is None:
        query_positions, key_positions = positions(queries, keys)
    q = queries.float()
    k = repeat_kv(keys.float(), q.shape[1])
    logits = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    if spec.softcap is not None:
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    if spec.alibi_slopes is not None:
        distance = (key_positions.unsqueeze(-2) - query_positions.unsqueeze(-1)).float()
        logits = logits + spec.alibi_slopes.float().view(-1, 1, 1).to(logits.device) * distance
    seen = allowed(spec, query_positions.to(logits.device), key_positions.to(logits.device))
    if seen.dim() == 3:  # per-batch positions
        seen = seen.unsqueeze(1)
    if mask is not None:
        seen = seen & mask.to(torch.bool)
    return logits.masked_fill(~seen, float("-inf"))


def pattern(logits: torch.Tensor) -> torch.Tensor:
    """The softmax of `scores` over keys, ``[batch, heads, q_seq, k_seq]``: masked entries exactly 0, rows sum to 1.

    A query that sees no key at all (a padding row) gets a row of zeros.
    """
    empty = torch.isinf(logits).all(dim=-1, keepdim=True) & (logits < 0).all(dim=-1, keepdim=True)
    weights = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1)
    return weights.masked_fill(empty, 0.0)


def additive_mask_to_bool(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A kernel's attention mask as booleans (True: seen): boolean masks as they are, additive ones where > dtype min / 2."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return None
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2
