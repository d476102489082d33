"""The inside of a softmax attention on transformers: queries, keys, values, scores, pattern and head outputs, the
queries and keys before the rotary embedding, and the query and key projections before any q/k norm.

They are read at the attention kernel's call inside the attention module's
forward, through nnsight's ``.source``: the call's inputs are the queries, keys
and values exactly as the kernel receives them (after rotary and any q/k norm),
its output the per-head mix. On transformers the kernel is the
``attention_interface(self, query, key, value, attention_mask, scaling=...)``
call every family but GPT-J and Falcon makes; a family whose forward calls
something else names it (`KERNEL`, `ARGUMENTS`, `OUTPUT_LAYOUT`).

Scores and the pattern are recomputed from the queries and keys with
`streamscope.attention` where the kernel fuses them (sdpa); on eager, the
pattern is the kernel's own weights.

The queries and keys before the rotary embedding are read at the call that
hands them to the rotary (``apply_rotary_pos_emb(q, k, cos, sin)`` in most
families; a family whose forward differs names its own, `ROTARY_SITES`), in
the same nnsight ``.source`` way; a block that rotates nothing serves the
kernel's queries and keys under those names.

The query and key projections are the input of the attention's q/k norm
module where it has one (`streamscope.blocks.heads.projection_norm`), and the
pre-rotary queries and keys that norm's output, held in the layout its forward
hands the norm (`NORM_LAYOUTS`); elsewhere the projections are the pre-rotary
values, read at the same call.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Protocol

import torch

from .. import attention, blocks, gradients
from .. import nnsight_seam as seam
from ..blocks.composed import Composer
from ..blocks.heads import (PRE_ROTARY, PROJECTED, READ_ONLY, pre_rotary_of, projected_of, projection_norm,
                            unrotated_of)
from ..errors import Unavailable
from ..values import (INPUT, OUTPUT, Host, ReadOnly, StreamValue, argument, first_tensor, is_edited, require_tapped,
                      resolve, with_argument)

#: transformers' attention kernels that take a soft cap and ignore it (Gemma 2 on sdpa runs uncapped).
KERNELS_WITHOUT_SOFTCAP = frozenset({"sdpa"})

NO_KERNEL = ("this attention's forward makes no call to an attention kernel that streamscope knows "
             "({kernel}), so its queries, keys and values cannot be read where the kernel receives them")
EAGER_READ_ONLY = ("{name} is the eager kernel's weights, which the model has already applied to the "
                   "values when it is read, so it cannot be written; edit queries or keys instead.")
RECOMPUTED_NO_GRADIENT = ("{name} is recomputed from the queries and keys for the read: the attention kernel "
                          "fuses it and never holds it, so no gradient flows through it. Read .grad of queries, "
                          "keys or head_outputs instead{eager}.")
UNKNOWN_NORM_LAYOUT = ("this attention ({kind}) norms its {name} before the rotary with `{norm}`, and streamscope "
                       "does not know the layout its forward hands that norm; read {pre_rotary} (after the norm) "
                       "instead")
EAGER_GRADIENT = (", or load the model with attn_implementation=\"eager\", whose kernel holds the pattern: its "
                  "gradient is served there")


class KernelHost(Host, Protocol):
    """What a value at the attention kernel's call needs of its attention envoy (`AttentionInternals`), beyond `Host`."""

    #: Where each value and the mask sit in the kernel call, as ``(index, name)``.
    ARGUMENTS: ClassVar[dict[str, tuple[int, str]]]

    def kernel(self) -> str:
        """The nnsight source name of the kernel call in the module's forward."""

    def instrument(self) -> None:
        """Make the kernel call a location (once)."""

    def recompute_scores(self, inputs: tuple) -> torch.Tensor:
        """The attention scores of the kernel call `inputs`."""


