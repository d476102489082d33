"""Mamba on vLLM (vllm.model_executor.models.mamba): a fused state-space block, ``x + mixer(norm(x))``.

vLLM has no selective-scan kernel on CPU, so this module is written from
vLLM's source for GPU vLLM and runs there (the GPU suite); on a CPU the
engine and the server refuse the family before starting
(`streamscope.vllm.model.refuse_on_the_cpu_build`).

The tree is transformers' (``backbone.layers``, ``norm``, ``mixer``). The
block is fused: ``forward(positions=, hidden_states=, residual=)`` returns
``(output, residual)``, the mixer's contribution and the stream before it, so
the stream is their sum (block 0 gets residual None). The mixer returns
nothing: it is called ``mixer(hidden_states, output)`` and writes its
contribution into ``output``, the first half the block returns, which is
where attention_output is served.
"""

from ...blocks import LinearAttention
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import OUTPUT, StreamValue
from ..blocks import FUSED


class BlockOutputHalf(StreamValue):
    """The first half of what the sublayer's block returns: Mamba's mixer writes its output there."""

    def located(self, host):
        super().located(host)  # the reasons, as for any value
        return host.block()


class MambaMixer(LinearAttention):
    """Mamba's mixer: its contribution is the block's first returned half (the mixer itself returns None)."""

    attention_output = BlockOutputHalf(
        None, OUTPUT, description="What the mixer adds to the residual stream, [1, tokens, hidden_size]")


SPEC = derive(NEUTRAL["mamba"], envoys={"linear_attn": MambaMixer}, layout=FUSED)
