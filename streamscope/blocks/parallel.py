"""Parallel blocks: the attention and the MLP read the same stream and both add to it."""

from __future__ import annotations

from typing import Any, Optional

from .. import nnsight_seam as seam
from ..errors import PARALLEL
from ..values import OUTPUT, Residual, StreamValue
from .envoy import module_config
from .layer import Layer

#: The config flags by which a family says its blocks are parallel: GPT-NeoX's, then Falcon's two.
PARALLEL_FLAGS = ("use_parallel_residual", "parallel_attn", "new_decoder_architecture")


def parallel_by_config(config: Any) -> bool:
    """Whether `config` says its blocks are parallel, ``x + attn(norm1(x)) + mlp(norm2(x))`` (one of `PARALLEL_FLAGS`)."""
    return any(getattr(config, flag, False) for flag in PARALLEL_FLAGS)


class ParallelLayer(Layer):
    """``x + attn(norm1(x)) + mlp(norm2(x))`` (GPT-NeoX, Falcon's new layout): no stream between the sublayers."""

    UNSERVED = {"layer_mid": PARALLEL}


class SharedNormParallelLayer(ParallelLayer):
    """``x + attn(norm(x)) + mlp(norm(x))`` (GPT-J, Cohere): one norm feeds both sublayers."""

    @StreamValue("input_layernorm", OUTPUT)
    def mlp_norm_output(self) -> Residual:
        """The MLP's pre-norm output, the block's one norm: the same tensor as attention_norm_output."""


class ConfigParallelLayer(Layer):
    """A pre-norm block that is parallel where its config says so (`parallel_by_config`), else sequential (GPT-NeoX)."""

    def parallel(self) -> bool:
        """Whether this block is parallel: no stream between its sublayers."""
        return parallel_by_config(module_config(self))

    def reason(self, name: str) -> Optional[str]:
        if name == "layer_mid" and self.parallel():
            return PARALLEL
        return super().reason(name)


class FalconLayer(ConfigParallelLayer):
    """Falcon's three layouts: parallel with a norm per sublayer (``ln_attn``, ``ln_mlp``: the new layout), parallel
    with one norm for both (``num_ln_in_parallel_attn=1``, or the old ``parallel_attn``), or sequential pre-norm.

    transformers' block returns a tuple, the stream first.
    """

    RETURNS_TUPLE = True

    def relocated(self) -> dict:
        if self.parallel() and not hasattr(seam.module_of(self), "ln_mlp"):
            # One norm feeds both sublayers.
            return {"mlp_norm_output": ("input_layernorm", OUTPUT)}
        return {}
