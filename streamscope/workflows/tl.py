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

import copy
import logging
from typing import Any, Callable, Optional, Union

import torch

from ..errors import Unavailable

# The keys and slices live in `tl_keys`, the token helpers in `tl_tokens` (this module had grown past a file's
# length); imported here so that `streamscope.workflows.tl.apply_slice`, `.to_tokens` and the rest keep working.
from .tl_decomposition import FullDecomposition
from .tl_keys import CacheDict, SliceInput, act_name, apply_slice, as_index, keep_axis  # noqa: F401
from .tl_tokens import NO_DEFAULT_BOS, test_prompt, to_single_token, to_str_tokens, to_tokens, tokenizer_prepends_bos  # noqa: F401


class NormForm:
    """A norm's form, enough to compute its scale on a stream: centred (layer norm) or not (RMS), and epsilon."""

    def __init__(self, centred: bool, eps: float) -> None:
        self.centred, self.eps = centred, eps

    def centre(self, stream: torch.Tensor) -> torch.Tensor:
        return stream - stream.mean(-1, keepdim=True) if self.centred else stream

    def scale(self, stream: torch.Tensor) -> torch.Tensor:
        """``[..., 1]``: ``sqrt(mean(x'^2) + eps)``, TransformerLens's ``hook_scale``."""
        return (self.centre(stream.float()).pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


class BlockWeights:
    """One kind of every block's weights (the output projections, the MLP down projections), read from the model
    on first use, all blocks at once (on vLLM, from its worker), and kept: each block's tensor, or the reason the
    block has none. `read` None: the cache was built without access to them, and `what` says which they are."""

    def __init__(self, read: Optional[Callable[[], list]], what: str) -> None:
        self._read, self._what = read, what
        self._blocks: Optional[list] = None

    def block(self, layer: int, hook: str) -> torch.Tensor:
        """Block `layer`'s weight as the model holds it; `Unavailable` naming TransformerLens's `hook` where the
        block has none."""
        if self._blocks is None:
            if self._read is None:
                raise ValueError(f"this cache was built without access to the model's {self._what}")
            self._blocks = self._read()
        weight = self._blocks[layer]
        if isinstance(weight, str):
            raise Unavailable(hook, f"blocks.{layer}", weight)
        return weight


class TransformerLensCache(FullDecomposition):
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

    #: Values assigned under names the run stored no tensor for (`write`), answered before anything computed.
    written: dict[str, torch.Tensor]

    def keys(self) -> list[str]:  # supplied by Cache
        raise NotImplementedError

    def write(self, key: str, value: Optional[torch.Tensor]) -> None:  # supplied by Cache
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
        name = "ln_final.hook_scale" if layer == self.num_layers else f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_scale"
        if name in self.written:  # assigned through cache_dict: the methods use it, as TL's read its cache
            return self.written[name]
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

    _output_weights: BlockWeights

    def output_weights(self, layer: int) -> torch.Tensor:
        """``[heads, head_dim, hidden]``: block `layer`'s output projection split per head (TL's ``W_O``).

        Read from the model (on vLLM, from its worker) once per cache, all blocks at once.
        """
        weight = self._output_weights.block(layer, "attn.hook_result")
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
        """Compute every block's ``attn.hook_result`` (`head_results`) and keep it in the cache, as TL 4.3: a
        block's result already there (computed before, or assigned) is kept, and where every block's was, a
        warning is logged, as TL's."""
        cached = all(f"layers.{layer}.self_attn.head_results" in self.stored for layer in range(self.num_layers))
        if cached:
            logging.getLogger(__name__).warning("Tried to compute head results when they were already cached")
        for layer in range(self.num_layers):
            self.head_results(layer)

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: SliceInput = None, apply_ln: bool = False) -> Any:
        """``[blocks * heads (+1), batch, seq, hidden]``: every head's result before block `layer`, as TL 4.3.

        Labels ``L{layer}H{head}``; `incl_remainder` adds the stream entering
        block `layer` less the heads' sum (``remainder``; at ``layer=0`` the
        last block's output, TL 4.3's convention); `apply_ln` as
        `apply_ln_to_stack` at `layer`.
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
            # At layer=0, TL 4.3 reads block -1's output, the last block's (as stack_neuron_results does here).
            stream = apply_slice(self[f"layers.{(end - 1) % self.num_layers}.layer_output"], pos_slice, -2)
            stack = torch.cat([stack, (stream - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, end, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    # Per-neuron results: each neuron's activation times its row of the MLP's down projection.

    _down_weights: BlockWeights

    def neuron_weights(self, layer: int) -> torch.Tensor:
        """``[intermediate_size, hidden]``: block `layer`'s MLP down projection (TL's ``W_out``), scaled as the
        block scales the MLP's output (Granite's residual multiplier, TL's ``residual_contribution_scale``).

        Read from the model (on vLLM, from its worker, every rank's columns) once per cache, all blocks at once.
        """
        return self._down(layer).t()

    def _down(self, layer: int) -> torch.Tensor:
        """``[hidden, intermediate_size]``: block `layer`'s down projection as the Linear holds it (no op made on
        it: `_projected_rows` contracts it as it is), or `Unavailable` with the reason the block has none."""
        return self._down_weights.block(layer, "mlp.hook_post")

    def get_neuron_results(self, layer: int, neuron_slice: SliceInput = None, pos_slice: SliceInput = None,
                           project_output_onto: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[batch, seq, neurons, hidden]``: what each neuron of block `layer` adds to the stream, as TL 4.3:
        ``neurons[..., n] * W_out[n]`` (the down projection's bias left out, as TL leaves it). `neuron_slice`
        and `pos_slice` pick neurons and positions; `project_output_onto` (``[hidden]`` or ``[hidden, k]``)
        projects each result, the last axis then dropped or ``k``: the down projection's rows are projected
        first, so no ``hidden``-wide result is made."""
        pos_slice, neuron_slice = as_index(pos_slice), as_index(neuron_slice, "neuron_slice")
        acts = apply_slice(apply_slice(self[f"blocks.{layer}.mlp.hook_post"], pos_slice, -2), neuron_slice, -1)
        if project_output_onto is None:
            weights = apply_slice(self.neuron_weights(layer).to(acts.device), neuron_slice, 0)
            return acts.to(weights.dtype)[..., None] * weights
        projection = self._projection(project_output_onto)
        rows = self._projected_rows(layer, neuron_slice, projection, centre=False).to(acts.device)
        results = acts.to(rows.dtype)[..., None] * rows  # [..., neurons, k]
        return results.squeeze(-1) if project_output_onto.dim() == 1 else results

    def _projection(self, project_output_onto: torch.Tensor) -> torch.Tensor:
        """`project_output_onto` checked, as ``[hidden, k]``."""
        hidden = self["token_embeddings"].shape[-1]
        if not isinstance(project_output_onto, torch.Tensor) or project_output_onto.dim() not in (1, 2) \
                or project_output_onto.shape[0] != hidden:
            got = list(project_output_onto.shape) if isinstance(project_output_onto, torch.Tensor) else \
                type(project_output_onto).__name__
            raise ValueError(f"project_output_onto is [hidden_size] or [hidden_size, k] = [{hidden}] or "
                             f"[{hidden}, k]; got {got}")
        return project_output_onto[:, None] if project_output_onto.dim() == 1 else project_output_onto

    def _projected_rows(self, layer: int, neuron_slice: Any, projection: torch.Tensor, centre: bool) -> torch.Tensor:
        """``[neurons, k]``: block `layer`'s down projection rows (those `neuron_slice` picks) projected onto
        `projection` ``[hidden, k]``, each row centred first where `centre` (a layer norm's `apply_ln`: centring
        is linear, so ``centre(W) @ P == W @ P - mean(W) * sum(P)``). Contracted from the Linear's own
        ``[hidden, neurons]`` weight: no ``[neurons, hidden]`` tensor is made, not even a transposed view."""
        weight = apply_slice(self._down(layer), neuron_slice, 1)  # [hidden, neurons]
        projection = projection.to(weight.device, weight.dtype)
        rows = (projection.t() @ weight).t()  # [neurons, k]
        if centre and self.norm_form.centred:
            rows = rows - weight.mean(0)[:, None] * projection.sum(0)[None]
        return rows

    def stack_neuron_results(self, layer: int, pos_slice: SliceInput = None, neuron_slice: SliceInput = None,
                             return_labels: bool = False, incl_remainder: bool = False, apply_ln: bool = False,
                             project_output_onto: Optional[torch.Tensor] = None, mlp_input: bool = False) -> Any:
        """``[blocks * neurons (+1), batch, seq, hidden]``: every neuron's result before block `layer`, as TL 4.3.

        Labels ``L{layer}N{neuron}``; `layer` None or -1 is every block. `incl_remainder` adds the stream
        block `layer`'s norm reads (``resid_mid`` with `mlp_input`, else ``resid_pre``; at ``layer=0`` the
        last block's output, TL's convention) less the neurons' sum; `apply_ln` as `apply_ln_to_stack`. An int
        `neuron_slice` keeps its axis (``[n]``).

        Without `project_output_onto` every neuron's ``hidden``-wide result is made: ``blocks * neurons * batch
        * seq * hidden`` numbers, for small models or a few neurons (`neuron_slice`, `pos_slice`).
        `project_output_onto` (``[hidden]`` or ``[hidden, k]``, applied after the norm; the last axis then
        dropped or ``k``) is memory-light, as TL 4.3's: each down projection row is projected (centred first
        with a layer norm's `apply_ln`) and then multiplied by its neuron's activations, divided by the frozen
        norm scale with `apply_ln`, so the largest tensor is ``[blocks * neurons, batch, seq, k]``; it equals
        the dense stack projected to float32 rounding.
        """
        if layer is None or layer == -1:
            layer = self.num_layers
        if incl_remainder and layer < 0:
            raise ValueError(f"layer must be >= 0 with incl_remainder=True (-1/None mean every block); got {layer}")
        neuron_slice = as_index(neuron_slice, "neuron_slice")
        if isinstance(neuron_slice, int):  # as TL 4.3 (``Slice.unwrap``, an int-mode Slice too): the axis stays
            neuron_slice = [neuron_slice]
        projection = None if project_output_onto is None else self._projection(project_output_onto)
        scale = apply_slice(self.norm_scale(layer, mlp_input), pos_slice, -2) if apply_ln and projection is not None \
            else None
        parts, labels = [], []
        for index in range(layer):
            parts.append(self._neuron_part(index, neuron_slice, pos_slice, projection, apply_ln, scale))
            picked = apply_slice(torch.arange(self._down_width(index)), neuron_slice, 0)
            labels += [f"L{index}N{int(neuron)}" for neuron in picked]
        if parts:
            stack = torch.cat(parts)
        else:
            embed = apply_slice(self["token_embeddings"], pos_slice, -2)
            width = embed.shape[-1] if projection is None else projection.shape[-1]
            stack = embed.new_zeros(0, *embed.shape[:-1], width)
        if incl_remainder:
            target = self[f"blocks.{layer}.hook_resid_mid" if mlp_input
                          else f"blocks.{(layer - 1) % self.num_layers}.hook_resid_post"]
            target = apply_slice(target, pos_slice, -2).to(stack.dtype)[None]
            if projection is not None:  # the norm (frozen) and the projection are linear: project the whole first
                normed = self.apply_ln_to_stack(target, layer, mlp_input, pos_slice) if apply_ln else target
                target = normed @ projection.to(normed)
            stack = torch.cat([stack, target - stack.sum(0, keepdim=True)])
            labels.append("remainder")
        if apply_ln and projection is None:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        if project_output_onto is not None and project_output_onto.dim() == 1:
            stack = stack.squeeze(-1)
        return (stack, labels) if return_labels else stack

    def _neuron_part(self, index: int, neuron_slice: Any, pos_slice: SliceInput, projection: Optional[torch.Tensor],
                     centre: bool, scale: Optional[torch.Tensor], post: Optional[tuple] = None) -> torch.Tensor:
        """``[neurons, batch, pos, hidden or k]``: block `index`'s neurons' results, projected onto `projection`
        ``[hidden, k]`` through their rows (`_projected_rows`, centred where `centre`) and divided by `scale` when
        given; `post` ``(weight [hidden], scale [batch, pos, 1])`` passes them through the MLP's post-norm, frozen
        (`tl_decomposition`)."""
        if projection is None:
            part = self.get_neuron_results(index, neuron_slice=neuron_slice, pos_slice=pos_slice).movedim(-2, 0)
            return part if post is None else part * post[0].to(part) / post[1].to(part)
        acts = apply_slice(apply_slice(self[f"blocks.{index}.mlp.hook_post"], pos_slice, -2), neuron_slice, -1)
        through = projection if post is None else post[0][:, None].to(projection) * projection
        rows = self._projected_rows(index, neuron_slice, through, centre=centre).to(acts.device)
        part = (acts.to(rows.dtype)[..., None] * rows).movedim(-2, 0)  # [neurons, batch, pos, k]
        if post is not None:
            part = part / post[1].to(part)
        return part if scale is None else part / scale.to(part)

    def _down_width(self, layer: int) -> int:
        """Block `layer`'s number of neurons (its down projection's input width)."""
        return int(self._down(layer).shape[1])

    # TransformerLens's dictionary and global switches.

    @property
    def cache_dict(self) -> "CacheDict":
        """Every key of the cache (`keys`: streamscope's names, then TransformerLens's) and its tensor, as TL 4.3's
        ``cache.cache_dict``: a plain ``dict`` (a `CacheDict`), made on first use and kept until the cache's
        values change. The TransformerLens values computed from served ones (the norms' scales and normalized
        streams, ``hook_attn_in``) are made with it, as TL's cache holds them; ``blocks.{i}.attn.hook_result``
        is in it once computed (`compute_head_results`), as in TL's. Assigning or deleting a key writes through
        to the cache (`write`)."""
        state = self._state()
        if self._dict is None or self._dict_state != state:
            self._dict, self._dict_state = None, None
            self._dict = CacheDict(self)
            self._dict_state = state
        return self._dict

    _dict: Optional["CacheDict"] = None
    _dict_state: Optional[tuple] = None

    def _state(self) -> tuple:
        """What `cache_dict` is made from: every stored and written tensor (by identity) and the batch axis."""
        return (self.has_batch_dim, *((key, id(value)) for key, value in self.stored.items()),
                *((key, id(value)) for key, value in self.written.items()))

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
        self.written = {key: value.to(device) for key, value in self.written.items()}
        self.tokens, self.mask = self.tokens.to(device), self.mask.to(device)
        if self.logits is not None:
            self.logits = self.logits.to(device)
        return self

    def _map_batch(self, function: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        return {"stored": {key: function(value) for key, value in self.stored.items()},
                "written": {key: function(value) for key, value in self.written.items()},
                "tokens": function(self.tokens), "mask": function(self.mask),
                "logits": None if self.logits is None else function(self.logits)}

    def remove_batch_dim(self, batch_size: Optional[int] = None) -> "TransformerLensCache":
        """Drop the batch axis of a cache of one prompt, in place, as TL 4.3's ``remove_batch_dim(batch_size)``.

        `batch_size` is TL's statement of the batch size (TL infers it from the tensors' leading axes when None);
        this cache knows its own (``tokens.shape[0]``), so a `batch_size` that differs from it is refused, as is
        a cache of several prompts (`apply_slice_to_batch_dim` picks one; TL raises AssertionError, streamscope
        ValueError). Called again on a cache whose axis is gone, it logs a warning and changes nothing, as TL's.
        """
        if not self.has_batch_dim:
            logging.getLogger(__name__).warning("Tried removing batch dimension after already having removed it.")
            return self
        batch = self.tokens.shape[0]
        if batch_size is not None and batch_size != batch:
            raise ValueError(f"remove_batch_dim(batch_size={batch_size}): this cache holds {batch} prompt(s) "
                             f"(cache.tokens.shape[0]); leave batch_size out, or pass {batch}")
        if batch != 1:
            raise ValueError(f"remove_batch_dim needs a cache of one prompt, not {batch}: "
                             "apply_slice_to_batch_dim(i) picks one")
        for name, value in self._map_batch(lambda tensor: tensor[0]).items():
            setattr(self, name, value)
        self.has_batch_dim = False
        return self

    def apply_slice_to_batch_dim(self, batch_slice: SliceInput) -> Any:
        """A new cache of the prompts `batch_slice` picks (an int drops the batch axis), as TL 4.3."""
        if not self.has_batch_dim:
            raise ValueError("this cache has no batch axis to slice")
        batch_slice = as_index(batch_slice, "batch_slice")
        new = copy.copy(self)
        new.derived = set(self.derived)
        new._dict, new._dict_state = None, None
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
