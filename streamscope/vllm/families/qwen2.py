"""Qwen2 on vLLM (vllm.model_executor.models.qwen2): Llama's names and Llama's fused block.

vLLM's Qwen2 slides its attention window on every block or on none: a
checkpoint that slides it on some blocks only (``use_sliding_window`` with
``max_window_layers`` below the block count) is refused before the engine starts.
"""

from typing import Any, Optional

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import FUSED
from . import not_implemented


def cannot_run(config: Any) -> Optional[str]:
    """Why vLLM's Qwen2 cannot run this checkpoint: a sliding window on some blocks only."""
    if len(set(getattr(config, "layer_types", None) or ())) > 1 and \
            config.max_window_layers != config.num_hidden_layers:
        return not_implemented("Qwen2", f"slides its attention window (use_sliding_window, sliding_window="
                                        f"{config.sliding_window}) on some blocks only (max_window_layers="
                                        f"{config.max_window_layers} of {config.num_hidden_layers})")
    return None


SPEC = derive(NEUTRAL["qwen2"], layout=FUSED, cannot_run=cannot_run)
