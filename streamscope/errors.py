"""Why a block cannot serve a value, as an exception and as the reasons it carries."""

from __future__ import annotations


class Reason(str):
    """Why a value is not served: the sentence a user reads, with a machine-readable `code` (one of `CODES`).

    A `str`, so support tables and messages use it as text; code that acts on
    why a value is missing reads `code`, never the words.
    """

    code: str

    def __new__(cls, text: str, code: str) -> "Reason":
        if code not in CODES:
            raise ValueError(f"unknown reason code {code!r}: one of {', '.join(CODES)}")
        reason = super().__new__(cls, text)
        reason.code = code
        return reason

    def __reduce__(self) -> tuple:  # a reason travels from vLLM's worker with its code
        return (Reason, (str(self), self.code))


#: The codes a `Reason` (and so an `Unavailable`) carries.
CODES = (
    "missing_module",  # the block or model has no module the value is read at
    "one_sublayer",    # a state-space block: one sublayer (the mixer), so no stream between sublayers and no MLP
    "parallel",        # a parallel block: no stream between the attention and the MLP
    "post_norm",       # a post-norm block: the sublayer reads the residual stream itself
    "post_ln",         # a post-LN block: no sublayer adds its output to the stream unchanged
    "no_heads",        # a state-space model has no attention heads
    "untapped",        # a tapped vLLM engine does not serve this value's location
    "unserved",        # the family or block kind says why in its own words (`FamilySpec.unserved`, `UNSERVED`)
)


def code_of(reason: str) -> str:
    """The code of `reason`: its own where it is a `Reason`, else ``"unserved"`` (a family's or kind's sentence)."""
    return reason.code if isinstance(reason, Reason) else "unserved"


class Unavailable(Exception):
    """A value this block (or model) cannot serve, with the reason why.

    Raised on reading or writing the value, inside or outside a trace. It
    deliberately does not derive from AttributeError: nnsight turns an
    AttributeError raised inside a served value into a misleading "object has
    no attribute" message. `code` says why in a form code can test (`CODES`);
    `reason` says it in words.
    """

    def __init__(self, value: str, where: str, reason: str, code: str | None = None) -> None:
        self.value = value
        self.where = where
        self.reason = reason
        self.code = code if code is not None else code_of(reason)
        super().__init__(f"{where}.{value} is unavailable: {reason}")


class UnsupportedCheckpoint(ValueError):
    """A checkpoint whose layout the engine's own model class for its family cannot run, refused before the
    engine starts; the message names the options and what to do instead (`FamilySpec.cannot_run`)."""


PARALLEL = Reason("a parallel block: the attention and the MLP read the same input, so there is no stream between "
                  "them", "parallel")
POST_NORM_ATTENTION = Reason("a post-norm block: the attention reads the residual stream itself, layer_input", "post_norm")
POST_NORM_MLP = Reason("a post-norm block: the MLP reads the residual stream itself, layer_mid", "post_norm")
STATE_SPACE = Reason("a state-space block: one sublayer, the mixer, so there is no stream between sublayers and no MLP",
                     "one_sublayer")
NO_HEADS = Reason("a state-space model has no attention heads: its mixer is a selective scan, not attention", "no_heads")
POST_LN = Reason(
    "a post-LN block: a norm after each residual add rescales the stream, so no sublayer "
    "adds its output to the stream unchanged", "post_ln")


def missing_module(name: str, owner: str = "block") -> Reason:
    """The reason for a value keyed on a module the block (or the model: `owner`) does not have."""
    return Reason(f"no {name} module on this {owner}", "missing_module")


def untapped(name: str, location: str, taps: int) -> Reason:
    """The reason a tapped vLLM engine (one that replays CUDA graphs, `streamscope.vllm.taps`) does not serve
    the value `name` (``model.layers[3].layer_mid``) held at `location`; the fix names the tap to add."""
    tap = name.removeprefix("model.").replace("[", ".").replace("]", "")
    return Reason(f"this engine was started with taps= (to replay CUDA graphs) and serves only those values ({taps} "
                  f"location{'s' if taps != 1 else ''}), and this one, at {location}, is not among them. Start the "
                  f"engine with it among its taps (taps=[..., '{tap}']), or without taps= for an eager engine, which "
                  f"serves every value", "untapped")
