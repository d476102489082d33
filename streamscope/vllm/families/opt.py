"""OPT on vLLM (vllm.model_executor.models.opt): a whole-stream block, ``forward(hidden_states)``.

The tree and both layouts (pre-norm, and post-LN with ``do_layer_norm_before=False``)
are transformers' (`streamscope.blocks.post_norm.OPTLayer`): the MLP is ``fc1``/``fc2`` on
the block itself, fc2 served as `mlp`. vLLM's tokens are flat already, so
nothing is reshaped. fc2 is one of vLLM's parallel linears, whose class key
in ``envoys=`` would win over the ``mlp`` alias: `RowParallel` picks the MLP
envoy for it by path.

`prompt_logits` unembed the model's output (the decoder's, every position),
what the unembedding reads in every layout: a post-LN decoder (OPT-350m) has
no final norm, and projects its last block's output down to the embedding
width (``project_out``) first.
"""

from vllm.model_executor.layers.linear import RowParallelLinear

from ...blocks import Mlp
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...nnsight_seam import ParallelEnvoy
from ...values import INPUT, OUTPUT
from ..attention import Flat, PreRotary, Projected, VllmAttention
from ..blocks import WholeStream


def _query_scale(host) -> float:
    return host.kernel_layer().impl.scale


class OPTAttention(VllmAttention):
    """OPT's attention: transformers scales the queries by head_dim ** -0.5 before its kernel (and attends with
    scale 1), vLLM's layer scales inside; the queries are served scaled, as transformers serves them, and an
    edit is unscaled on its way back."""

    QUERIES_SCALED = True
    queries = Flat(INPUT, argument=(0, "query"), shape="[1, heads, tokens, head_dim]",
                   factor=_query_scale,
                   description="The queries vLLM's attention layer receives, scaled as transformers scales them, "
                               "[1, heads, tokens, head_dim]")
    # OPT rotates nothing: its pre-rotary queries are the layer's, served scaled as those are.
    queries_pre_rotary = PreRotary(shape="[1, heads, tokens, head_dim]", factor=_query_scale,
                                   description="The queries before any rotary (OPT has none): the queries, scaled "
                                               "as transformers scales them, [1, heads, tokens, head_dim]")
    queries_projected = Projected(shape="[1, heads, tokens, head_dim]", factor=_query_scale,
                                  description="The query projection (OPT has no query norm or rotary): the queries, "
                                              "scaled as transformers scales them, [1, heads, tokens, head_dim]")


class OPTMlp(Mlp, ParallelEnvoy):
    """fc2, served as the block's MLP: its output (the first of ``(output, bias)``) is mlp_output."""


class RowParallel:
    """The ``envoys=`` entry for vLLM's RowParallelLinear: `OPTMlp` on a block's fc2, else nnsight's ParallelEnvoy."""

    def __new__(cls, module, *args, path: str = "model", **kwargs):
        kind = OPTMlp if path.endswith(".fc2") else ParallelEnvoy
        return kind(module, *args, path=path, **kwargs)


# fc2's class key replaces the `mlp` path: `RowParallel` picks the MLP envoy for it.
SPEC = derive(NEUTRAL["opt"], envoys={"self_attn": OPTAttention, "mlp": None, RowParallelLinear: RowParallel},
              layout=WholeStream(stream=(0, "hidden_states")),  # the stream alone, its tokens flat already
              root_sites={"prompt_logits": (None, OUTPUT)})
