"""StableLM: Llama's tree and Llama's pre-norm block; its attention rotates the first rotary_ndims channels of each
head, sliced off the whole queries and keys (after the optional per-head layernorm) before the rotary call."""

from typing import Optional

from ... import nnsight_seam as seam
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import OUTPUT
from ..attention import KernelAttention


class StableLmAttention(KernelAttention):
    """The pre-rotary queries and keys are the whole heads the forward slices the rotated channels from: its
    assignment after the projections' reshape, or after the per-head layernorm where the config has one."""

    def rotary_sites(self) -> dict[str, tuple[str, str, Optional[tuple[int, str]]]]:
        normed = bool(getattr(seam.module_of(self), "qk_layernorm", False))
        step = 2 if normed else 1  # the forward's second assignment of each is the layernorm's
        return {"queries_pre_rotary": (f"query_states_{step}", OUTPUT, None),
                "keys_pre_rotary": (f"key_states_{step}", OUTPUT, None)}


SPEC = derive(NEUTRAL["stablelm"], envoys={"self_attn": StableLmAttention})
