"""Falcon: a parallel block, ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))`` (new layout) or with one norm shared
(``num_ln_in_parallel_attn=1``, or the old ``parallel_attn``), else the sequential pre-norm block; it returns a tuple."""

from typing import Optional

import torch

from ... import nnsight_seam as seam
from ...attention import Spec
from ...blocks.envoy import module_config
from ...blocks.heads import INTERNALS
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import argument
from ..attention import KernelAttention

FALCON_EAGER = ("Falcon's eager path computes its attention inline, with no kernel call to read; load the model "
                "with attn_implementation='sdpa' (the default), and read without output_attentions")


class FalconAttention(KernelAttention):
    """Falcon's attention on sdpa: the kernel is ``F.scaled_dot_product_attention``.

    The new architecture repeats each key and value head for its group of
    query heads before the kernel; keys and values are served once per key
    head, [batch, kv_heads, seq, head_dim], and an edit goes to every copy (so do the keys before the rotary,
    which the forward broadcasts per query head already).
    The kernel returns [batch, heads, seq, head_dim], served per position.
    With ALiBi (Falcon-RW) the model folds the bias into the additive mask the
    kernel takes, per head (slope * key position / sqrt(head_dim)), and the
    scores add it from there.
    """

    KERNEL = "torch_nn_functional_scaled_dot_product_attention_0"
    #: The forward's second sdpa call: the branch it takes with ALiBi.
    ALIBI_KERNEL = "torch_nn_functional_scaled_dot_product_attention_1"
    ARGUMENTS = {"queries": (0, "query"), "keys": (1, "key"), "values": (2, "value"), "mask": (3, "attn_mask")}
    OUTPUT_LAYOUT = "bhsd"
    #: What the new architecture holds once per query head (its rotary gets the keys broadcast so already).
    PER_QUERY_HEAD = ("keys", "values", "keys_pre_rotary")

    def reason(self, name: str) -> Optional[str]:
        if name in INTERNALS and module_config(self)._attn_implementation != "sdpa":
            return FALCON_EAGER
        return super().reason(name)

    def _group(self, heads: int) -> int:
        config = module_config(self)
        return heads // config.num_kv_heads if config.new_decoder_architecture else 1

    def internals_to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if name in self.PER_QUERY_HEAD:
            return tensor[:, ::self._group(tensor.shape[1])]
        return super().internals_to_user(tensor, name)

    def internals_to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        if name in self.PER_QUERY_HEAD:
            return value.repeat_interleave(self._group(live.shape[1]), dim=1)
        return super().internals_to_engine(value, live, name)

    def kernel(self) -> str:
        return self.ALIBI_KERNEL if module_config(self).alibi else self.KERNEL

    def spec(self, inputs: tuple) -> Spec:
        return Spec(scale=seam.module_of(self).head_dim ** -0.5)

    def recompute_scores(self, inputs: tuple) -> torch.Tensor:
        scores = super().recompute_scores(inputs)
        if not module_config(self).alibi:
            return scores
        mask = argument(inputs, *self.ARGUMENTS["mask"])[..., -scores.shape[-2]:, :scores.shape[-1]]
        return scores + mask.float()  # -inf stays -inf where masked; ALiBi where seen


SPEC = derive(NEUTRAL["falcon"], envoys={"self_attn": FalconAttention})
