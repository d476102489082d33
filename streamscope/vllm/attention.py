"""The inside of a softmax attention on vLLM: queries, keys, values, scores, pattern and head outputs, the queries
and keys before the rotary embedding, and the query and key projections before any q/k norm.

vLLM's attention module (``self_attn``) hands its queries, keys and values,
after rotary and any q/k norm, to an attention layer (a child, ``attn`` in
every family here, and in the Transformers backend's modules too) as
``attn(query, key, value)``: flat ``[tokens, heads * head_dim]`` tensors, each
request's tokens in its own rows. That layer writes the keys and values into
the KV cache, runs the fused kernel and returns each head's mix, ``[tokens,
heads * head_dim]``, which the output projection reads. The values are read
there and served in transformers' layouts: queries ``[1, heads, tokens,
head_dim]``, keys and values ``[1, kv_heads, tokens, head_dim]``, head_outputs
``[1, tokens, heads, head_dim]``; edits go back into the flat tensors, before
the layer caches and attends.

The kernel fuses the scores and the pattern, so they are recomputed from the
queries and keys (`streamscope.attention`) with what the layer itself runs
with: its implementation's scale, soft cap and ALiBi slopes, its sliding
window, its chunk size (Llama 4's chunked layers). On a decode step
(``tracer.iter``) the layer is called with the new token only; the scores span
the request's whole prefix, from the keys this trace read at the earlier
steps, which each read keeps on the request's own nnsight mediator (the
worker runs one per request, so nothing is shared with the other requests of
the step).

The queries and keys before the rotary embedding are the arguments of the
forward's ``self.rotary_emb(positions, q, k)`` call (flat, as the layer's),
read through nnsight's ``.source`` (the rotary module is one object shared by
every layer, so its own call cannot tell the blocks apart); in the
Transformers backend, transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``
call, ``[1, heads, tokens, head_dim]``; where the attention norms q and k before
its rotary, the norms' outputs (`BACKEND_NORMS`). vLLM's rotary rotates q and k in place,
so a read is a copy taken before it runs, and an edit lands before the
rotation. A block that rotates nothing serves the layer's queries and keys
under those names.

The query and key projections are the input of the attention's q/k norm
module where it has one (`streamscope.blocks.heads.projection_norm`: vLLM's own
Qwen3, Gemma 3, EXAONE 4 and Qwen3-Next hand it ``[tokens, heads, head_dim]``;
transformers' OLMo 2 in the Transformers backend, the whole width), and the
pre-rotary values, read at the same place, where it has none.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Protocol

import torch
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.model_executor.layers.attention import Attention as VllmAttentionLayer

from .. import attention, blocks, vllm_seam
from .. import nnsight_seam as seam
from ..blocks.composed import Composer
from ..blocks.heads import (FUSED_PROJECTION, FUSED_ROTARY, PRE_ROTARY, PROJECTED, READ_ONLY, pre_rotary_of,
                            projection_norm, unrotated_of)
from ..values import INPUT, OUTPUT, Host, ReadOnly, StreamValue, argument, first_tensor, require_tapped

#: The child of a vLLM attention module that runs the kernel.
KERNEL_LAYER = "attn"
#: What a request's trace keeps of each attention layer's earlier steps, on its mediator.
HISTORY = "_streamscope_attention_history"

NO_LAYER = ("this attention has no vLLM attention layer (`{name}`, called attn(query, key, value)) to read "
            "its queries, keys and values at, so vLLM serves none of them here")
OTHER_LAYER = ("this attention's `{name}` is a {kind}, not vLLM's Attention (called attn(query, key, value) "
               "with flat per-head tensors), so vLLM serves none of its internals here")
MISSING_STEPS = ("{where}.{name} on decode step {step} spans the request's whole prefix, which needs this "
                 "block's keys of every earlier step, and this trace read none at step(s) {missing}: read any "
                 "of this attention's queries, keys, values, scores or pattern at every step "
                 "(`for step in tracer.iter[:]`).")


def tensor_parallel() -> tuple[int, int]:
    """This engine's tensor-parallel world size and this rank's place in it; ``(1, 0)`` outside an engine."""
    return vllm_seam.tensor_parallel()


def pairs_first(tensor: torch.Tensor) -> torch.Tensor:
    """A head's channels (last dimension) from vLLM's load-time order back to transformers' order.

    vLLM's Llama 4 permutes each head's q and k rows at load so that its
    rotary embedding, which rotates halves, reproduces transformers' rotation of
    adjacent pairs: vLLM's channel j < d/2 is transformers' 2j, j >= d/2 is
    transformers' 2(j - d/2) + 1 (the even channels, then the odd ones).
    """
    half = tensor.shape[-1] // 2
    return torch.stack((tensor[..., :half], tensor[..., half:]), dim=-1).flatten(-2)


def halves_first(tensor: torch.Tensor) -> torch.Tensor:
    """`pairs_first`'s inverse: transformers' order of a head's channels to vLLM's (even channels, then odd)."""
    return torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)


class LayerHost(Host, Protocol):
    """What a value at vLLM's attention layer needs of its attention envoy (`VllmAttentionInternals`), beyond `Host`."""

    def remember(self, raw: Any) -> None:
        """Keep this step's keys for later decode steps."""

    def scores_so_far(self, raw: Any, name: str) -> torch.Tensor:
        """`scores` of this step's queries over every key of the request so far."""