class KernelValue(StreamValue):
    """A tensor at the attention kernel's call: one of its arguments, or its output."""

    def __init__(self, where: str, *, shape: str, description: Optional[str] = None) -> None:
        super().__init__(None, where, shape=shape, description=description)

    def located(self, host: KernelHost) -> Any:
        reason = host.reason(self.name)
        if reason is not None:
            raise Unavailable(self.name, host.where(), reason)
        host.instrument()
        return host

    def location(self, host: KernelHost) -> str:
        self.located(host)
        return require_tapped(host, self.name, seam.call_location(host.path, host.kernel(), self.site(host)[1]))

    def live(self, host: KernelHost, raw: Any) -> torch.Tensor:
        if self.site(host)[1] == INPUT:
            return argument(raw, *host.ARGUMENTS[self.name])
        return first_tensor(raw)

    def _write_back(self, host: KernelHost, view: torch.Tensor, raw: Any) -> Any:
        if is_edited(view):
            return self.put(host, raw, self.checked(host, raw, view))
        return raw

    def _assign(self, host: KernelHost, value: Any) -> Any:
        raw = seam.read_at(self.location(host))
        return self.put(host, raw, self.checked(host, raw, value))

    def put(self, host: KernelHost, raw: Any, value: torch.Tensor) -> Any:
        """`raw` with `value` in it: copied into the model's tensor in place, or, where that tensor is a view
        autograd forbids editing in place (GPT-2's queries, split from c_attn's output), passed in its stead."""
        live = self.live(host, raw)
        if self.site(host)[1] == INPUT and live._base is not None and live.requires_grad:
            replacement = host.to_engine(value.to(live.dtype), live, self.name).detach().clone()
            return with_argument(raw, *host.ARGUMENTS[self.name], replacement)
        self.write(host, raw, value)
        return raw


class PreRotaryValue(KernelValue):
    """Queries or keys before the rotary embedding: the output of the q/k norm that precedes the rotary where the
    attention has one (`AttentionInternals.projection_site`), else an argument (or the output) of the call the host
    names for it (`AttentionInternals.pre_rotary_site`); the kernel's query or key on a block that rotates nothing."""

    def site(self, host: KernelHost) -> tuple[Optional[str], str, Any]:
        normed = host.projection_site(projected_of(self.name))  # type: ignore[attr-defined]
        if normed is not None:
            return normed[0], OUTPUT, None
        _, where, position = host.pre_rotary_site(pre_rotary_of(self.name))  # type: ignore[attr-defined]
        return None, where, position

    def location(self, host: KernelHost) -> str:
        self.located(host)
        module, where, _ = self.site(host)
        if module is not None:
            return require_tapped(host, self.name, seam.location(resolve(host, module).path, where))
        call, where, _ = host.pre_rotary_site(pre_rotary_of(self.name))  # type: ignore[attr-defined]
        return require_tapped(host, self.name, seam.call_location(host.path, call, where))

    def live(self, host: KernelHost, raw: Any) -> torch.Tensor:
        _, where, position = self.site(host)
        return argument(raw, *position) if where == INPUT else first_tensor(raw)

    def put(self, host: KernelHost, raw: Any, value: torch.Tensor) -> Any:
        """`raw` with `value` in it: in place, or passed on in its stead where the model's tensor cannot take it in
        place: a chunk of a fused projection, or a norm's output, under a recorded graph (autograd forbids it, or
        would not see the edit), or a broadcast view (Falcon's keys, one per query head), whose elements share
        memory."""
        live = self.live(host, raw)
        module, where, position = self.site(host)
        broadcast = any(stride == 0 and size > 1 for size, stride in zip(live.shape, live.stride()))
        if broadcast or (live.requires_grad and (live._base is not None or module is not None)):
            replacement = host.to_engine(value.to(live.dtype), live, self.name).detach().clone()
            return with_argument(raw, *position, replacement) if where == INPUT else replacement
        self.write(host, raw, value)
        return raw


#: Where a q/k norm's input sits in its call.
NORM_ARGUMENT = (0, "hidden_states")


class ProjectedValue(PreRotaryValue):
    """The query or key projection per head, before any q/k norm: the input of the q/k norm that precedes the
    rotary (`AttentionInternals.projection_site`) where the attention has one, else the pre-rotary value's site."""

    def site(self, host: KernelHost) -> tuple[Optional[str], str, Any]:
        normed = host.projection_site(self.name)  # type: ignore[attr-defined]
        return super().site(host) if normed is None else (normed[0], INPUT, NORM_ARGUMENT)


