"""GPT-J on vLLM (vllm.model_executor.models.gpt_j): a parallel block with one norm, ``forward(position_ids, hidden_states)``.

``x + attn(ln_1(x)) + mlp(ln_1(x))``; the block returns the stream as a
tensor (transformers' returns a tuple). The attention is aliased by class:
its kernel inside is also called ``attn``. vLLM's GPT-J asserts an untied
unembedding: a tied checkpoint is refused before the engine starts.
"""

from vllm.model_executor.models.gpt_j import GPTJAttention

from ...blocks import Attention, Mlp, SharedNormParallelLayer
from ...families import FamilySpec
from ..blocks import WholeStream
from . import options_not_implemented

SPEC = FamilySpec(
    rename={"transformer.h": "layers", "transformer.wte": "embed_tokens", "transformer.ln_f": "norm",
            GPTJAttention: "self_attn", "ln_1": "input_layernorm"},
    envoys={"layers.*": SharedNormParallelLayer, "self_attn": Attention, "mlp": Mlp},
    layout=WholeStream(),  # the stream after the positions, returned as a tensor
    cannot_run=options_not_implemented("GPT-J", {"tie_word_embeddings": "an unembedding tied to the embeddings"}),
)