class Flat(StreamValue):
    """One of the attention layer's flat per-head tensors, served per head in transformers' layout.

    The host splits the flat width into its heads (`head_count`) and says the
    layout (`internals_to_user`, `internals_to_engine`).

    Args:
        where: ``"input"`` (`argument` says which) or ``"output"`` (head_outputs).
    """

    def __init__(self, where: str, *, shape: str, argument: Optional[tuple[int, str]] = None,
                 factor: Optional[Callable[[Host], float]] = None, description: Optional[str] = None) -> None:
        super().__init__(KERNEL_LAYER, where, shape=shape, argument=argument, factor=factor,
                         description=description)

    def user_view(self, host: LayerHost, raw: Any) -> torch.Tensor:
        """The value in the user's layout, scaled where it is, without a copy where none is needed."""
        view = host.to_user(self.live(host, raw), self.name)
        if self.factor is not None:
            return view * self.factor(host)
        return view

    def _read(self, host: LayerHost, raw: Any) -> torch.Tensor:
        value = super()._read(host, raw)
        if self.where == INPUT:
            host.remember(raw)
        return value


class Recomputed(ReadOnly, Flat):
    """Scores or the pattern: recomputed for the read from the layer's queries and keys. Read-only."""

    READ_ONLY = READ_ONLY  # the softmax attention's refusal (`blocks.heads`)

    def _read(self, host: LayerHost, raw: Any) -> torch.Tensor:
        with torch.inference_mode(False):
            host.remember(raw)
            logits = host.scores_so_far(raw, self.name)
            return logits if self.name == "scores" else attention.pattern(logits)


#: Where the queries and keys sit in the attention layer's call.
LAYER_ARGUMENTS = {"queries": (0, "query"), "keys": (1, "key")}
#: The rotary call in a vLLM attention's forward, and where the queries and keys sit in it.
ROTARY_CALL = "self_rotary_emb_0"
ROTARY_ARGUMENTS = {"queries_pre_rotary": (1, "query"), "keys_pre_rotary": (2, "key")}
#: The same in transformers' own attention, run by vLLM's Transformers backend ([1, heads, tokens, head_dim]).
BACKEND_ROTARY_CALL = "apply_rotary_pos_emb_0"
BACKEND_ROTARY_ARGUMENTS = {"queries_pre_rotary": (0, "q"), "keys_pre_rotary": (1, "k")}
#: Where an attention with q/k norms before its rotary holds them: the norms' outputs, what the forward hands its
#: rotary once reshaped (read there, after the projections, the norms' inputs, in the order the forward calls them;
#: and where its forward makes no rotary call `.source` can reach). Transformers' own attention whose forward vLLM's Transformers
#: backend rewrote (fusing its q/k/v projections; OLMo 2, norms over the whole projection, [1, tokens, width]), and
#: a forward that rotates in a helper method (Qwen3-Next's `_project_qkv_gate`, per-head norms, [tokens, heads,
#: head_dim]).
BACKEND_NORMS = {"queries_pre_rotary": "q_norm", "keys_pre_rotary": "k_norm"}
BACKEND_REWRITTEN = ("vLLM's Transformers backend rewrote this attention's forward (fusing its q/k/v projections), "
                     "which cannot be instrumented where it hands its queries and keys to the rotary, and it has no "
                     "q/k norms whose outputs they are; read queries and keys (after the rotary) instead")
