"""Cohere (Command R) on vLLM (vllm.model_executor.models.commandr): a parallel block with one norm.

``forward(positions, hidden_states, residual)`` ignores the residual it is
given and returns ``(hidden_states, residual)``: the whole stream first, the
block's input second; the values read the first. Its norm returns
``(normed, residual)``. There is no ``lm_head``: the logits use embed_tokens.
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import WholeStream

SPEC = derive(NEUTRAL["cohere"], layout=WholeStream(returns_tuple=True))
