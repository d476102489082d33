"""Cohere (Command R): a parallel block with one LayerNorm feeding both the attention and the MLP."""

from dataclasses import replace

from ...blocks import Attention, Mlp, SharedNormParallelLayer
from ...families.logits import times_logit_scale
from . import llama

SPEC = replace(llama.SPEC, envoys={"layers.*": SharedNormParallelLayer, "self_attn": Attention, "mlp": Mlp},
               logit_scaling=times_logit_scale)