#: The forward's own condition for skipping its rotary call on a block, by attention class, where the module's
#: ``rotary_emb`` is there anyway (EXAONE 4's global blocks in a model with sliding ones). A block whose
#: ``rotary_emb`` is None or absent (Llama 4's NoPE blocks, Falcon with ALiBi) rotates nothing either.
ROTARY_OFF: dict[str, Callable[[Any], bool]] = {
    "Exaone4Attention": lambda module: not (module.sliding_window or module.apply_rope_all_layers),
}
#: A forward that fuses its q/k norm, rotary and gate into one kernel where this flag is set (Qwen3-Next on GPUs).
FUSED_ROTARY_FLAG = "use_fused_qk_norm_rope_gate"


class PreRotary(StreamValue):
    """Queries or keys before the rotary embedding: an argument of the forward's rotary call
    (`VllmAttentionInternals.rotary_call`), served per head in transformers' layout; on a block that rotates
    nothing, the attention layer's query or key."""

    def __init__(self, *, shape: str, factor: Optional[Callable[[Host], float]] = None,
                 description: Optional[str] = None) -> None:
        super().__init__(None, INPUT, shape=shape, factor=factor, description=description)

    def site(self, host: Host) -> tuple[Optional[str], str, Any]:
        rotary = host.rotary_call()  # type: ignore[attr-defined]
        if rotary is None:
            return KERNEL_LAYER, INPUT, LAYER_ARGUMENTS[unrotated_of(self.name)]
        call, arguments, _ = rotary
        if call is None:  # a module's output (`BACKEND_NORMS`)
            return arguments[pre_rotary_of(self.name)], OUTPUT, None
        return None, INPUT, arguments[pre_rotary_of(self.name)]

    def location(self, host: Host) -> str:
        rotary = host.rotary_call()  # type: ignore[attr-defined]
        if rotary is None or rotary[0] is None:
            return super().location(host)
        self.located(host)
        seam.ensure_source(host)
        return require_tapped(host, self.name, seam.call_location(host.path, rotary[0], INPUT))

    def live(self, host: Host, raw: Any) -> torch.Tensor:
        _, where, position = self.site(host)
        return argument(raw, *position) if where == INPUT else first_tensor(raw)


#: Where a q/k norm's input sits in its call (vLLM's norms name it ``x``; transformers', in the backend, positional).
NORM_ARGUMENT = (0, "x")


class Projected(PreRotary):
    """The query or key projection per head, before any q/k norm: the input of the attention's norm module where
    it has one (`VllmAttentionInternals.projection_norm`), else the pre-rotary value's own site."""

    def site(self, host: Host) -> tuple[Optional[str], str, Any]:
        norm = host.projection_norm(self.name)  # type: ignore[attr-defined]
        if norm is None:
            return super().site(host)
        return norm, INPUT, NORM_ARGUMENT

    def location(self, host: Host) -> str:
        if host.projection_norm(self.name) is None:  # type: ignore[attr-defined]
            return super().location(host)
        rotary = host.rotary_call()  # type: ignore[attr-defined]
        if rotary is not None and rotary[0] is not None:
            # instrumented now, before the forward runs: a later read of the pre-rotary values in this trace needs
            # the rotary call as a location, and a forward already running cannot be instrumented any more
            seam.ensure_source(host)
        return StreamValue.location(self, host)


