"""GPT-J on vLLM (vllm.model_executor.models.gpt_j): a parallel block with one norm, ``forward(position_ids, hidden_states)``.

``x + attn(ln_1(x)) + mlp(ln_1(x))``; the block returns the stream as a
tensor (transformers' returns a tuple). The attention is aliased by class:
its kernel inside is also called ``attn``. vLLM's GPT-J asserts an untied
unembedding: a tied checkpoint is refused before the engine starts.
"""

from vllm.model_executor.models.gpt_j import GPTJAttention

from ...blocks import Mlp, SharedNormParallelLayer
from ...families import FamilySpec
from ..attention import VllmAttention
from ..blocks import VllmLayer
from . import options_not_implemented


class VllmGPTJLayer(VllmLayer, SharedNormParallelLayer):
    """GPT-J's block: the stream after the positions, one norm for both sublayers, no stream between them."""

    STREAM = (1, "hidden_states")


SPEC = FamilySpec(
    rename={"transformer.h": "layers", "transformer.wte": "embed_tokens", "transformer.ln_f": "norm",
            GPTJAttention: "self_attn", "ln_1": "input_layernorm"},
    envoys={"layers.*": VllmGPTJLayer, "self_attn": VllmAttention, "mlp": Mlp},
    cannot_run=options_not_implemented("GPT-J", {"tie_word_embeddings": "an unembedding tied to the embeddings"}),
)
