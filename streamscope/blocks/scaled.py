"""Sublayers whose output the block scales before its add: Granite's ``residual_multiplier``."""

from __future__ import annotations

from ..values import OUTPUT, StreamValue
from .envoy import module_config
from .sublayers import Attention, Mlp


def _residual_multiplier(envoy) -> float:
    return module_config(envoy).residual_multiplier


class GraniteAttention(Attention):
    @StreamValue(None, OUTPUT, factor=_residual_multiplier)
    def attention_output(self):
        """What the attention adds to the stream: its output times residual_multiplier, [batch, seq, hidden_size]."""


class GraniteMlp(Mlp):
    @StreamValue(None, OUTPUT, factor=_residual_multiplier)
    def mlp_output(self):
        """What the MLP adds to the stream: its output times residual_multiplier, [batch, seq, hidden_size]."""