class VllmAttentionInternals:
    """The attention internals of `streamscope.blocks.heads`, read at vLLM's attention layer (`attn`).

    A family whose layer differs says how: `CHANNELS_PERMUTED` (Llama 4's
    load-time permutation of q and k channels), `QUERIES_SCALED` (OPT's queries,
    which transformers serves scaled), or overrides `layer_spec`.
    """

    #: Whether vLLM permuted each head's q and k channels at load (`pairs_first`).
    CHANNELS_PERMUTED: ClassVar[bool] = False
    #: Whether transformers serves the queries multiplied by the scale (and attends with scale 1): OPT.
    QUERIES_SCALED: ClassVar[bool] = False

    @Projected(shape="[1, heads, tokens, head_dim]")
    def queries_projected(self) -> torch.Tensor:
        """The query projection per head, before any query norm and rotary, [1, heads, tokens, head_dim]
        (TransformerLens's attn.hook_q).

        Where the family norms its queries before rotating (Qwen3, Gemma 3,
        OLMo 2, EXAONE 4, Qwen3-Next), the norm's input; elsewhere the same
        tensor as `queries_pre_rotary`. In transformers' channel order.
        In-place edits and assignment reach the model: the edited queries are
        normed and rotated.
        """

    @Projected(shape="[1, kv_heads, tokens, head_dim]")
    def keys_projected(self) -> torch.Tensor:
        """The key projection per head, before any key norm and rotary, [1, kv_heads, tokens, head_dim]
        (TransformerLens's attn.hook_k).

        This step's tokens only; as `queries_projected` otherwise. In-place
        edits and assignment reach the model: the edited keys are normed,
        rotated and cached.
        """

    @PreRotary(shape="[1, heads, tokens, head_dim]")
    def queries_pre_rotary(self) -> torch.Tensor:
        """The queries before the rotary embedding, after any query norm, [1, heads, tokens, head_dim].

        What the forward hands its rotary: the query projection per head,
        after any query norm the family applies before rotating, in
        transformers' channel order (Llama 4: vLLM's load-time permutation
        undone). On a block that rotates nothing, the layer's queries.
        In-place edits and assignment reach the model: the edited queries are
        rotated.
        """

    @PreRotary(shape="[1, kv_heads, tokens, head_dim]")
    def keys_pre_rotary(self) -> torch.Tensor:
        """The keys before the rotary embedding, after any key norm, [1, kv_heads, tokens, head_dim].

        This step's tokens only; as `queries_pre_rotary` otherwise. In-place
        edits and assignment reach the model: the edited keys are rotated and
        cached.
        """

    @Flat(INPUT, argument=(0, "query"), shape="[1, heads, tokens, head_dim]")
    def queries(self) -> torch.Tensor:
        """The queries vLLM's attention layer receives, after rotary and any query norm, [1, heads, tokens, head_dim].

        In transformers' channel order (Llama 4: vLLM's load-time permutation
        undone) and scale (OPT: scaled as transformers scales them). In-place
        edits and assignment reach the layer, in vLLM's order.
        """

    @Flat(INPUT, argument=(1, "key"), shape="[1, kv_heads, tokens, head_dim]")
    def keys(self) -> torch.Tensor:
        """The keys vLLM's attention layer receives (and caches), after rotary and any key norm, [1, kv_heads, tokens, head_dim].

        This step's tokens only (on a decode step, the new token); in
        transformers' channel order. In-place edits and assignment reach the
        layer before it caches them.
        """

    @Flat(INPUT, argument=(2, "value"), shape="[1, kv_heads, tokens, head_dim]")
    def values(self) -> torch.Tensor:
        """The values vLLM's attention layer receives (and caches), [1, kv_heads, tokens, head_dim].

        In-place edits and assignment reach the layer before it caches them.
        """

    @Recomputed(INPUT, argument=(0, "query"), shape="[1, heads, tokens, k_tokens]")
    def scores(self) -> torch.Tensor:
        """The attention logits before the softmax, [1, heads, tokens, k_tokens], float32; -inf where masked.

        vLLM's kernel fuses them, so they are recomputed from the queries and
        keys with the layer's scale, soft cap, ALiBi slopes, sliding window and
        chunks. On a decode step the keys span the request's whole prefix: the
        keys this trace read at the earlier steps (read any internal of this
        attention at every step). Read-only: writing it raises.
        """

    @Recomputed(INPUT, argument=(0, "query"), shape="[1, heads, tokens, k_tokens]")
    def pattern(self) -> torch.Tensor:
        """The attention weights, softmax(scores) over keys, [1, heads, tokens, k_tokens]: rows sum to 1, masked entries are 0.

        Recomputed as `scores` is. Read-only: writing it raises.
        """

    @Flat(OUTPUT, shape="[1, tokens, heads, head_dim]")
    def head_outputs(self) -> torch.Tensor:
        """Each head's mix of values, [1, tokens, heads, head_dim]: what vLLM's attention layer returns.

        What the output projection reads, viewed per head (before Qwen3-Next's
        output gate). In-place edits and assignment reach the model: zeroing a
        head removes its contribution.
        """

    # The layer.

    def kernel_layer(self) -> Any:
        """vLLM's attention layer module inside this attention."""
        return seam.module_of(self).__dict__["_modules"][KERNEL_LAYER]

    def kernel_reason(self) -> Optional[str]:
        layer = getattr(seam.module_of(self), "_modules", {}).get(KERNEL_LAYER)
        if layer is None:
            return NO_LAYER.format(name=KERNEL_LAYER)
        if not isinstance(layer, VllmAttentionLayer):
            return OTHER_LAYER.format(name=KERNEL_LAYER, kind=type(layer).__name__)
        return None

    def relocated(self) -> dict:
        return {}

    def reason(self, name: str) -> Optional[str]:
        own = super().reason(name)  # type: ignore[misc]
        if own is None and (name in PRE_ROTARY or name in PROJECTED):
            module = seam.module_of(self)
            if getattr(module, FUSED_ROTARY_FLAG, False):
                fused = FUSED_PROJECTION if name in PROJECTED else FUSED_ROTARY
                return fused.format(kernel="fused_qk_rmsnorm_rope_gate")
            if self.projection_norm(name) is not None:
                return None
            calls = seam.kernel_call_names(module)
            if BACKEND_ROTARY_CALL in calls and not seam.runs_class_forward(module) \
                    and not self._backend_norms(module):
                return BACKEND_REWRITTEN
        return own

    def projection_norm(self, name: str) -> Optional[str]:
        """The child that norms the projection of `name` before the rotary, None where there is none."""
        return projection_norm(seam.module_of(self), name)

    @staticmethod
    def _backend_norms(module: Any) -> bool:
        return all(norm in module._modules for norm in BACKEND_NORMS.values())

    def rotary_call(self) -> Optional[tuple[Optional[str], dict[str, Any], str]]:
        """(call, where the queries and keys sit in it, their layout: "flat" or "bhsd") of this block's rotary,
        None where it rotates nothing; (None, the modules whose outputs they are, "normed") where the attention
        norms its queries and keys before the rotary (`BACKEND_NORMS`). Asked once per envoy."""
        known = self.__dict__.get("_streamscope_rotary", False)
        if known is False:
            module = seam.module_of(self)
            calls = seam.kernel_call_names(module)
            off = ROTARY_OFF.get(type(module).__name__)
            known = None
            if self._backend_norms(module):
                # after the norms, which the forward calls one after the other (q's, then k's) before its rotary:
                # read there, the projections (the norms' inputs) and these come in the order `INTERNALS` lists
                # them; on a block that rotates nothing they are the layer's queries and keys all the same
                known = (None, BACKEND_NORMS, "normed")
            elif ROTARY_CALL in calls:
                if getattr(module, "rotary_emb", None) is not None and not (off is not None and off(module)):
                    known = (ROTARY_CALL, ROTARY_ARGUMENTS, "flat")
            elif BACKEND_ROTARY_CALL in calls and seam.runs_class_forward(module):
                known = (BACKEND_ROTARY_CALL, BACKEND_ROTARY_ARGUMENTS, "bhsd")
            self.__dict__["_streamscope_rotary"] = known
        return known

    def result_heads(self) -> int:
        return self.head_count("head_outputs")

    def join_result_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """Every rank's heads, along the heads axis of `per_head` (``[..., heads here, last]``: results, or the
        output projection's columns), in transformers' head order: rank r holds a contiguous run of the heads
        and their columns of the row-parallel output projection, so the ranks' concatenation is the whole.
        Every rank reads head_results at the same place and joins the gather."""
        world, _ = tensor_parallel()
        if world == 1:
            return per_head

        return tensor_model_parallel_all_gather(per_head.contiguous(), dim=per_head.dim() - 2)

    def head_count(self, name: str) -> int:
        """How many heads `name` has on this rank (under tensor parallelism, this rank's share)."""
        layer = self.kernel_layer()
        return layer.num_kv_heads if name in ("keys", "values") else layer.num_heads

    def kv_replicas(self) -> int:
        """How many ranks hold each key/value head: more than one where the ranks outnumber the kv heads."""
        world, _ = tensor_parallel()
        total = getattr(seam.module_of(self), "total_num_kv_heads", None)
        if world == 1 or not total or total >= world:
            return 1
        return world // total

    def whole_heads(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's heads of a flat ``[tokens, local width]`` tensor, in transformers' head order.

        vLLM shards an attention by heads, rank r holding a contiguous run of
        them, so the ranks' concatenation is the whole; where kv heads are
        replicated over ranks, one copy of each is kept. Every rank of the
        engine reads the value at the same place, so every rank joins the
        gather. On one rank the tensor is returned as it is.
        """
        world, _ = tensor_parallel()
        if world == 1:
            return tensor

        whole = tensor_model_parallel_all_gather(tensor.contiguous(), dim=-1)
        replicas = self.kv_replicas() if name in ("keys", "values") else 1
        if replicas > 1:
            whole = torch.cat(whole.chunk(world, dim=-1)[::replicas], dim=-1)
        return whole

    def rank_heads(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        """`whole_heads`' inverse: this rank's share of a flat ``[tokens, whole width]`` tensor."""
        world, rank = tensor_parallel()
        if world == 1:
            return whole
        replicas = self.kv_replicas() if name in ("keys", "values") else 1
        return whole.chunk(world // replicas, dim=-1)[rank // replicas]

    def pre_rotary_layout(self, name: str) -> str:
        """How the model holds value `name`: "bhsd" (transformers' rotary in the Transformers backend), "normed"
        (a q/k norm's output, `BACKEND_NORMS`, or input, the projected values) or "flat"."""
        if name in PROJECTED:
            if self.projection_norm(name) is not None:
                return "normed"
            name = pre_rotary_of(name)
        rotary = self.rotary_call() if name in PRE_ROTARY else None
        return rotary[2] if rotary is not None else "flat"

    def internals_to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        layout = self.pre_rotary_layout(name)
        if layout == "bhsd":  # [1, heads, tokens, head_dim]: flat, as the layer's
            tensor = tensor[0].transpose(0, 1).flatten(-2)
        elif layout == "normed":  # a norm's output, [1, tokens, width] or [tokens, heads, head_dim]
            tensor = tensor.reshape(-1, self.head_count(unrotated_of(name)) * self.kernel_layer().head_size)
        name = unrotated_of(name)
        if tensor.dim() == 3 and tensor.shape[0] == 1:  # [1, tokens, width]: flat already, with a batch
            tensor = tensor[0]
        head_dim = tensor.shape[-1] // self.head_count(name)
        heads = self.whole_heads(tensor, name).unflatten(-1, (-1, head_dim))  # [tokens, heads, head_dim]
        if self.CHANNELS_PERMUTED and name in ("queries", "keys"):
            heads = pairs_first(heads)
        if name == "head_outputs":
            return heads.unsqueeze(0)
        return heads.transpose(0, 1).unsqueeze(0)

    def internals_to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        layout = self.pre_rotary_layout(name)
        name = unrotated_of(name)
        heads = value[0] if name == "head_outputs" else value[0].transpose(0, 1)  # [tokens, heads, head_dim]
        if self.CHANNELS_PERMUTED and name in ("queries", "keys"):
            heads = halves_first(heads)
        flat = self.rank_heads(heads.flatten(-2), name)
        if layout == "bhsd":
            return flat.unflatten(-1, (live.shape[1], -1)).transpose(0, 1).reshape(live.shape)
        return flat.reshape(live.shape)

    # Scores, over the whole prefix.

    def layer_spec(self) -> attention.Spec:
        """What the layer computes between queries and keys, from the layer and its implementation.

        (Not transformers' ``spec(inputs)``, which reads one kernel call's keywords: vLLM's layer states it.)
        """
        layer = self.kernel_layer()
        impl = layer.impl
        softcap = getattr(impl, "logits_soft_cap", None) or None
        window = getattr(layer, "sliding_window", None)
        if window is None or window < 0:
            window = None
        slopes = getattr(impl, "alibi_slopes", None)
        if slopes is not None and not isinstance(slopes, torch.Tensor):
            slopes = torch.tensor(slopes, dtype=torch.float32)
        scale = 1.0 if self.QUERIES_SCALED else float(impl.scale)
        chunk = getattr(layer, "attention_chunk_size", None)
        return attention.Spec(scale=scale, softcap=softcap, sliding_window=window, chunk_size=chunk,
                              alibi_slopes=slopes)

    def _step(self) -> tuple[dict, int]:
        """This request's record of this layer's earlier steps, and the step the model is at."""
        location = f"{self.__dict__[KERNEL_LAYER].path}.{INPUT}"
        mediator = seam.mediator_at(location)
        history = mediator.__dict__.setdefault(HISTORY, {}).setdefault(location, {})
        return history, seam.step_of(mediator, location)

    def remember(self, raw: Any) -> None:
        """Keep this step's keys (as the layer receives them now, edits included) for later decode steps."""
        history, step = self._step()
        keys = type(self).keys
        with torch.inference_mode(False):
            history[step] = keys.user_view(self, raw).detach().float().clone()

    def scores_so_far(self, raw: Any, name: str) -> torch.Tensor:
        """`scores` of this step's queries over every key of the request so far."""
        kind = type(self)
        queries = kind.queries.user_view(self, raw)
        keys = kind.keys.user_view(self, raw)
        history, step = self._step()
        missing = [earlier for earlier in range(step) if earlier not in history]
        if missing:
            raise ValueError(MISSING_STEPS.format(where=self.where(), name=name, step=step,
                                                  missing=", ".join(map(str, missing))))
        keys = torch.cat([*(history[earlier] for earlier in range(step)), keys.float()], dim=-2)
        total, new = keys.shape[-2], queries.shape[-2]
        key_positions = torch.arange(total, device=keys.device)
        return attention.scores(queries, keys, self.layer_spec(), key_positions[total - new:], key_positions)


def _internals_part(token: str) -> tuple[str, tuple[type, ...], Callable[[type], dict]]:
    return "Vllm", (VllmAttentionInternals,), lambda kind: {}


#: The attentions composed here, importable as ``streamscope.vllm.attention.<qualified name>`` in every process.
ATTENTIONS = Composer(__name__, _internals_part)


def __getattr__(name: str) -> type:
    return ATTENTIONS.rebuild(name)


def attention_kind(kind: type) -> type:
    """The envoy class of an engine-neutral attention `kind` (`blocks.Attention`, `blocks.PostNormedAttention`, a
    family's) on vLLM: its internals read at vLLM's attention layer. A kind that has them already is itself."""
    if issubclass(kind, VllmAttentionInternals):
        return kind
    return ATTENTIONS.compose("AttentionLayer", kind)


#: A softmax attention on vLLM (`self_attn`): its output, and its internals read at vLLM's attention layer
#: (`blocks.Attention.reason` asks `kernel_reason` whether the layer is there). A family's own vLLM attention
#: derives from it.
VllmAttention = attention_kind(blocks.Attention)

__all__ = ["Flat", "PreRotary", "Projected", "Recomputed", "VllmAttention", "VllmAttentionInternals", "attention_kind",
           "halves_first", "pairs_first"]
