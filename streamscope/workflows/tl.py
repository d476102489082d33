"""TransformerLens 4.3's ActivationCache, method for method, over a streamscope `Cache`.

`streamscope.Cache` inherits `TransformerLensCache`: a TransformerLens notebook's
cache calls (``cache["pattern", 3]``, ``cache.accumulated_resid(apply_ln=True)``,
``cache.decompose_resid(layer=2, mode="attn")``) give
TransformerLens 4.3's numbers for a `TransformerBridge` booted with its default
(unprocessed) weights, which is HookedTransformer with ``fold_ln=False``,
``center_writing_weights=False``, ``center_unembed=False``. Where streamscope
offers another convention (the final norm's weight applied, as TransformerLens
gives it with ``fold_ln=True``), it is an explicit argument; but
``cache.logit_attrs`` by default splits the model's own logit (weight, head
scale and a bias row: they sum to it), and ``convention="transformer_lens"``
gives TransformerLens's numbers. ``docs/transformerlens.md``
tabulates every name.

Norm scales (``ln1.hook_scale``, ``ln2.hook_scale``, ``ln_final.hook_scale``) are
computed from the stream each norm reads, ``sqrt(mean(x'^2) + eps)`` with ``x'``
centred for a layer norm: the block norms are assumed to share the final norm's
form and epsilon (one config field states both in every family served).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from ..engine import check_padding_side, encode, padded, prepends_bos
from ..errors import Unavailable

#: What a ``pos_slice``, ``batch_slice`` or ``neuron_slice`` argument takes (`as_index`); ``Any`` admits
#: TransformerLens's own ``Slice``, read by duck typing.
SliceInput = Union[None, int, tuple, slice, list, torch.Tensor, Any]

#: TransformerLens's shorthand (`get_act_name`) aliases.
_ACT_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
                "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
_LAYER_TYPE_ALIASES = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}
_ATTN_NAMES = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores", "attn_in")
_MLP_NAMES = ("pre", "post", "mid", "pre_linear")


def act_name(name: str, layer: Optional[int] = None, layer_type: Optional[str] = None) -> str:
    """The full TransformerLens hook name of a shorthand, as TransformerLens 4.3's ``utilities.get_act_name``.

    ``act_name("pattern", 3) == "blocks.3.attn.hook_pattern"``; ``act_name("scale", 2, "ln1")``
    is ``"blocks.2.ln1.hook_scale"``; ``act_name("scale")`` is ``"ln_final.hook_scale"``.
    """
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    match = re.match(r"([a-z_]+?)(\d+)([a-z]?.*)$", name)
    if match is not None and layer is None:
        name, layer, layer_type = match.group(1), int(match.group(2)), match.group(3) or None
    name = _ACT_ALIASES.get(name, name)
    full = "" if layer is None else f"blocks.{layer}."
    if name in _ATTN_NAMES:
        layer_type = "attn"
    elif name in _MLP_NAMES:
        layer_type = "mlp"
    elif layer_type in _LAYER_TYPE_ALIASES:
        layer_type = _LAYER_TYPE_ALIASES[layer_type]
    if layer_type:
        full += f"{layer_type}."
    full += f"hook_{name}"
    if name in ("scale", "normalized") and layer is None:
        full = f"ln_final.{full}"
    return full


def as_index(index: Any, argument: str = "pos_slice") -> Any:
    """`index` as TransformerLens 4.3's ``Slice(index)`` reads it, in a form torch indexes with: None (every
    entry), an int (one entry, the axis dropped), a `slice`, or a long or bool tensor of entries.

    Takes what TransformerLens's ``Slice`` takes: None, an int (a numpy integer or a 0-d integer tensor counts as
    one), a ``(stop,)``, ``(start, stop)`` or ``(start, stop, step)`` tuple, a `slice`, a list, tensor or numpy
    array of indices (booleans: a mask), and a TransformerLens ``Slice`` itself, read by its ``mode`` and
    ``slice`` attributes (duck typing: streamscope does not import TransformerLens). Anything else is refused
    with a `ValueError` naming `argument`.
    """
    if _is_tl_slice(index):
        mode, chosen = index.mode, index.slice
        if mode == "identity":
            return None
        if mode == "int":
            return int(chosen)
        if mode == "slice":
            return chosen
        if mode == "array":
            return _index_tensor(chosen, argument)
        raise ValueError(f"{argument}: a TransformerLens Slice of mode {mode!r}, which streamscope does not know "
                         f"(it reads 'identity', 'int', 'slice' and 'array'): pass the indices themselves")
    if index is None or isinstance(index, slice):
        return index
    scalar = _integer(index)
    if scalar is not None:
        return scalar
    if isinstance(index, tuple):
        if not 1 <= len(index) <= 3 or not all(item is None or _integer(item) is not None for item in index):
            raise ValueError(f"{argument}={index!r}: a tuple is (stop,), (start, stop) or (start, stop, step) of "
                             f"ints, as TransformerLens's Slice reads it")
        return slice(*(None if item is None else _integer(item) for item in index))
    if isinstance(index, (list, torch.Tensor)) or type(index).__module__ == "numpy":
        return _index_tensor(index, argument)
    raise ValueError(f"{argument}={index!r:.80}: give None, an int, a (start, stop[, step]) tuple, a slice, a list "
                     f"or tensor of indices, or a TransformerLens Slice")


def keep_axis(index: Any) -> Any:
    """TransformerLens 4.3's ``Slice.unwrap``: a plain int (a numpy integer, a 0-d tensor) becomes ``[int]``, so
    the axis stays with one entry; a TransformerLens ``Slice(int)`` is left as it is, and drops the axis. What
    ``run_with_cache(pos_slice=...)`` and ``stack_neuron_results(neuron_slice=...)`` do with an int."""
    if not _is_tl_slice(index) and _integer(index) is not None:
        return [_integer(index)]
    return index


def _is_tl_slice(index: Any) -> bool:
    return hasattr(index, "mode") and hasattr(index, "slice") and not isinstance(index, torch.Tensor)


def _integer(value: Any) -> Optional[int]:
    """The int of an integer scalar (Python, numpy, or a 0-d integer tensor), else None; a bool is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.dtype.is_floating_point and not value.dtype.is_complex \
                and value.dtype != torch.bool:
            return int(value)
        return None
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "dtype") \
            and value.dtype.kind in "iu":
        return int(value)
    return None


