"""Falcon: a parallel block, ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))`` (new layout) or with one norm shared
(``num_ln_in_parallel_attn=1``, or the old ``parallel_attn``), else the sequential pre-norm block; it returns a tuple."""

from typing import Optional

import torch

from ...attention import Spec
from ...blocks import Attention, Mlp
from ...blocks.envoy import module_config
from ...blocks.heads import INTERNALS
from ...blocks.parallel import FalconLayer
from ...families import FamilySpec
from ...families.renames import FALCON

FALCON_EAGER = ("Falcon's eager path computes its attention inline, with no kernel call to read; load the model "
                "with attn_implementation='sdpa' (the default), and read without output_attentions")
FALCON_ALIBI = "Falcon with ALiBi (alibi=True) is not served: its kernel takes ALiBi inside the mask"


class FalconAttention(Attention):
    """Falcon's attention with rotary (no ALiBi) on sdpa: the kernel is ``F.scaled_dot_product_attention``.

    The new architecture repeats each key and value head for its group of
    query heads before the kernel; keys and values are served once per key
    head, [batch, kv_heads, seq, head_dim], and an edit goes to every copy.
    The kernel returns [batch, heads, seq, head_dim], served per position.
    """

    KERNEL = "torch_nn_functional_scaled_dot_product_attention_0"
    ARGUMENTS = {"queries": (0, "query"), "keys": (1, "key"), "values": (2, "value"), "mask": (3, "attn_mask")}
    OUTPUT_LAYOUT = "bhsd"

    def reason(self, name: str) -> Optional[str]:
        if name in INTERNALS:
            config = module_config(self)
            if config.alibi:
                return FALCON_ALIBI
            if config._attn_implementation != "sdpa":
                return FALCON_EAGER
        return super().reason(name)

    def _group(self, heads: int) -> int:
        config = module_config(self)
        return heads // config.num_kv_heads if config.new_decoder_architecture else 1

    def internals_to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if name in ("keys", "values"):
            return tensor[:, ::self._group(tensor.shape[1])]
        return super().internals_to_user(tensor, name)

    def internals_to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        if name in ("keys", "values"):
            return value.repeat_interleave(self._group(live.shape[1]), dim=1)
        return super().internals_to_engine(value, live, name)

    def spec(self, inputs: tuple) -> Spec:
        return Spec(scale=self._module.head_dim ** -0.5)


SPEC = FamilySpec(rename=FALCON, envoys={"layers.*": FalconLayer, "self_attn": FalconAttention, "mlp": Mlp})
