"""GPT-J on vLLM (vllm.model_executor.models.gpt_j): a parallel block with one norm, ``forward(position_ids, hidden_states)``.

``x + attn(ln_1(x)) + mlp(ln_1(x))``; the block returns the stream as a
tensor (transformers' returns a tuple). The attention is aliased by class:
its kernel inside is also called ``attn``. vLLM's GPT-J asserts an untied
unembedding: a tied checkpoint is refused before the engine starts.
"""

from vllm.model_executor.models.gpt_j import GPTJAttention

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import WholeStream
from . import options_not_implemented

SPEC = derive(
    NEUTRAL["gptj"], rename={"attn": None, GPTJAttention: "self_attn"},
    layout=WholeStream(),  # the stream after the positions, returned as a tensor
    cannot_run=options_not_implemented("GPT-J", {"tie_word_embeddings": "an unembedding tied to the embeddings"}),
)