def _index_tensor(index: Any, argument: str) -> torch.Tensor:
    """A list, tensor or numpy array of indices as a long tensor (a bool one stays a mask)."""
    tensor = torch.as_tensor(index)
    if tensor.numel() == 0:
        return tensor.to(torch.long)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise ValueError(f"{argument}: indices must be integers (or booleans, a mask), not {tensor.dtype}")
    return tensor if tensor.dtype == torch.bool else tensor.to(torch.long)


def apply_slice(tensor: torch.Tensor, index: Any, dim: int) -> torch.Tensor:
    """`tensor` sliced along `dim` as TransformerLens's ``Slice(index).apply(tensor, dim)`` (`as_index`): None
    keeps all, an int drops the axis, a tuple is ``slice(*tuple)``, a list or tensor picks those indices."""
    index = as_index(index)
    if index is None:
        return tensor
    where: list[Any] = [slice(None)] * tensor.dim()
    where[dim] = index
    return tensor[tuple(where)]


class NormForm:
    """A norm's form, enough to compute its scale on a stream: centred (layer norm) or not (RMS), and epsilon."""

    def __init__(self, centred: bool, eps: float) -> None:
        self.centred, self.eps = centred, eps

    def centre(self, stream: torch.Tensor) -> torch.Tensor:
        return stream - stream.mean(-1, keepdim=True) if self.centred else stream

    def scale(self, stream: torch.Tensor) -> torch.Tensor:
        """``[..., 1]``: ``sqrt(mean(x'^2) + eps)``, TransformerLens's ``hook_scale``."""
        return (self.centre(stream.float()).pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


class TransformerLensCache:
    """TransformerLens 4.3's ActivationCache methods; mixed into `streamscope.Cache` (which supplies the state)."""

    stored: dict[str, torch.Tensor]
    #: The keys of `stored` computed after the run (per-head results), which `keys` lists by their TL names only.
    derived: set[str]
    num_layers: int
    final_norm: Any
    tokens: torch.Tensor
    mask: torch.Tensor
    logits: Optional[torch.Tensor]
    model_type: str
    has_batch_dim: bool
    #: Per block: the stream its attention norm (``ln1``) and MLP norm (``ln2``) read, or the reason it has none.
    norm_inputs: dict[int, dict[str, str]]
    _unembedding: Any
    _head: Any  # the engine's head_parameters: (bias, scale, soft cap) after the unembedding's matrix
    _tokenizer: Any
    #: The streamscope model the cache was run on (TL's ``cache.model``; None for a cache built without one).
    model: Any

    def keys(self) -> list[str]:  # supplied by Cache
        raise NotImplementedError

    def __getitem__(self, key: Any) -> torch.Tensor:  # supplied by Cache
        raise NotImplementedError

    def __contains__(self, key: object) -> bool:  # supplied by Cache
        raise NotImplementedError

    # Keys.

    def tl_key(self, key: Any) -> str:
        """The full hook name of a TransformerLens key: a name, a shorthand, or ``(name, layer[, layer_type])``.

        A negative layer counts from the end, as TransformerLens 4.3's ``cache["pattern", -1]``.
        """
        if isinstance(key, str):
            return key
        name, layer, layer_type = (*key, None, None)[:3]
        if layer is not None and layer < 0:
            layer += self.num_layers
        return act_name(name, layer, layer_type)

    # Norm scales, computed from the stream each norm reads.

    @property
    def norm_form(self) -> NormForm:
        if self.final_norm is None:
            raise ValueError("this cache has no final norm: model.cache reads it with the last block's layer_output "
                             "and final_norm_output (values=None reads both)")
        return NormForm(self.final_norm.centred, self.final_norm.eps)

    def norm_input(self, layer: int, mlp_input: bool = False) -> torch.Tensor:
        """The stream block `layer`'s attention norm (or MLP norm, `mlp_input`) reads; the final stream at num_layers."""
        if layer == self.num_layers:
            return self[f"layers.{self.num_layers - 1}.layer_output"]
        norm = "ln2" if mlp_input else "ln1"
        source = self.norm_inputs.get(layer, {}).get(norm)
        if source is None or not source.startswith("layers."):
            raise Unavailable(f"{norm}.hook_scale", f"blocks.{layer}",
                              source or "this cache does not know which stream the norm reads")
        return self[source]

    def norm_scale(self, layer: Optional[int] = None, mlp_input: bool = False) -> torch.Tensor:
        """``[batch, seq, 1]``: TransformerLens's ``blocks.{layer}.ln{1,2}.hook_scale`` (``ln_final`` at num_layers)."""
        layer = self._layer(layer)
        return self.norm_form.scale(self.norm_input(layer, mlp_input))

    def _layer(self, layer: Optional[int]) -> int:
        if layer is None or layer == -1:
            return self.num_layers
        if not -self.num_layers <= layer <= self.num_layers:
            raise IndexError(f"layer {layer} is outside 0..{self.num_layers} (num_layers means after the last block)")
        return layer if layer >= 0 else layer + self.num_layers

    # TransformerLens's ActivationCache methods.

    def stack_activation(self, activation_name: str, layer: int = -1,
                         sublayer_type: Optional[str] = None) -> torch.Tensor:
        """``[layers, ...]``: the TransformerLens activation of every block before `layer` (-1: all), as TL 4.3."""
        end = self._layer(layer)
        return torch.stack([self[self.tl_key((activation_name, index, sublayer_type))] for index in range(end)])

    def accumulated_resid(self, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: SliceInput = None, mlp_input: bool = False, return_labels: bool = False,
                          frozen_final_scale: bool = False) -> Any:
        """``[components, batch, seq, hidden]``: the stream entering each block up to `layer`, as TL 4.3.

        Block i's ``layer_input`` (``{i}_pre``) for i <= `layer`, each ``layer_mid``
        before `layer` when `incl_mid` (and block `layer`'s when `mlp_input`); at
        `layer` = None, -1 or num_layers the last entry is the final stream
        (``final_post``). `pos_slice` slices positions.

        `apply_ln` as TransformerLens 4.3: at the final stream, each component
        through the final norm with its own statistics (weight and bias applied,
        the logit lens); at `layer` = k < num_layers, centred (layer norm) and
        divided by block k's ``ln1.hook_scale`` (``ln2`` with `mlp_input`), no
        weight. `frozen_final_scale` (streamscope's earlier default; TransformerLens
        ``apply_ln_to_stack(recompute_ln=False)`` with ``fold_ln=True``) instead
        divides every component by the final stream's scale and applies the weight.
        """
        end = self._layer(layer)
        parts, labels = [], []
        for index in range(end + 1):
            if index == self.num_layers:
                parts.append(self[f"layers.{self.num_layers - 1}.layer_output"])
                labels.append("final_post")
                continue
            parts.append(self[f"layers.{index}.layer_input"])
            labels.append(f"{index}_pre")
            if (incl_mid and index < end) or (mlp_input and index == end):
                parts.append(self[f"layers.{index}.layer_mid"])
                labels.append(f"{index}_mid")
        stack = torch.stack([apply_slice(part, pos_slice, -2) for part in parts])
        if apply_ln:
            if frozen_final_scale:
                stack = self.apply_ln_to_stack(stack, end, mlp_input, pos_slice, norm_weight=True)
            else:
                stack = self.apply_ln_to_stack(stack, end, mlp_input, pos_slice, has_batch_dim=self.has_batch_dim,
                                               recompute_ln=end == self.num_layers)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, layer: Optional[int] = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: SliceInput = None, incl_embeds: bool = True,
                        return_labels: bool = False) -> Any:
        """``[components, batch, seq, hidden]``: what the stream entering block `layer` is the sum of, as TL 4.3.

        ``embed`` (the token embeddings) and ``pos_embed`` (learned position
        embeddings, GPT-2 and OPT) when `incl_embeds`, then ``{i}_attn_out`` and
        ``{i}_mlp_out`` of each block before `layer` (`mode` "attn" or "mlp"
        keeps one kind), and block `layer`'s attention when `mlp_input`. They sum
        to block `layer`'s ``layer_input`` (num_layers, the default: the final
        stream). `apply_ln` divides by the target norm's cached scale
        (`apply_ln_to_stack`). Note that TL 4.3's default is
        ``return_labels=False``. A post-norm block (OLMo 2) adds no contribution
        unchanged and raises `Unavailable` with the reason; a block with one
        sublayer (Mamba) contributes its mixer only.
        """
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode must be 'all', 'attn' or 'mlp', not {mode!r}")
        end = self._layer(layer)
        parts, labels = [], []
        if incl_embeds:
            parts.append(self["token_embeddings"])
            labels.append("embed")
            if "hook_pos_embed" in self:
                parts.append(self["hook_pos_embed"])
                labels.append("pos_embed")
        wanted = {"attn": ("attention_output",), "mlp": ("mlp_output",)}.get(mode, ("attention_output", "mlp_output"))
        for index in range(end + (1 if mlp_input else 0)):
            for short, label in (("attention_output", "attn_out"), ("mlp_output", "mlp_out")):
                if short not in wanted or (index == end and short == "mlp_output"):
                    continue
                try:
                    parts.append(self[f"layers.{index}.{short}"])
                except Unavailable as error:
                    if short == "mlp_output" and error.code in ("missing_module", "one_sublayer"):
                        continue  # a block with one sublayer (Mamba's mixer) adds no MLP: nothing is missing
                    raise
                labels.append(f"{index}_{label}")
        if not parts:
            raise ValueError(f"decompose_resid(layer={layer}, mode={mode!r}, incl_embeds={incl_embeds}) selects no "
                             "component: include the embeddings or a later layer")
        stack = torch.stack([apply_slice(part, pos_slice, -2) for part in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, end, mlp_input, pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: Optional[int] = None, mlp_input: bool = False,
                          pos_slice: SliceInput = None, batch_slice: SliceInput = None, has_batch_dim: bool = True,
                          recompute_ln: bool = False, norm_weight: bool = False) -> torch.Tensor:
        """Each component of `residual_stack` as block `layer`'s norm sees it, as TL 4.3.

        Default: centred (layer norm) and divided by the scale the norm
        computed on the whole stream, block `layer`'s ``ln1.hook_scale``
        (``ln2`` with `mlp_input`; ``ln_final`` at None, -1 or num_layers), no
        weight or bias: linear, so the components still sum. `recompute_ln` at
        the final layer applies the final norm to each component with its own
        statistics, weight and bias (TL's logit lens). `pos_slice` and
        `batch_slice` are applied to the scale (and `batch_slice` to the stack),
        the stack assumed already sliced in positions.

        `norm_weight` (streamscope's convention; TL 4.3 with ``fold_ln=True``,
        whose unembedding carries the weight) multiplies the frozen result by the
        norm's weight (Gemma's ``1 + w``): then the components' results sum to
        the norm's output less its bias. Only at the final norm.
        """
        pos_slice, batch_slice = as_index(pos_slice), as_index(batch_slice, "batch_slice")
        end = self._layer(layer)
        if has_batch_dim:
            residual_stack = apply_slice(residual_stack, batch_slice, 1)
        if recompute_ln and end == self.num_layers:
            if self.final_norm is None:
                raise ValueError("this cache has no final norm parameters: read layer_output and final_norm_output")
            return self.final_norm(residual_stack)
        form = self.norm_form
        scale = apply_slice(self.norm_scale(end, mlp_input), pos_slice, -2)
        if self.has_batch_dim:  # as TL 4.3: the scale keeps the cache's batch axis, sliced like the stack
            scale = apply_slice(scale, batch_slice, 0)
        out = form.centre(residual_stack) / scale
        if norm_weight:
            if end != self.num_layers:
                raise ValueError("norm_weight applies the final norm's weight: layer must be the final one")
            out = out * (self.final_norm.weight if self.final_norm.weight is not None else 1)
        return out

    def tokens_to_residual_directions(self, tokens: Any) -> torch.Tensor:
        """``[*tokens.shape, hidden]``: the unembedding row of each token (an id, a string, or a tensor of ids)."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        ids = torch.as_tensor(tokens, dtype=torch.long)
        if self._unembedding is None:
            raise ValueError("this cache was built without access to the model's unembedding")
        return self._unembedding(ids.reshape(-1)).reshape(*ids.shape, -1)

    #: `logit_attrs`'s conventions: the model's own logit (the default) and TransformerLens 4.3's numbers.
    LOGIT_CONVENTIONS = ("logit", "transformer_lens")

    def logit_attrs(self, residual_stack: torch.Tensor, tokens: Any, incorrect_tokens: Any = None,
                    pos_slice: SliceInput = None, batch_slice: SliceInput = None, has_batch_dim: bool = True,
                    convention: str = "logit", norm_weight: Optional[bool] = None) -> torch.Tensor:
        """Each component's direct effect on the logit of `tokens` (less `incorrect_tokens`'s).

        `residual_stack` is ``[components, batch, seq, hidden]`` (or without
        batch, `has_batch_dim` False), `decompose_resid`'s parts say; each
        component is divided by the final stream's scale (the final norm's
        statistics frozen: `apply_ln_to_stack` with `pos_slice`, `batch_slice`)
        and projected on the unembedding rows of `tokens`: a string or id (one
        token everywhere), ``[batch]`` ids (one per prompt, over every
        position), or ``[batch, pos]`` ids (one per prompt and position; ``[1,
        pos]`` shares them over the batch). A ``[n]`` tensor whose n is not the
        batch picks a token per position.

        `convention` ``"logit"`` (the default) gives the model's own logit,
        split: each component is also multiplied by the final norm's weight
        (Gemma's ``1 + w``) and by the head's linear scale (Cohere's
        ``logit_scale``, Granite's ``1 / logits_scaling``), and one more row
        is appended, the constant part that no component writes (label it
        ``"bias"``): the final norm's bias through the unembedding plus the
        head's own bias (GPT-J), times the scale; zero where the model has
        neither. Returns ``[components + 1, batch, seq]``; summed over
        ``decompose_resid()``'s parts and the bias row, it is the model's
        logit (its logit difference with `incorrect_tokens`) to float
        precision. A soft cap (Gemma 2's ``tanh(z / cap) * cap``) is not
        linear, so there the rows sum to the logit before the cap,
        ``cap * atanh(logit / cap)``.

        `convention` ``"transformer_lens"`` gives TransformerLens 4.3's numbers
        on unprocessed weights: the frozen scale only (no norm weight, no bias
        row, no head scale), ``[components, batch, seq]``. There `norm_weight`
        True applies the final norm's weight (TL with ``fold_ln=True``, whose
        unembedding carries it); the ``"logit"`` convention always applies it
        and refuses the argument.
        """
        if convention not in self.LOGIT_CONVENTIONS:
            raise ValueError(f"convention={convention!r}: choose 'logit' (the parts and a bias row sum to the "
                             f"model's logit) or 'transformer_lens' (TransformerLens 4.3's numbers)")
        if convention == "logit" and norm_weight is not None:
            raise ValueError("norm_weight= belongs to convention='transformer_lens' (TL with fold_ln=True): the "
                             "default convention='logit' always applies the final norm's weight. Drop norm_weight=, "
                             "or pass convention='transformer_lens', norm_weight=True")
        pos_slice, batch_slice = as_index(pos_slice), as_index(batch_slice, "batch_slice")
        token_ids = self._logit_token_ids(tokens)
        wrong_ids = None if incorrect_tokens is None else self._logit_token_ids(incorrect_tokens)
        directions = self.tokens_to_residual_directions(token_ids)
        if wrong_ids is not None:
            wrong = self.tokens_to_residual_directions(wrong_ids)
            if wrong.shape != directions.shape:
                raise ValueError(f"tokens and incorrect_tokens must have the same shape (tokens give "
                                 f"{tuple(directions.shape[:-1])}, incorrect_tokens {tuple(wrong.shape[:-1])})")
            directions = directions - wrong
        model_logit = convention == "logit"
        scaled = self.apply_ln_to_stack(residual_stack, -1, pos_slice=pos_slice, batch_slice=batch_slice,
                                        has_batch_dim=has_batch_dim, norm_weight=model_logit or bool(norm_weight))
        batch_int = isinstance(batch_slice, int)
        per_prompt = (has_batch_dim and not batch_int and scaled.dim() == 4 and directions.dim() == 2
                      and directions.shape[0] == scaled.shape[1])
        if per_prompt:
            directions = directions.unsqueeze(-2)  # one token per prompt: broadcast over positions, not the batch
        parts = (scaled * directions.to(scaled.dtype)).sum(-1)
        if not model_logit:
            return parts
        bias_part, scale = self._logit_constant(directions, token_ids, wrong_ids, per_prompt)
        bias_row = torch.broadcast_to(bias_part.to(parts.device, parts.dtype), parts.shape[1:])
        return torch.cat([parts * scale, (bias_row * scale).unsqueeze(0)])

    def _logit_token_ids(self, tokens: Any) -> torch.Tensor:
        """`tokens` (an id, a string, a tensor or list of ids) as a long tensor of ids."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        return torch.as_tensor(tokens, dtype=torch.long)

    def _logit_constant(self, directions: torch.Tensor, token_ids: torch.Tensor, wrong_ids: Optional[torch.Tensor],
                        per_prompt: bool) -> tuple[torch.Tensor, float]:
        """The part of the logit no component writes, ``directions``' shape less its last axis, and the head's
        linear scale: the final norm's bias projected on `directions` (the token's unembedding row, less the
        incorrect token's) plus the head's bias of the token (less the incorrect token's)."""
        if self._head is None:
            raise ValueError("this cache was built without access to the model's head: build it with model.cache, "
                             "or use convention='transformer_lens' (no bias row, no head scale)")
        head_bias, scale, _cap = self._head()
        norm_bias = self.final_norm.bias if self.final_norm is not None else None
        constant = torch.zeros(directions.shape[:-1], dtype=torch.float32)
        if norm_bias is not None:
            constant = constant + directions.float().cpu() @ norm_bias.float().cpu()
        if head_bias is not None:
            def biases(ids: torch.Tensor) -> torch.Tensor:
                found = head_bias.float().cpu()[ids.reshape(-1)].reshape(ids.shape)
                return found.unsqueeze(-1) if per_prompt else found
            constant = constant + biases(token_ids) - (biases(wrong_ids) if wrong_ids is not None else 0)
        return constant, float(scale)

    # Per-head results: each head's output after the output projection, from head_outputs and its weights.

    _output_weights: Optional[Callable[[], list]]
    _weights_read: Optional[list]

    def output_weights(self, layer: int) -> torch.Tensor:
        """``[heads, head_dim, hidden]``: block `layer`'s output projection split per head (TL's ``W_O``).

        Read from the model (on vLLM, from its worker) once per cache, all blocks at once.
        """
        if self._weights_read is None:
            if self._output_weights is None:
                raise ValueError("this cache was built without access to the model's output projections")
            self._weights_read = self._output_weights()
        weight = self._weights_read[layer]
        if isinstance(weight, str):
            raise Unavailable("attn.hook_result", f"blocks.{layer}", weight)
        z = self[f"layers.{layer}.self_attn.head_outputs"]
        heads, head_dim = z.shape[-2:]
        # A Linear's weight is [hidden, heads * head_dim]; the input's columns are head-major.
        return weight.reshape(weight.shape[0], heads, head_dim).permute(1, 2, 0)

    def head_results(self, layer: int) -> torch.Tensor:
        """``[batch, seq, heads, hidden]``: each head's contribution to the stream at block `layer`, TL's
        ``attn.hook_result``: ``head_outputs @ W_O[head]``, without the projection's bias (TL 4.3 keeps it out too:
        the block's attention output is the heads' sum plus that bias). Computed once, then kept."""
        key = f"layers.{layer}.self_attn.head_results"
        if key not in self.stored:
            z = self[f"layers.{layer}.self_attn.head_outputs"]
            weights = self.output_weights(layer).to(z.device)
            self.stored[key] = torch.einsum("...hd,hdm->...hm", z.to(weights.dtype), weights)
            self.derived.add(key)
        return self.stored[key]

    def compute_head_results(self) -> None:
        """Compute every block's ``attn.hook_result`` (`head_results`) and keep it in the cache, as TL 4.3."""
        for layer in range(self.num_layers):
            self.head_results(layer)

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: SliceInput = None, apply_ln: bool = False) -> Any:
        """``[blocks * heads (+1), batch, seq, hidden]``: every head's result before block `layer`, as TL 4.3.

        Labels ``L{layer}H{head}``; `incl_remainder` adds the stream less the
        heads' sum (``remainder``); `apply_ln` as `apply_ln_to_stack` at `layer`.
        """
        end = self._layer(layer)
        parts, labels = [], []
        for index in range(end):
            results = apply_slice(self.head_results(index), pos_slice, -3)
            parts.append(results.movedim(-2, 0))
            labels += [f"L{index}H{head}" for head in range(results.shape[-2])]
        if parts:
            stack = torch.cat(parts)
        else:
            embed = apply_slice(self["token_embeddings"], pos_slice, -2)
            stack = embed.new_zeros(0, *embed.shape)
        if incl_remainder:
            if end == 0:
                raise ValueError("stack_head_results(layer=0, incl_remainder=True): there is no stream before "
                                 "block 0 to take the heads from")
            stream = apply_slice(self[f"layers.{end - 1}.layer_output"], pos_slice, -2)
            stack = torch.cat([stack, (stream - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, end, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    # Per-neuron results: each neuron's activation times its row of the MLP's down projection.

    _down_weights: Optional[Callable[[], list]]
    _down_read: Optional[list]

    def neuron_weights(self, layer: int) -> torch.Tensor:
        """``[intermediate_size, hidden]``: block `layer`'s MLP down projection (TL's ``W_out``), scaled as the
        block scales the MLP's output (Granite's residual multiplier, TL's ``residual_contribution_scale``).

        Read from the model (on vLLM, from its worker, every rank's columns) once per cache, all blocks at once.
        """
        if self._down_read is None:
            if self._down_weights is None:
                raise ValueError("this cache was built without access to the model's MLP down projections")
            self._down_read = self._down_weights()
        weight = self._down_read[layer]
        if isinstance(weight, str):
            raise Unavailable("mlp.hook_post", f"blocks.{layer}", weight)
        return weight.t()

    def get_neuron_results(self, layer: int, neuron_slice: SliceInput = None, pos_slice: SliceInput = None,
                           project_output_onto: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[batch, seq, neurons, hidden]``: what each neuron of block `layer` adds to the stream, as TL 4.3:
        ``neurons[..., n] * W_out[n]`` (the down projection's bias left out, as TL leaves it). `neuron_slice`
        and `pos_slice` pick neurons and positions; `project_output_onto` (``[hidden]`` or ``[hidden, k]``)
        projects each result, the last axis then dropped or ``k``."""
        pos_slice, neuron_slice = as_index(pos_slice), as_index(neuron_slice, "neuron_slice")
        acts = self[f"blocks.{layer}.mlp.hook_post"]
        weights = self.neuron_weights(layer).to(acts.device)
        acts = apply_slice(acts, pos_slice, -2)
        acts = apply_slice(acts, neuron_slice, -1)
        weights = apply_slice(weights, neuron_slice, 0)
        acts = acts.to(weights.dtype)
        if project_output_onto is None:
            return acts[..., None] * weights
        projected = weights @ project_output_onto.to(weights)
        return acts * projected if project_output_onto.dim() == 1 else acts[..., None] * projected

    def stack_neuron_results(self, layer: int, pos_slice: SliceInput = None, neuron_slice: SliceInput = None,
                             return_labels: bool = False, incl_remainder: bool = False, apply_ln: bool = False,
                             project_output_onto: Optional[torch.Tensor] = None, mlp_input: bool = False) -> Any:
        """``[blocks * neurons (+1), batch, seq, hidden]``: every neuron's result before block `layer`, as TL 4.3.

        Labels ``L{layer}N{neuron}``; `layer` None or -1 is every block. `incl_remainder` adds the stream
        block `layer`'s norm reads (``resid_mid`` with `mlp_input`, else ``resid_pre``; at ``layer=0`` the
        last block's output, TL's convention) less the neurons' sum; `apply_ln` as `apply_ln_to_stack`;
        `project_output_onto` as in `get_neuron_results` (applied after the norm). An int `neuron_slice`
        keeps its axis (``[n]``). Every neuron of every block is materialized: for small models or a few
        neurons (`neuron_slice`).
        """
        if layer is None or layer == -1:
            layer = self.num_layers
        if incl_remainder and layer < 0:
            raise ValueError(f"layer must be >= 0 with incl_remainder=True (-1/None mean every block); got {layer}")
        neuron_slice = as_index(neuron_slice, "neuron_slice")
        if isinstance(neuron_slice, int):  # as TL 4.3 (``Slice.unwrap``, an int-mode Slice too): the axis stays
            neuron_slice = [neuron_slice]
        parts, labels = [], []
        for index in range(layer):
            results = self.get_neuron_results(index, neuron_slice=neuron_slice, pos_slice=pos_slice)
            parts.append(results.movedim(-2, 0))
            picked = apply_slice(torch.arange(self.neuron_weights(index).shape[0]), neuron_slice, 0)
            labels += [f"L{index}N{int(neuron)}" for neuron in picked]
        if parts:
            stack = torch.cat(parts)
        else:
            embed = apply_slice(self["token_embeddings"], pos_slice, -2)
            stack = embed.new_zeros(0, *embed.shape)
        if incl_remainder:
            target = self[f"blocks.{layer}.hook_resid_mid" if mlp_input else f"blocks.{(layer - 1) % self.num_layers}.hook_resid_post"]
            target = apply_slice(target, pos_slice, -2).to(stack.dtype)
            stack = torch.cat([stack, (target - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        if project_output_onto is not None:
            projected = stack @ project_output_onto.to(stack)
            stack = projected
        return (stack, labels) if return_labels else stack

    def get_full_resid_decomposition(self, layer: Optional[int] = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False,
                                     pos_slice: SliceInput = None, return_labels: bool = False,
                                     project_output_onto: Optional[torch.Tensor] = None) -> Any:
        """The stream entering block `layer` as every head's result, every neuron's result (each MLP's output
        with ``expand_neurons=False``), ``embed``, ``pos_embed`` and ``bias`` (the projections' biases summed:
        the attentions' output projections', and the MLPs' down projections' where the neurons are expanded),
        as TL 4.3; they sum to the stream.

        `project_output_onto` (``[hidden]`` or ``[hidden, k]``) projects every component (after the norm, with
        `apply_ln`), the last axis then dropped or ``k``, as TL 4.3: the neurons are projected through their
        down projection's rows before they are multiplied out, so the ``[neurons, batch, pos, hidden]`` stack is
        never made (with `apply_ln` each row is centred first: centring and the frozen scale are linear).
        """
        end = self._layer(layer)
        for index in range(min(end + 1, self.num_layers)):
            reason = self.norm_inputs.get(index, {}).get("sandwich")
            if reason is not None:
                raise Unavailable("get_full_resid_decomposition", f"blocks.{index}", reason)
        projection = None
        if project_output_onto is not None:
            hidden = self["token_embeddings"].shape[-1]
            if project_output_onto.dim() not in (1, 2) or project_output_onto.shape[0] != hidden:
                raise ValueError(f"project_output_onto is [hidden_size] or [hidden_size, k] = [{hidden}] or "
                                 f"[{hidden}, k]; got {list(project_output_onto.shape)}")
            projection = project_output_onto[:, None] if project_output_onto.dim() == 1 else project_output_onto

        def finished(stack: torch.Tensor) -> torch.Tensor:  # the norm, then the projection, of whole-width parts
            if apply_ln:
                stack = self.apply_ln_to_stack(stack, end, mlp_input, pos_slice)
            return stack if projection is None else stack @ projection.to(stack)

        heads, labels = self.stack_head_results(end + (1 if mlp_input else 0), return_labels=True,
                                                pos_slice=pos_slice)
        parts = [finished(heads)]
        if end > 0 and expand_neurons and projection is not None:
            neurons, neuron_labels = self._projected_neurons(end, mlp_input, apply_ln, pos_slice, projection)
            parts.append(neurons.to(parts[0].dtype))
            labels = labels + neuron_labels
        elif end > 0 and expand_neurons:
            neurons, neuron_labels = self.stack_neuron_results(end, pos_slice=pos_slice, return_labels=True,
                                                               mlp_input=mlp_input)
            parts.append(finished(neurons.to(heads.dtype)))
            labels = labels + neuron_labels
        elif end > 0:
            mlps, mlp_labels = self.decompose_resid(end, mlp_input=mlp_input, mode="mlp", incl_embeds=False,
                                                   pos_slice=pos_slice, return_labels=True)
            parts.append(finished(mlps))
            labels = labels + mlp_labels
        embeds, embed_labels = self.decompose_resid(0, pos_slice=pos_slice, return_labels=True)
        parts.append(finished(embeds))
        labels = labels + embed_labels
        # What each attention adds beyond its heads' results: its output projection's bias, at every position;
        # with the neurons expanded, what each MLP adds beyond its neurons' results too (its down projection's).
        bias = sum((apply_slice(self[f"layers.{index}.attention_output"], pos_slice, -2)
                    - apply_slice(self.head_results(index), pos_slice, -3).sum(-2)
                    for index in range(end + (1 if mlp_input else 0))), torch.zeros_like(embeds[0]))
        if expand_neurons:
            for index in range(end):
                acts = apply_slice(self[f"blocks.{index}.mlp.hook_post"], pos_slice, -2)
                weights = self.neuron_weights(index).to(acts.device)
                bias = bias + apply_slice(self[f"blocks.{index}.hook_mlp_out"], pos_slice, -2) - acts.to(
                    weights.dtype) @ weights
        parts.append(finished(bias[None]))
        labels.append("bias")
        stack = torch.cat(parts)
        if project_output_onto is not None and project_output_onto.dim() == 1:
            stack = stack.squeeze(-1)
        return (stack, labels) if return_labels else stack

    def _projected_neurons(self, layer: int, mlp_input: bool, apply_ln: bool, pos_slice: SliceInput,
                           projection: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
        """``[blocks * neurons, batch, pos, k]``: every neuron's result before block `layer` projected onto
        `projection` ``[hidden, k]``, normed as `apply_ln_to_stack` norms it where `apply_ln`, and its labels;
        each neuron's down projection row is projected (centred first, with a layer norm's `apply_ln`), then
        multiplied by the neuron's activations, so no ``hidden``-wide result is made."""
        scale = apply_slice(self.norm_scale(layer, mlp_input), pos_slice, -2) if apply_ln else None
        parts, labels = [], []
        for index in range(layer):
            acts = apply_slice(self[f"blocks.{index}.mlp.hook_post"], pos_slice, -2)  # [batch, pos, neurons]
            weights = self.neuron_weights(index).to(acts.device)  # [neurons, hidden]
            if apply_ln:
                weights = self.norm_form.centre(weights)
            rows = weights @ projection.to(weights)  # [neurons, k]
            part = (acts.to(rows.dtype)[..., None] * rows).movedim(-2, 0)  # [neurons, batch, pos, k]
            parts.append(part if scale is None else part / scale.to(part))
            labels += [f"L{index}N{neuron}" for neuron in range(weights.shape[0])]
        return torch.cat(parts), labels

    # TransformerLens's dictionary and global switches.

    @property
    def cache_dict(self) -> "CacheDict":
        """Every key of the cache (`keys`: streamscope's names, then TransformerLens's) and its tensor, as TL 4.3's
        ``cache.cache_dict``: a read-only mapping that computes a TransformerLens value when it is read (a norm's
        scale, a head's result), so reading one name costs that name. ``dict(cache.cache_dict)`` makes them all."""
        return CacheDict(self)

    def toggle_autodiff(self, mode: bool = False) -> None:
        """Turn torch's autograd on or off for the whole process, as TL 4.3: ``torch.set_grad_enabled(mode)``, with
        a logged warning, since it is global state (``torch.no_grad()`` or ``torch.inference_mode()`` as a context
        manager is the local way). The cache's own values never carry gradients: `model.cache` runs without them."""
        logging.getLogger(__name__).warning("Changed the global state, set autodiff to %s", mode)
        torch.set_grad_enabled(mode)

    # Batch handling and devices.

    def to(self, device: Union[str, torch.device]) -> "TransformerLensCache":
        """Move every value (and the tokens, mask and logits) to `device`, in place; returns the cache (as TL)."""
        self.stored = {key: value.to(device) for key, value in self.stored.items()}
        self.tokens, self.mask = self.tokens.to(device), self.mask.to(device)
        if self.logits is not None:
            self.logits = self.logits.to(device)
        return self

    def _map_batch(self, function: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        return {"stored": {key: function(value) for key, value in self.stored.items()},
                "tokens": function(self.tokens), "mask": function(self.mask),
                "logits": None if self.logits is None else function(self.logits)}

    def remove_batch_dim(self) -> "TransformerLensCache":
        """Drop the batch axis of a cache of one prompt, in place (TL 4.3's ``remove_batch_dim``)."""
        if not self.has_batch_dim:
            raise ValueError("this cache has no batch axis left to remove")
        if self.tokens.shape[0] != 1:
            raise ValueError(f"remove_batch_dim needs a cache of one prompt, not {self.tokens.shape[0]}: "
                             "apply_slice_to_batch_dim(i) picks one")
        for name, value in self._map_batch(lambda tensor: tensor[0]).items():
            setattr(self, name, value)
        self.has_batch_dim = False
        return self

    def apply_slice_to_batch_dim(self, batch_slice: SliceInput) -> Any:
        """A new cache of the prompts `batch_slice` picks (an int drops the batch axis), as TL 4.3."""
        import copy

        if not self.has_batch_dim:
            raise ValueError("this cache has no batch axis to slice")
        batch_slice = as_index(batch_slice, "batch_slice")
        new = copy.copy(self)
        new.derived = set(self.derived)
        for name, value in self._map_batch(lambda tensor: apply_slice(tensor, batch_slice, 0)).items():
            setattr(new, name, value)
        new.has_batch_dim = not isinstance(batch_slice, int)
        return new

    # Tokens.

    def to_single_token(self, string: str) -> int:
        """The one token id of `string` (no BOS), as TL's ``to_single_token``; a string of several tokens is refused."""
        return to_single_token(self._tokenizer, string)

    def to_str_tokens(self, input: Any, prepend_bos: Optional[bool] = None) -> Any:
        """Each token as its string, as TL's ``to_str_tokens``: ``cache.to_str_tokens(cache.tokens[0])``."""
        return to_str_tokens(self._tokenizer, input, prepend_bos, model_type=self.model_type)


class CacheDict(Mapping):
    """A cache's keys and tensors as one read-only mapping: TransformerLens 4.3's ``ActivationCache.cache_dict``.

    Iterates `TransformerLensCache.keys` (streamscope's names, then the TransformerLens hook names that answer);
    each value is read from the cache when asked for (computed ones, such as ``ln1.hook_scale``, then).
    """

    def __init__(self, cache: TransformerLensCache) -> None:
        self._cache = cache

    def __getitem__(self, key: str) -> torch.Tensor:
        if not isinstance(key, str):
            raise KeyError(f"cache_dict is keyed by full names ('blocks.0.hook_resid_pre', 'layers.0.layer_input'), "
                           f"not {key!r}: cache[{key!r}] reads TransformerLens's shorthand")
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._cache.keys())

    def __len__(self) -> int:
        return len(self._cache.keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._cache

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        raise TypeError(f"cache.cache_dict is a read-only view of the cache; to replace a stored value, assign "
                        f"cache.stored[streamscope name] (cache.stored lists them), not cache_dict[{key!r}]")

    def __repr__(self) -> str:
        return f"CacheDict({len(self)} keys: {', '.join(list(self)[:4])}, ...)"


def tokenizer_prepends_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer` puts the BOS token first by itself (TransformerLens's ``tokenizer_prepends_bos``)."""
    return prepends_bos(tokenizer)


#: Model types whose TransformerLens 4.3 adapter sets ``default_prepend_bos = False`` (the rest: True). streamscope's
#: default is the tokenizer's own rule instead; ``prepend_bos=model_type not in NO_DEFAULT_BOS`` is TL's default.
NO_DEFAULT_BOS = ("bloom", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "glm", "glm4_moe", "glm4v", "gpt_neox",
                  "granite", "llada", "minimax_m2", "mpt", "phi", "phimoe", "qwen2", "qwen2_5_vl", "qwen3",
                  "qwen3_moe", "qwen3_vl", "recurrent_gemma", "seed_oss", "smollm3", "starcoder2")


def to_tokens(tokenizer: Any, input: str | Sequence[str], prepend_bos: Optional[bool] = None,
              padding_side: Optional[str] = None, model_type: Optional[str] = None) -> torch.Tensor:
    """``[batch, pos]`` token ids of a string or strings, as TransformerLens 4.3's ``to_tokens``.

    `prepend_bos` None (the default) is the tokenizer's own rule, what
    ``tokenizer(text)`` gives and what `model.cache`, traces, vLLM and the
    server run: the same tokens everywhere. True puts one BOS first whether or
    not the tokenizer adds it (TransformerLens's default for most families;
    ``prepend_bos=model_type not in NO_DEFAULT_BOS`` is TL 4.3's exactly);
    False leaves it out even where the tokenizer adds it. Several strings are
    padded on `padding_side`: ``"left"`` by default (position -1 is every
    prompt's last token, as in `model.cache`), or ``"right"``; the pad id is
    the tokenizer's pad token (its EOS where it has none). `model_type` is
    accepted for TransformerLens's signature and changes nothing.
    """
    texts = [input] if isinstance(input, str) else list(input)
    if not texts or not all(isinstance(text, str) for text in texts):
        raise TypeError(f"to_tokens takes a string or a list of strings, not {input!r:.80}")
    encoded = [encode(tokenizer, text, prepend_bos) for text in texts]
    tokens, _ = padded(tokenizer, encoded, check_padding_side(padding_side or "left"))
    return tokens


def to_str_tokens(tokenizer: Any, input: Any, prepend_bos: Optional[bool] = None,
                  padding_side: Optional[str] = None, model_type: Optional[str] = None) -> Any:
    """Each token of `input` (a string, a list of them, or token ids) as its string, as TL 4.3's ``to_str_tokens``."""
    if isinstance(input, list) and input and not isinstance(input[0], int):
        return [to_str_tokens(tokenizer, item, prepend_bos, padding_side, model_type) for item in input]
    if isinstance(input, str):
        ids = to_tokens(tokenizer, input, prepend_bos, padding_side, model_type)[0]
    else:
        ids = torch.as_tensor(input).squeeze()
        ids = ids.unsqueeze(0) if ids.dim() == 0 else ids
        if ids.dim() != 1:
            raise ValueError(f"to_str_tokens takes one sequence of token ids, not a tensor of shape {tuple(ids.shape)}")
    return tokenizer.batch_decode([[int(token)] for token in ids.tolist()], clean_up_tokenization_spaces=False)


def to_single_token(tokenizer: Any, string: str) -> int:
    """The one token id of `string` (no BOS), as TL 4.3's ``to_single_token``; several tokens are refused."""
    ids = to_tokens(tokenizer, string, prepend_bos=False)[0]
    if ids.numel() != 1:
        raise ValueError(f"{string!r} is {ids.numel()} tokens, not one: {ids.tolist()}")
    return int(ids[0])


def test_prompt(prompt: str, answer: str | Sequence[str], model: Any, prepend_space_to_answer: bool = True,
                print_details: bool = True, prepend_bos: Optional[bool] = None, top_k: int = 10) -> list:
    """TransformerLens 4.3's ``utilities.test_prompt`` on a streamscope model (either engine).

    Runs `prompt` followed by `answer` (several answers: their first tokens,
    compared as next-token candidates) and prints, in TL's words, the prompt's
    and answer's tokens, each answer token's rank, logit and probability, and
    the `top_k` tokens at each answer position. Returns what TL's printout
    ends with: ``[(answer token, rank)]`` per answer position (one answer),
    or per position a list over the answers (TL returns nothing). The
    prompt is tokenized by the tokenizer's own BOS rule, as `model.cache`
    does; `prepend_bos` True or False as in `to_tokens` (TL's default:
    ``prepend_bos=model_type not in NO_DEFAULT_BOS``).
    """
    tokenizer = model.tokenizer
    answers = [answer] if isinstance(answer, str) else list(answer)
    if prepend_space_to_answer:
        answers = [text if text.startswith(" ") else " " + text for text in answers]
    several = len(answers) > 1
    prompt_ids = to_tokens(tokenizer, prompt, prepend_bos, model_type=model.config.model_type)[0]
    full_answers = [to_tokens(tokenizer, text, prepend_bos=False)[0] for text in answers]
    answer_ids = [ids[:1] for ids in full_answers] if several else full_answers
    sequences = [torch.cat([prompt_ids, ids]).tolist() for ids in answer_ids]
    logits = model.cache(sequences, values=["layer_output"], layers=[model.num_layers - 1],
                         progress=False).logits.float()
    probs = logits.softmax(-1)
    prompt_length = len(prompt_ids)
    answer_strings = [to_str_tokens(tokenizer, ids) for ids in full_answers]
    if print_details:
        print("Tokenized prompt:", to_str_tokens(tokenizer, prompt_ids))
        print("Tokenized answers:" if several else "Tokenized answer:", answer_strings if several else answer_strings[0])
    ranks: list = []
    for position in range(prompt_length, prompt_length + len(answer_ids[0])):
        step = position - 1  # the logits at a position predict the next token
        order = probs[:, step].argsort(-1, descending=True)
        tokens = [int(ids[position - prompt_length]) for ids in answer_ids]
        found = [(answer_strings[row][position - prompt_length], int((order[row] == token).nonzero()[0, 0]))
                 for row, token in enumerate(tokens)]
        ranks.append(found)
        if print_details:
            print(f"Performance on answer token{'s' if several else ''}:")
            for row, token in enumerate(tokens):
                print(f"Rank: {found[row][1]: <8} Logit: {logits[row, step, token].item():5.2f} "
                      f"Prob: {probs[row, step, token].item():6.2%} Token: |{found[row][0]}|")
            for k in range(top_k):
                top = int(order[0, k])
                print(f"Top {k}th token. Logit: {logits[0, step, top].item():5.2f} "
                      f"Prob: {probs[0, step, top].item():6.2%} Token: |{tokenizer.decode([top])}|")
    result = ranks if several else [row[0] for row in ranks]
    if print_details:
        print(f"Ranks of the answer tokens: {result}")
    return result
