"""Why a block cannot serve a value, as an exception and as the reasons it carries."""

from __future__ import annotations


class Unavailable(Exception):
    """A value this block (or model) cannot serve, with the reason why.

    Raised on reading or writing the value, inside or outside a trace. It
    deliberately does not derive from AttributeError: nnsight turns an
    AttributeError raised inside a served value into a misleading "object has
    no attribute" message.
    """

    def __init__(self, value: str, where: str, reason: str) -> None:
        self.value = value
        self.where = where
        self.reason = reason
        super().__init__(f"{where}.{value} is unavailable: {reason}")


class UnsupportedCheckpoint(ValueError):
    """A checkpoint whose layout the engine's own model class for its family cannot run, refused before the
    engine starts; the message names the options and what to do instead (`FamilySpec.cannot_run`)."""


PARALLEL = "a parallel block: the attention and the MLP read the same input, so there is no stream between them"
POST_NORM_ATTENTION = "a post-norm block: the attention reads the residual stream itself, layer_input"
POST_NORM_MLP = "a post-norm block: the MLP reads the residual stream itself, layer_mid"
STATE_SPACE = "a state-space block: one sublayer, the mixer, so there is no stream between sublayers and no MLP"
NO_HEADS = "a state-space model has no attention heads: its mixer is a selective scan, not attention"
POST_LN = (
    "a post-LN block: a norm after each residual add rescales the stream, so no sublayer "
    "adds its output to the stream unchanged"
)


def missing_module(name: str, owner: str = "block") -> str:
    """The reason for a value keyed on a module the block (or the model: `owner`) does not have."""
    return f"no {name} module on this {owner}"


def untapped(name: str, location: str, taps: int) -> str:
    """The reason a tapped vLLM engine (one that replays CUDA graphs, `streamscope.vllm.taps`) does not serve
    the value `name` (``model.layers[3].layer_mid``) held at `location`; the fix names the tap to add."""
    tap = name.removeprefix("model.").replace("[", ".").replace("]", "")
    return (f"this engine was started with taps= (to replay CUDA graphs) and serves only those values ({taps} "
            f"location{'s' if taps != 1 else ''}), and this one, at {location}, is not among them. Start the "
            f"engine with it among its taps (taps=[..., '{tap}']), or without taps= for an eager engine, which "
            f"serves every value")
