"""The engine-neutral block kinds and their sublayers, as nnsight envoys; each engine composes its part with them."""

from .layer import BOUNDARIES, CONTRIBUTIONS, SHORT_CONTRIBUTIONS, STREAM_ORDER, Layer
from .parallel import ParallelLayer, SharedNormParallelLayer
from .post_norm import PostNormLayer, SandwichLayer
from .state_space import HybridLayer, StateSpaceLayer
from .sublayers import Attention, LinearAttention, Mlp, PostNormedAttention, PostNormedMlp, SharedExpert, Sublayer

__all__ = [
    "Layer", "ParallelLayer", "SharedNormParallelLayer", "PostNormLayer", "SandwichLayer",
    "StateSpaceLayer", "HybridLayer", "Sublayer", "Attention", "LinearAttention", "Mlp",
    "PostNormedAttention", "PostNormedMlp", "SharedExpert", "BOUNDARIES", "CONTRIBUTIONS", "SHORT_CONTRIBUTIONS", "STREAM_ORDER",
]
