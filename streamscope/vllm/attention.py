"""The inside of a softmax attention on vLLM: queries, keys, values, scores, pattern and head outputs.

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
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Protocol

import torch

from .. import attention
from .. import blocks
from .. import nnsight_seam as seam
from ..blocks.composed import Composer
from ..blocks.heads import READ_ONLY
from ..values import INPUT, OUTPUT, Host, ReadOnly, StreamValue

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
    from vllm.distributed import parallel_state

    if parallel_state._TP is None:
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


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
        from vllm.model_executor.layers.attention import Attention as VllmAttentionLayer

        layer = getattr(seam.module_of(self), "_modules", {}).get(KERNEL_LAYER)
        if layer is None:
            return NO_LAYER.format(name=KERNEL_LAYER)
        if not isinstance(layer, VllmAttentionLayer):
            return OTHER_LAYER.format(name=KERNEL_LAYER, kind=type(layer).__name__)
        return None

    def relocated(self) -> dict:
        return {}

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
        from vllm.distributed import tensor_model_parallel_all_gather

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
        from vllm.distributed import tensor_model_parallel_all_gather

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

    def internals_to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
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
        heads = value[0] if name == "head_outputs" else value[0].transpose(0, 1)  # [tokens, heads, head_dim]
        if self.CHANNELS_PERMUTED and name in ("queries", "keys"):
            heads = halves_first(heads)
        return self.rank_heads(heads.flatten(-2), name).reshape(live.shape)

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

__all__ = ["Flat", "Recomputed", "VllmAttention", "VllmAttentionInternals", "attention_kind",
           "halves_first", "pairs_first"]
