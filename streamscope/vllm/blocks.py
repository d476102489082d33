"""VllmLayer and FusedLayer: a vLLM decoder block, called with the residual stream or with its two halves.

vLLM runs every request of a step as one flat ``[tokens, hidden]`` batch and
nnsight hands each invoke its own rows; the values serve them as
``[1, tokens, hidden]``. Block 0 of a fused family is called with residual
None and the embeddings as hidden_states. The sublayers are `streamscope.blocks`'
own (they take and return whole tensors on vLLM as on transformers), but for
the attention, whose internals are read at vLLM's attention layer
(`streamscope.vllm.attention.VllmAttention`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch

from .. import blocks
from ..values import INPUT, OUTPUT, Host, Residual, StreamValue, argument


class Summed(StreamValue):
    """The stream at a call that takes or returns it in two halves, hidden + residual, [1, tokens, hidden_size].

    A fused block hands its stream on as ``(hidden_states, residual)`` and the
    next norm adds the two (in place, on GPU): the stream is their sum,
    computed for the read, so it is nobody's buffer. An edit goes back as a
    change to the hidden half, and a read that edits nothing writes nothing. A
    call without the residual (block 0's input) is its stream alone.

    Args:
        hidden, residual: Where the halves sit in an input call, as
            ``(index, name)``; an output is the pair ``(hidden, residual)``.
    """

    def __init__(self, module: Optional[str], where: str, *, hidden: tuple[int, str] = (0, "x"),
                 residual: tuple[int, str] = (1, "residual"), description: Optional[str] = None) -> None:
        super().__init__(module, where, description=description)
        self.hidden, self.residual = hidden, residual

    def halves(self, raw: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.where == INPUT:
            return argument(raw, *self.hidden), argument(raw, *self.residual)
        if isinstance(raw, tuple):
            return raw[0], raw[1]
        return raw, None

    def live(self, host: Host, raw: Any) -> torch.Tensor:
        return self.halves(raw)[0]

    def _read(self, host: Host, raw: Any) -> torch.Tensor:
        hidden, residual = self.halves(raw)
        with torch.inference_mode(False):
            if residual is None:
                return host.to_user(hidden, self.name).clone()
            return host.to_user(hidden + residual, self.name)

    def edit_rows(self, raw: Any, rows: Any, operation: Any) -> bool:
        """Apply a bulk steer's `operation` to rows `rows` of the stream (a slice or a tensor of row indices),
        those rows only; False, doing nothing, where the halves are not the step's flattened tokens.

        The hidden half of each edited row takes ``edited - stream``, bit
        for bit the change the write-back of the whole batch (`write`) would
        make; an ablation or a clamp adds the same change in one kernel,
        rounded once (`Operation.add_change`). No other row is touched, and
        the whole batch is neither summed, copied nor written back.
        """
        hidden, residual = self.halves(raw)
        if hidden.dim() != 2 or (residual is not None and residual.shape != hidden.shape):
            return False
        stream = hidden[rows] if residual is None else hidden[rows] + residual[rows]
        with torch.no_grad():
            if isinstance(rows, slice):
                # An ablation or clamp adds its change in one kernel (rounded once); anything else adds
                # edited - stream, bit for bit the write-back's change.
                add_change = getattr(operation, "add_change", None)
                if add_change is not None and add_change(hidden[rows], stream):
                    return True
            edited = stream + operation.delta if getattr(operation, "adds_only", False) else operation(stream)
            change = edited.to(hidden.dtype) - stream
            if isinstance(rows, slice):
                hidden[rows].add_(change)
            else:
                hidden.index_add_(0, rows, change)
        return True

    def write(self, host: Host, raw: Any, value: torch.Tensor) -> None:
        hidden, residual = self.halves(raw)
        value = host.to_engine(value.to(hidden.dtype), hidden, self.name)
        with torch.no_grad():
            if residual is None:
                hidden.copy_(value)
            else:
                hidden.add_(value - (hidden + residual))


class VllmSkip:
    """skip on vLLM: the block's own rows of its output are replaced, other requests keep theirs.

    The engine runs every request of a step through the block in one batch,
    so the block does run; this request's rows of what it returns are then
    `hidden`. Other requests batched in the same step are untouched (nnsight's
    own skip would answer for all of them).
    """

    def skip(self, hidden: torch.Tensor) -> None:
        """Skip this block for this request, handing `hidden` ([1, tokens, hidden_size]) on as its layer_output."""
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(f"{self.where()}.skip takes a tensor [1, tokens, hidden_size], "
                             f"not a {type(hidden).__name__}.")
        # As on transformers, a skip waits for the block's call: once the block has run (a value of it, or
        # of a later block, was read), it is too late, and the run says so rather than overwrite that read.
        self.block_input(type(self).layer_input.location(self))  # Granite reads it at its first norm
        try:
            self.layer_output = hidden
        except ValueError as error:
            raise ValueError(f"{self.where()}.skip takes the block's layer_output: {error}") from None


class VllmLayer(VllmSkip, blocks.Layer):
    """A vLLM block that is called with the residual stream and returns it (GPT-2, GPT-J, OPT, Falcon, ...).

    Two things vary between the blocks that work this way, and a family states
    them: `STREAM`, where the stream sits in the block's call (GPT-2's block
    takes it alone, most take the positions first), and whether the block
    returns a tuple with the whole stream first (Cohere, Exaone4, StableLM),
    which the values read as its first element.
    """

    #: Where the stream sits in the block's call, (index, name).
    STREAM: ClassVar[tuple[int, str]] = (1, "hidden_states")

    @StreamValue(None, INPUT, argument="STREAM")
    def layer_input(self) -> Residual:
        """The residual stream entering this block, before any of its norms, [1, tokens, hidden_size]."""


class FusedLayer(VllmSkip, blocks.Layer):
    """A vLLM block with the residual add fused into the next norm (Llama, Qwen, Gemma, most families).

    It is called ``forward(positions, hidden_states, residual)`` and returns
    ``(hidden_states, residual)``: hidden_states is what the last sublayer
    produced and residual the stream before it, so the stream is their sum,
    entering and leaving. Its norms are called ``norm(x, residual)`` and return
    ``(normed(x + residual), x + residual)``.
    """

    layer_input = Summed(None, INPUT, hidden=(1, "hidden_states"), residual=(2, "residual"),
                         description="The residual stream entering this block: hidden_states + residual, "
                                     "[1, tokens, hidden_size]")
    layer_mid = Summed("post_attention_layernorm", INPUT,
                       description="The residual stream after the attention add: hidden_states + residual, "
                                   "[1, tokens, hidden_size]")
    layer_output = Summed(None, OUTPUT, description="The residual stream leaving this block: hidden_states + "
                                                    "residual, [1, tokens, hidden_size]")


class FusedSandwichLayer(FusedLayer):
    """A fused block with norms on both sides of each sublayer (Gemma 2 and 3): the MLP's pre-norm adds the halves."""

    layer_mid = Summed("pre_feedforward_layernorm", INPUT,
                       description="The residual stream after the attention add: hidden_states + residual, "
                                   "[1, tokens, hidden_size]")

    @StreamValue("pre_feedforward_layernorm", OUTPUT)
    def mlp_norm_output(self) -> Residual:
        """The MLP's pre-norm output, [1, tokens, hidden_size]."""

