"""StableLM on vLLM (vllm.model_executor.models.stablelm): Llama's tree, a whole-stream pre-norm block.

``forward(positions, hidden_states)`` returns ``(hidden_states, residual)``:
the whole stream first, layer_mid second; the values read the first.

vLLM's StableLM block (0.22 and 0.32 alike) is sequential and has no per-head
query and key norms: a checkpoint with ``use_parallel_residual`` or
``qk_layernorm`` (StableLM 2 12B) is refused before the engine starts, where
vLLM would stop loading its weights.
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import WholeStream
from . import options_not_implemented

SPEC = derive(NEUTRAL["stablelm"], layout=WholeStream(returns_tuple=True),
              cannot_run=options_not_implemented("StableLM", {
                  "use_parallel_residual": "attention and MLP both reading the block's input",
                  "qk_layernorm": "a norm on each head's queries and keys"}))
