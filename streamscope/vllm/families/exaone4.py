"""EXAONE 4 on vLLM (vllm.model_executor.models.exaone4): a whole-stream post-norm block, no input norm.

``x + post_attention_layernorm(attn(x))`` then ``+ post_feedforward_layernorm(mlp(.))``;
``forward(positions, hidden_states, residual)`` ignores the residual and
returns ``(hidden_states, residual)``: the whole stream first, layer_mid
second; the values read the first.
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import WholeStream

SPEC = derive(NEUTRAL["exaone4"], layout=WholeStream(returns_tuple=True))