#: The layout in which each attention's forward hands its q/k norm the projection, by attention class: "bshd"
#: ([batch, seq, heads, head_dim]), "bhsd", or "flat" ([batch, seq, heads * head_dim], a norm over the whole width).
NORM_LAYOUTS: dict[str, str] = {
    "Qwen3Attention": "bshd", "Qwen3MoeAttention": "bshd", "Qwen3NextAttention": "bshd", "CohereAttention": "bshd",
    "Gemma3Attention": "bhsd", "Exaone4Attention": "bhsd", "StableLmAttention": "bhsd", "Olmo2Attention": "flat",
}


#: The forward's own condition for skipping its rotary on a block, by attention class: where it holds, the block's
#: pre-rotary values are the kernel's queries and keys. (Llama 4's NoPE blocks; EXAONE 4's global blocks, where
#: the model has sliding ones; Falcon with ALiBi, whose forward rotates only without it.)
ROTARY_OFF: dict[str, Callable[[Any], bool]] = {
    "Llama4TextAttention": lambda module: not module.use_rope,
    "Exaone4Attention": lambda module: not (module.sliding_window is None or module.is_sliding),
    "FalconAttention": lambda module: bool(module.config.alibi),
}


class RecomputedValue(ReadOnly, KernelValue):
    """Scores or the pattern: recomputed for the read from the kernel's inputs, or the eager kernel's weights."""

    def _read(self, host: KernelHost, raw: Any) -> torch.Tensor:
        with torch.inference_mode(False):
            if self.site(host)[1] == OUTPUT:  # the eager kernel's own weights
                return raw[1].detach().clone()
            logits = host.recompute_scores(raw)
            return logits if self.name == "scores" else attention.pattern(logits)

    def put(self, host: KernelHost, raw: Any, value: torch.Tensor) -> Any:
        self.write(host, raw, value)

    def gradient(self, host: KernelHost, raw: Any) -> gradients.Source:
        name = self.named(host)
        if self.site(host)[1] == OUTPUT:  # the eager kernel's own weights: a tensor of the graph
            return gradients.GradientSource(name, raw[1], raw[1])
        eager = EAGER_GRADIENT if self.name == "pattern" else ""
        return gradients.NoGradient(name, RECOMPUTED_NO_GRADIENT.format(name=name, eager=eager))

    def refusal(self, host: KernelHost) -> str:
        message = EAGER_READ_ONLY if self.site(host)[1] == OUTPUT else READ_ONLY
        return message.format(name=f"{host.where()}.{self.name}")


