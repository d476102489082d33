"""StableLM on vLLM (vllm.model_executor.models.stablelm): Llama's tree, a whole-stream pre-norm block.

``forward(positions, hidden_states)`` returns ``(hidden_states, residual)``:
the whole stream first, layer_mid second; the values read the first.
"""

from dataclasses import replace

from ...blocks import Mlp
from ..attention import VllmAttention
from ..blocks import VllmLayer
from . import llama


class StableLMLayer(VllmLayer):
    """StableLM's block: returns the stream first in a tuple."""

    RETURNS_TUPLE = True


SPEC = replace(llama.SPEC, envoys={"layers.*": StableLMLayer, "self_attn": VllmAttention, "mlp": Mlp})
