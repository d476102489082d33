"""GPT-J: a parallel block with one norm, ``x + attn(ln_1(x)) + mlp(ln_1(x))``; the block returns a tuple.

Its attention has its own eager kernel, ``self._attn(query, key, value, attention_mask)``,
whatever the attention implementation: its pattern is the kernel's own weights.
"""

from ... import nnsight_seam as seam
from ...attention import Spec
from ...blocks import SharedNormParallelLayer
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import OUTPUT
from ..attention import KernelAttention


class GPTJLayer(SharedNormParallelLayer):
    """GPT-J's block as transformers writes it: it returns a tuple (vLLM's returns the stream as a tensor)."""

    RETURNS_TUPLE = True


class GPTJAttention(KernelAttention):
    """GPT-J's attention: interleaved rotary on the first rotary_dim channels, then its own eager `_attn`.

    The queries and keys are served as `_attn` receives them, after the
    rotary, in transformers' (interleaved) channel order; the kernel returns
    [batch, heads, seq, head_dim], served per position as head_outputs.
    """

    KERNEL = "self__attn_0"
    ARGUMENTS = {"queries": (0, "query"), "keys": (1, "key"), "values": (2, "value"), "mask": (3, "attention_mask")}
    OUTPUT_LAYOUT = "bhsd"
    # It rotates a slice of each head (rotary_dim): the whole heads before it are the split projections.
    ROTARY_SITES = {"queries_pre_rotary": ("self__split_heads_0", OUTPUT, None),
                    "keys_pre_rotary": ("self__split_heads_1", OUTPUT, None)}
    ROTARY_LAYOUT = "bshd"

    def relocated(self) -> dict:
        return {"pattern": (None, OUTPUT)}  # always eager

    def spec(self, inputs: tuple) -> Spec:
        return Spec(scale=1.0 / float(seam.module_of(self).scale_attn))


SPEC = derive(NEUTRAL["gptj"], envoys={"layers.*": GPTJLayer, "self_attn": GPTJAttention})