class AttentionInternals:
    """The values inside a softmax attention, read at transformers' kernel call: composed with an attention kind.

    An engine or family whose attention calls its kernel differently states it:
    `KERNEL` (the call's nnsight source name), `ARGUMENTS` (where each value
    and the mask sit in the call, as ``(index, name)``), `OUTPUT_LAYOUT`
    (``"bshd"`` or ``"bhsd"``), and overrides `spec` for what the call's
    keywords do not say (chunks, ALiBi).
    """

    #: The kernel call inside the module's forward, as nnsight's source names it.
    KERNEL: ClassVar[str] = "attention_interface_1"
    #: Where the queries, keys, values and mask sit in the kernel's call.
    ARGUMENTS: ClassVar[dict[str, tuple[int, str]]] = {
        "queries": (1, "query"), "keys": (2, "key"), "values": (3, "value"), "mask": (4, "attention_mask"),
    }
    #: The kernel output's layout: [batch, seq, heads, head_dim] ("bshd") or [batch, heads, seq, head_dim].
    OUTPUT_LAYOUT: ClassVar[str] = "bshd"
    #: Where the forward holds each value before the rotary: (call, "input" | "output", (index, name) of the
    #: input, None for the output).
    ROTARY_SITES: ClassVar[dict[str, tuple[str, str, Optional[tuple[int, str]]]]] = {
        "queries_pre_rotary": ("apply_rotary_pos_emb_0", INPUT, (0, "q")),
        "keys_pre_rotary": ("apply_rotary_pos_emb_0", INPUT, (1, "k")),
    }
    #: The pre-rotary tensors' layout there: "bhsd" ([batch, heads, seq, head_dim]) or "bshd".
    ROTARY_LAYOUT: ClassVar[str] = "bhsd"

    @ProjectedValue(INPUT, shape="[batch, heads, seq, head_dim]")
    def queries_projected(self) -> torch.Tensor:
        """The query projection per head, before any query norm and rotary, [batch, heads, seq, head_dim]
        (TransformerLens's attn.hook_q).

        Where the family norms its queries before rotating (Qwen3, Gemma 3,
        OLMo 2, EXAONE 4, Qwen3-Next), the norm's input (OLMo 2's norm spans
        the whole width: served split per head); elsewhere the same tensor as
        `queries_pre_rotary`. In transformers' channel order. In-place edits
        and assignment reach the model: the edited queries are normed and
        rotated.
        """

    @ProjectedValue(INPUT, shape="[batch, kv_heads, seq, head_dim]")
    def keys_projected(self) -> torch.Tensor:
        """The key projection per head, before any key norm and rotary, [batch, kv_heads, seq, head_dim]
        (TransformerLens's attn.hook_k).

        As `queries_projected`, for the keys of this step's tokens. In-place
        edits and assignment reach the model: the edited keys are normed,
        rotated and cached.
        """

    @PreRotaryValue(INPUT, shape="[batch, heads, seq, head_dim]")
    def queries_pre_rotary(self) -> torch.Tensor:
        """The queries before the rotary embedding, [batch, heads, seq, head_dim] (TransformerLens's hook_q
        where the family has no q/k norm; `queries_projected` is hook_q everywhere).

        What the forward hands its rotary: the query projection per head,
        after any query norm the family applies before rotating (Qwen3, Gemma
        3, OLMo 2, EXAONE 4), in transformers' channel order. On a block that
        rotates nothing, the kernel's queries. In-place edits and assignment
        reach the model: the edited queries are rotated.
        """

    @PreRotaryValue(INPUT, shape="[batch, kv_heads, seq, head_dim]")
    def keys_pre_rotary(self) -> torch.Tensor:
        """The keys before the rotary embedding, [batch, kv_heads, seq, head_dim] (after any key norm).

        As `queries_pre_rotary`, for the keys of this step's tokens. In-place
        edits and assignment reach the model: the edited keys are rotated
        and cached.
        """

    @KernelValue(INPUT, shape="[batch, heads, seq, head_dim]")
    def queries(self) -> torch.Tensor:
        """The queries the attention kernel receives, after rotary and any query norm, [batch, heads, seq, head_dim].

        In transformers' channel order, and after anything the family folds
        into them (OPT's scaling, Llama 4's temperature tuning on NoPE blocks).
        In-place edits and assignment reach the kernel.
        """

    @KernelValue(INPUT, shape="[batch, kv_heads, seq, head_dim]")
    def keys(self) -> torch.Tensor:
        """The keys the attention kernel receives, after rotary and any key norm, [batch, kv_heads, seq, head_dim].

        Every key position the queries attend to (past ones too, under a
        cache). In-place edits and assignment reach the kernel (and the cache).
        """

    @KernelValue(INPUT, shape="[batch, kv_heads, seq, head_dim]")
    def values(self) -> torch.Tensor:
        """The values the attention kernel receives, [batch, kv_heads, seq, head_dim].

        In-place edits and assignment reach the kernel (and the cache).
        """

    @RecomputedValue(INPUT, shape="[batch, heads, q_seq, k_seq]")
    def scores(self) -> torch.Tensor:
        """The attention logits before the softmax, [batch, heads, q_seq, k_seq], float32; -inf where masked.

        Recomputed from queries and keys (``q @ k.T * scale``, the family's
        soft cap and ALiBi, the causal, sliding-window or chunked mask, and
        any padding in the mask the kernel receives), on every attention
        implementation. The soft cap (Gemma 2) is applied where the kernel
        applies it: streamscope loads Gemma 2 with the eager kernel, which
        does; transformers' sdpa kernel ignores it, so a Gemma 2 model loaded
        with ``attn_implementation="sdpa"`` runs, and is served, uncapped.
        Read-only: writing it raises.
        """

    @RecomputedValue(INPUT, shape="[batch, heads, q_seq, k_seq]")
    def pattern(self) -> torch.Tensor:
        """The attention weights, softmax(scores) over keys, [batch, heads, q_seq, k_seq]: rows sum to 1, masked entries are 0.

        On eager attention, the kernel's own weights; on a kernel that fuses
        them (sdpa, the default), recomputed from queries and keys as
        `scores` is. Read-only either way: writing it raises.
        """

    @KernelValue(OUTPUT, shape="[batch, seq, heads, head_dim]")
    def head_outputs(self) -> torch.Tensor:
        """Each head's mix of values, pattern @ values, [batch, seq, heads, head_dim]: what the kernel returns.

        What the output projection reads, viewed per head (before Qwen3-Next's
        output gate, which scales it per channel). In-place edits and
        assignment reach the model: zeroing a head removes its contribution.
        """

    # What the host supplies.

    def kernel(self) -> str:
        """The nnsight source name of the kernel call in this module's forward."""
        return self.KERNEL

    def kernel_reason(self) -> Optional[str]:
        """Why this module's forward has no kernel call to read, or None."""
        if self.kernel() not in seam.kernel_call_names(seam.module_of(self)):
            return NO_KERNEL.format(kernel=self.kernel().rsplit("_", 1)[0])
        return None

    def instrument(self) -> None:
        """Source-instrument the module's forward (once), so the kernel call is a location."""
        seam.ensure_source(self)

    def rotary_sites(self) -> dict[str, tuple[str, str, Optional[tuple[int, str]]]]:
        """Where this module's forward holds the queries and keys before its rotary (`ROTARY_SITES`)."""
        return self.ROTARY_SITES

    def rotary_applies(self) -> bool:
        """Whether this block rotates its queries and keys: its forward makes the rotary's calls and the family's
        condition for skipping them (`ROTARY_OFF`) does not hold. Asked once per envoy."""
        known = self.__dict__.get("_streamscope_rotary")
        if known is None:
            module = seam.module_of(self)
            calls = seam.kernel_call_names(module)
            off = ROTARY_OFF.get(type(module).__name__)
            known = all(call in calls for call, _, _ in self.rotary_sites().values()) \
                and not (off is not None and off(module))
            self.__dict__["_streamscope_rotary"] = known
        return known

    def pre_rotary_site(self, name: str) -> tuple[str, str, Optional[tuple[int, str]]]:
        """(call, where, argument) of the pre-rotary value `name`: the rotary's, or on a block that rotates
        nothing, the kernel's query or key."""
        if self.rotary_applies():
            return self.rotary_sites()[name]
        return self.kernel(), INPUT, self.ARGUMENTS[unrotated_of(name)]

    def projection_site(self, name: str) -> Optional[tuple[str, str]]:
        """(the q/k norm that precedes the rotary, the layout the forward hands it the projection: "bshd", "bhsd"
        or "flat") for projected value `name`, None where the attention has no such norm. The projection is the
        norm's input, the pre-rotary value its output: the forward norms q, then k, then rotates both, so read
        there they come in the order `INTERNALS` lists them."""
        module = seam.module_of(self)
        norm = projection_norm(module, name)
        return None if norm is None else (norm, NORM_LAYOUTS.get(type(module).__name__, ""))

    def reason(self, name: str) -> Optional[str]:
        own = super().reason(name)  # type: ignore[misc]
        site = self.projection_site(projected_of(name)) if own is None else None
        if site is not None and not site[1]:
            return UNKNOWN_NORM_LAYOUT.format(kind=type(seam.module_of(self)).__name__, name=unrotated_of(name),
                                              norm=site[0], pre_rotary=pre_rotary_of(name))
        return own

    def from_norm_layout(self, tensor: torch.Tensor, layout: str) -> torch.Tensor:
        """A q/k norm's input or output, held in `layout`, as [batch, heads, seq, head_dim] (a view)."""
        if layout == "flat":
            tensor = tensor.unflatten(-1, (-1, seam.module_of(self).head_dim))
        return tensor if layout == "bhsd" else tensor.transpose(1, 2)

    def relocated(self) -> dict:
        if getattr(self.module_config(), "_attn_implementation", None) == "eager":
            return {"pattern": (None, OUTPUT)}
        return {}

    def module_config(self) -> Any:
        return getattr(seam.module_of(self), "config", None)

    def spec(self, inputs: tuple) -> attention.Spec:
        """The family's attention for one kernel call, from the call's keywords and the module."""
        _, kwargs = inputs
        scale = kwargs.get("scaling")
        if scale is None:
            scale = getattr(seam.module_of(self), "scaling", None)
        if scale is None:
            scale = argument(inputs, *self.ARGUMENTS["queries"]).shape[-1] ** -0.5
        softcap = kwargs.get("softcap")
        if getattr(self.module_config(), "_attn_implementation", None) in KERNELS_WITHOUT_SOFTCAP:
            softcap = None  # the kernel ignores it, so the model runs uncapped
        return attention.Spec(scale=float(scale), softcap=softcap, sliding_window=kwargs.get("sliding_window"))

    def recompute_scores(self, inputs: tuple) -> torch.Tensor:
        """`scores` for one kernel call: its queries, keys and mask, the family's `spec`."""
        queries = argument(inputs, *self.ARGUMENTS["queries"])
        keys = argument(inputs, *self.ARGUMENTS["keys"])
        mask = attention.additive_mask_to_bool(argument(inputs, *self.ARGUMENTS["mask"]))
        if mask is not None and mask.dim() == 4:
            mask = mask[..., -queries.shape[-2]:, :keys.shape[-2]]
        else:
            mask = None
        return attention.scores(queries, keys, self.spec(inputs), mask=mask)

    def internals_to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        site = self.projection_site(projected_of(name))
        if site is not None:
            return self.from_norm_layout(tensor, site[1])
        if name in PROJECTED:
            return self.internals_to_user(tensor, pre_rotary_of(name))
        if name in PRE_ROTARY:
            if not self.rotary_applies():
                return self.internals_to_user(tensor, unrotated_of(name))
            return tensor.transpose(1, 2) if self.ROTARY_LAYOUT == "bshd" else tensor
        if name == "head_outputs" and self.OUTPUT_LAYOUT == "bhsd":
            return tensor.transpose(1, 2)
        return tensor

    def internals_to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        site = self.projection_site(projected_of(name))
        if site is not None:
            return (value if site[1] == "bhsd" else value.transpose(1, 2)).reshape(live.shape)
        if name in PROJECTED:
            return self.internals_to_engine(value, live, pre_rotary_of(name))
        if name in PRE_ROTARY:
            if not self.rotary_applies():
                return self.internals_to_engine(value, live, unrotated_of(name))
            return (value.transpose(1, 2) if self.ROTARY_LAYOUT == "bshd" else value).reshape(live.shape)
        if name == "head_outputs" and self.OUTPUT_LAYOUT == "bhsd":
            return value.transpose(1, 2)
        return value.reshape(live.shape)


def _internals_part(token: str) -> tuple[str, tuple[type, ...], Callable[[type], dict]]:
    return "Kernel", (AttentionInternals,), lambda kind: {}


#: The attentions composed here, importable as ``streamscope.transformers.attention.<qualified name>``.
ATTENTIONS = Composer(__name__, _internals_part)


def __getattr__(name: str) -> type:
    return ATTENTIONS.rebuild(name)


def attention_kind(kind: type) -> type:
    """The envoy class of an engine-neutral attention `kind` (`blocks.Attention`, `blocks.PostNormedAttention`, a
    family's) on transformers: its internals read at the kernel call. A kind that has them already is itself."""
    if issubclass(kind, AttentionInternals):
        return kind
    return ATTENTIONS.compose("KernelCall", kind)


#: A softmax attention on transformers (`self_attn`): its output, and its internals read at the kernel call. A
#: family whose attention calls its kernel otherwise derives from it (`KERNEL`, `ARGUMENTS`, `spec`).
KernelAttention = attention_kind(blocks.Attention)

__all__ = ["AttentionInternals", "KernelAttention", "KernelValue", "PreRotaryValue", "ProjectedValue",
           "RecomputedValue", "attention_kind"]
