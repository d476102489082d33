"""The block kinds and their sublayers, as nnsight envoys; engines subclass them for their layouts."""

from .layer import Layer
from .parallel import ParallelLayer, SharedNormParallelLayer
from .post_norm import PostNormLayer, SandwichLayer
from .state_space import HybridLayer, StateSpaceLayer
from .sublayers import Attention, LinearAttention, Mlp, PostNormedAttention, PostNormedMlp, Sublayer

__all__ = [
    "Layer", "ParallelLayer", "SharedNormParallelLayer", "PostNormLayer", "SandwichLayer",
    "StateSpaceLayer", "HybridLayer", "Sublayer", "Attention", "LinearAttention", "Mlp",
    "PostNormedAttention", "PostNormedMlp",
]
