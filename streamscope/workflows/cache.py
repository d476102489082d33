"""A cache of a run's values, answering streamscope's names and TransformerLens's hook names.

    cache = model.cache(["The Eiffel Tower is in", "Rome is the capital of"])
    cache["layers.3.layer_mid"]              # [batch, seq, hidden_size]
    cache["blocks.3.hook_resid_mid"]         # the same tensor, by its TransformerLens name
    cache.stack("layer_output")              # [blocks, batch, seq, hidden_size]
    parts, labels = cache.decompose_resid(return_labels=True)  # embeddings, then each block's attention and MLP
    cache.logit_attrs(parts, tokens=answer)  # each part's direct effect on the answer's logit, then a bias row
    cache["pattern", 3]                      # TransformerLens's shorthand; the methods are `streamscope.tl`'s

Several prompts are padded on the left to the longest, so ``[:, -1]`` is every
prompt's last token (``model.cache(prompts, padding_side="right")`` pads on the
right); `mask` ``[batch, seq]`` says which positions are real, the values at
padded positions are zero (an attention pattern's query and key axes both), and
`Cache.last` reads each prompt's last real token whatever the side. Every real
position's value is the one the prompt gives alone: on transformers the prompts
run as one left-padded batch with an attention mask and position ids counted from
each prompt's first token; on vLLM each prompt is its own request, unpadded, and
the values are padded afterwards. Text is tokenized by the tokenizer's own rule
for BOS (what ``tokenizer(text)``, a trace, vLLM and the server give);
``prepend_bos=True`` puts one first as TransformerLens does.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from ..blocks import BOUNDARIES, SHORT_CONTRIBUTIONS, Attention
from ..blocks.heads import INTERNALS
from ..blocks.sublayers import NEURONS
from ..display import shape, table
from ..engine import check_padding_side, last_positions, padded
from ..errors import Unavailable
from ..families.logits import scaling_in_words
from ..families.spec import ROOT_STREAMS
from ..input_checks import indices, names
from ..values import StreamValue
from .cache_inputs import _names_filter, _output_weights, _token_ids, norm_inputs  # noqa: F401  (serve imports them)
from .tl import BlockWeights, TransformerLensCache, act_name, apply_slice, as_index, keep_axis

ATTENTION = tuple(f"{Attention.ROLE}.{name}" for name in INTERNALS)
ROOT = ROOT_STREAMS
#: The stream's values: every boundary, every contribution and a dense MLP's neurons (``values=STREAM_VALUES``
#: is `model.cache`'s default before attention's values joined it: linear in the prompt's length).
STREAM_VALUES = (*BOUNDARIES, *SHORT_CONTRIBUTIONS, *(f"mlp.{name}" for name in NEURONS))
#: What `model.cache` reads by default, what TransformerLens 4.3's run_with_cache keeps: `STREAM_VALUES` and
#: attention's queries and keys before and after the rotary embedding, values, scores, pattern and per-head
#: outputs (TL's hook_q/k, hook_rot_q/k, hook_v, hook_attn_scores, hook_pattern, hook_z), and the root values.
#: A block that serves one of them not is listed in `Cache.unavailable` with the reason. Memory, in numbers a
#: block for ``b`` prompts of ``s`` tokens: about ``b*s*(6*hidden + 2*d_mlp + 6*heads*head_dim)`` for the streams,
#: neurons and per-head values, plus ``2*b*heads*s*s`` for the scores and pattern, which dominate past
#: ``s ~ 3*hidden/heads`` tokens (the logits add ``b*s*vocab`` unless ``logits=False``; ``values=STREAM_VALUES``
#: leaves attention's values out).
DEFAULT_VALUES = (*STREAM_VALUES, *ATTENTION)
#: ``model.cache(prompts, values=ALL)``: every value every block serves (its support table's served rows).
ALL = "all"

#: The sublayers whose values a short name reaches: ``pattern`` is ``self_attn.pattern``, ``attention_output``
#: the mixer's (``self_attn`` or ``linear_attn``, whichever the block has), ``mlp_output`` the MLP's.
SUBLAYERS = tuple(role for roles in SHORT_CONTRIBUTIONS.values() for role in roles)


def _spellings(name: str) -> tuple[str, ...]:
    """A block value's name as given, then as each sublayer's (a short name reaches the sublayer's value)."""
    if "." in name:
        return (name,)
    return (name, *(f"{sublayer}.{name}" for sublayer in SUBLAYERS))

#: TransformerLens block hook -> (streamscope block value, how TL lays it out relative to streamscope).
TL_BLOCK = {
    "hook_resid_pre": ("layer_input", None),
    "hook_resid_mid": ("layer_mid", None),
    "hook_resid_post": ("layer_output", None),
    "ln1.hook_out": ("attention_norm_output", None),
    "ln2.hook_out": ("mlp_norm_output", None),
    "attn.hook_in": ("attention_norm_output", None),
    "hook_attn_out": ("attention_output", None),
    "mlp.hook_in": ("mlp_input", None),
    "hook_mlp_out": ("mlp_output", None),
    "mlp.hook_pre": ("mlp.neurons_pre", None),
    "mlp.hook_post": ("mlp.neurons", None),
    "attn.hook_q": ("self_attn.queries_projected", "heads_last"),
    "attn.hook_k": ("self_attn.keys_projected", "heads_last"),
    "attn.hook_rot_q": ("self_attn.queries", "heads_last"),
    "attn.hook_rot_k": ("self_attn.keys", "heads_last"),
    "attn.hook_v": ("self_attn.values", "heads_last"),
    "attn.hook_z": ("self_attn.head_outputs", None),
    "attn.hook_attn_scores": ("self_attn.scores", None),
    "attn.hook_pattern": ("self_attn.pattern", None),
}
#: TransformerLens block hooks computed from served values (`Cache._computed`), with what each is.
TL_COMPUTED = {
    "ln1.hook_scale": "[batch, pos, 1]: the attention norm's scale, from the stream it reads",
    "ln2.hook_scale": "[batch, pos, 1]: the MLP norm's scale, from the stream it reads",
    "ln1.hook_normalized": "the attention norm's input centred (layer norm) and divided by its scale, before weight",
    "ln2.hook_normalized": "the MLP norm's input centred (layer norm) and divided by its scale, before weight",
    "hook_mlp_in": "the stream the MLP norm reads (layer_mid; layer_input in a parallel block)",
    "hook_attn_in": "[batch, pos, head, d_model]: layer_input, once per head (TL's use_attn_in)",
    "attn.hook_result": "[batch, pos, head, d_model]: each head's output after the output projection, no bias",
}
TL_ROOT = {"hook_embed": "token_embeddings", "ln_final.hook_out": "final_norm_output"}
#: TransformerLens hooks streamscope serves no value for, with the reason.
TL_UNSERVED = {
    "mlp.hook_pre_linear": ("streamscope serves a gated MLP's gate before the nonlinearity (mlp.hook_pre, "
                            "mlp.neurons_pre) and the gated product (mlp.hook_post, mlp.neurons), not its up "
                            "projection alone"),
}
#: A block's TransformerLens hooks in the order TL 4.3's bridge runs them (its cache's keys' order).
_TL_ORDER = ("hook_resid_pre", "hook_attn_in", "ln1.hook_scale", "ln1.hook_normalized", "ln1.hook_out", "attn.hook_in",
             "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k",
             "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "attn.hook_result", "hook_attn_out",
             "hook_resid_mid", "hook_mlp_in", "ln2.hook_scale", "ln2.hook_normalized", "ln2.hook_out", "mlp.hook_in",
             "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post")


def _tl_rank(hook: str) -> int:
    return _TL_ORDER.index(hook) if hook in _TL_ORDER else len(_TL_ORDER)


_TL_BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")
_BLOCK_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


class Cache(TransformerLensCache, Mapping):
    """The values of a run over one or more prompts, keyed ``layers.{i}.{value}`` and by root names.

    Also keyed by TransformerLens 4.3's hook names and ``(name, layer)`` tuples,
    with TransformerLens's ActivationCache methods (`streamscope.tl`).

    Attributes:
        tokens: ``[batch, seq]`` token ids, padded on `padding_side` with the pad id.
        mask: ``[batch, seq]``, True at real positions.
        padding_side: ``"left"`` (the default: position -1 is every prompt's last token) or ``"right"``.
        logits: ``[batch, seq, vocab_size]``: the model's logits at every position.
        model_type: The family's ``config.model_type``.
        learned_positions: Whether the family adds learned position embeddings to the stream before block 0
            (`FamilySpec.learned_positions`: GPT-2, OPT).
        num_layers: The number of blocks.
        unavailable: ``{key: reason}`` for every asked-for value some block cannot serve.
        final_norm: The final norm's parameters, in the form that reproduces the model's output (`FinalNorm`).
        stored: ``{streamscope name: tensor}``, what the run kept, each tensor once (iteration, ``values()``,
            ``items()`` and `cache_dict` run over every key, TransformerLens's names too, as TL's cache does).
        model: The streamscope model the cache was run on (TransformerLens's ``cache.model``).
        has_batch_dim: False after `remove_batch_dim`.
        logit_transform: What the model applies to the unembedding's output (a soft cap, a scale), or None.
        norm_inputs: Per block, the stream its ``ln1``/``ln2`` read (or the reason it has none).
    """

    def __init__(self, values: dict[str, torch.Tensor], *, tokens: torch.Tensor, mask: torch.Tensor,
                 logits: Optional[torch.Tensor], model_type: str, num_layers: int,
                 unavailable: dict[str, str], final_norm: "FinalNorm | None", unembedding: Any = None,
                 norm_inputs: Optional[dict[int, dict[str, str]]] = None, num_heads: Optional[int] = None,
                 tokenizer: Any = None, logit_transform: Optional[str] = None,
                 output_weights: Any = None, learned_positions: bool = False, down_weights: Any = None,
                 head: Any = None, padding_side: str = "left", model: Any = None) -> None:
        self.stored = values
        self.derived: set[str] = set()
        self.written: dict[str, torch.Tensor] = {}
        #: The run's ``names_filter`` as a predicate (None: none): `keys` lists the names it accepts, as TL's.
        self.names_filter: Optional[Callable[[str], bool]] = None
        self.model = model
        self.padding_side = padding_side
        self._head = head  # the engine's `head_parameters`, read when logit_attrs needs the head's bias and scale
        self._output_weights = BlockWeights(output_weights, "output projections")
        self._down_weights = BlockWeights(down_weights, "MLP down projections")
        self.logit_transform = logit_transform
        self.has_batch_dim = True
        self.norm_inputs = norm_inputs or {}
        self.num_heads = num_heads
        self._tokenizer = tokenizer
        self.tokens, self.mask, self.logits = tokens, mask, logits
        self.model_type, self.num_layers = model_type, num_layers
        self.learned_positions = learned_positions
        self.unavailable = unavailable
        self.final_norm = final_norm
        self._unembedding = unembedding

    # Mapping, as TransformerLens's ActivationCache: iteration, len(), values() and items() run over keys(),
    # streamscope's names and then TransformerLens's (`stored` holds the tensors the run kept, once each).

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def keys(self) -> list[str]:  # type: ignore[override]
        """The streamscope names the run kept, then the TransformerLens hook names that answer from them.

        The same list whatever has been read: a value computed on first read and kept
        (``layers.{i}.self_attn.head_results``, read as ``blocks.{i}.attn.hook_result``) is listed under its
        TransformerLens name only."""
        stored = [key for key in self.stored if key not in self.derived
                  and (self.names_filter is None or self.names_filter(key))]
        listed = [*stored, *self.tl_names()]
        return [*listed, *(key for key in self.written if key not in listed)]

    def tl_names(self) -> list[str]:
        """The TransformerLens 4.3 hook names this cache answers, in the order the model computes them (TL's
        bridge's order: `_TL_ORDER`); in a cache built with a ``names_filter``, those the filter accepts."""
        names = [tl for tl, name in TL_ROOT.items() if name in self.stored and not tl.startswith("ln_final")]
        if "hook_pos_embed" in self:
            names.append("hook_pos_embed")
        computed = [hook for hook in TL_COMPUTED if hook != "hook_attn_in" or self.num_heads is not None]
        for index in range(self.num_layers):
            served = [hook for hook, (name, _) in TL_BLOCK.items() if self._block_key(index, name) is not None]
            served += [hook for hook in computed if self._computable(index, hook)]
            names += [f"blocks.{index}.{hook}" for hook in sorted(served, key=_tl_rank)]
        if self.final_norm is not None and f"layers.{self.num_layers - 1}.layer_output" in self.stored:
            names += ["ln_final.hook_scale", "ln_final.hook_normalized"]
        names += [tl for tl, name in TL_ROOT.items() if name in self.stored and tl.startswith("ln_final")]
        if self.logits is not None and self.logit_transform is None:
            names.append("hook_unembed")
        return names if self.names_filter is None else [name for name in names if self.names_filter(name)]

    def _block_key(self, index: int, name: str) -> Optional[str]:
        """The stored key of block `index`'s value `name` (a short contribution name resolved), or None."""
        for full in _spellings(name):
            if f"layers.{index}.{full}" in self.stored:
                return f"layers.{index}.{full}"
        return None

    def _computable(self, index: int, hook: str) -> bool:
        if hook == "attn.hook_result":  # as TL's cache: listed once computed (compute_head_results), or served
            return f"layers.{index}.self_attn.head_results" in self.stored
        source = self.norm_inputs.get(index, {}).get("ln2" if hook.startswith(("ln2", "hook_mlp")) else "ln1")
        return (source is not None and source in self.stored
                and (self.final_norm is not None or not hook.startswith("ln")))

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
            return True
        except (KeyError, Unavailable):
            return False

    def __getitem__(self, key: Any) -> torch.Tensor:
        """The value under a streamscope name (``layers.3.layer_mid``, ``token_embeddings``), a TL hook name,
        or a TL shorthand tuple (``cache["pattern", 3]``, ``cache["scale", 2, "ln1"]``, ``cache["resid_post", -1]``)."""
        if not isinstance(key, str):
            key = self.tl_key(key)
        if key in self.stored:
            return self.stored[key]
        if key in self.written:
            return self.written[key]
        block = _BLOCK_NAME.match(key)
        if block is not None:
            index, name = int(block.group(1)), block.group(2)
            if index >= self.num_layers:
                raise KeyError(f"{key!r}: block {index} is out of range: the model has {self.num_layers} "
                               f"(layers.0 to layers.{self.num_layers - 1})")
            for full in _spellings(name):
                if f"layers.{index}.{full}" in self.stored:
                    return self.stored[f"layers.{index}.{full}"]
                if f"layers.{index}.{full}" in self.unavailable:
                    raise Unavailable(full, f"model.layers[{index}]", self.unavailable[f"layers.{index}.{full}"])
            raise KeyError(f"{key!r} is not in this cache: model.cache(..., values=[{name!r}]) reads it")
        if key in self.unavailable:
            raise Unavailable(key, "model", self.unavailable[key])
        return self._transformer_lens(key)

    def write(self, key: str, value: Optional[torch.Tensor]) -> None:
        """Put `value` under `key` (None: take it away), what assigning TL 4.3's ``cache.cache_dict[key]`` does.

        A streamscope name, or a TransformerLens name read unchanged from one (``blocks.2.hook_resid_mid``),
        replaces the stored tensor, so both names and every method read the new one; ``hook_q``/``hook_k``/
        ``hook_v`` are stored back in streamscope's ``[batch, head, seq, d]`` layout; ``blocks.{i}.attn.
        hook_result`` becomes block i's per-head results. Any other name (a computed one, or a new one, as TL's
        attribution-patching demo adds) is kept in `written` and answered before anything is computed.
        """
        if not isinstance(key, str):
            raise KeyError(f"write takes a full name ('blocks.0.hook_resid_pre', 'layers.0.layer_input'), not {key!r}")
        match = _TL_BLOCK_NAME.match(key)
        target, layout = key, None
        if key not in self.stored:
            source = _source_of(self, key)
            if source is not None:
                target, layout = source, TL_BLOCK[match.group(2)][1] if match else None
            elif match is not None and match.group(2) == "attn.hook_result":
                target = f"layers.{match.group(1)}.self_attn.head_results"
                self.derived.add(target)
        if target == key and key not in self.stored and not key.endswith("self_attn.head_results"):
            if value is None:
                self.written.pop(key, None)
            else:
                self.written[key] = value
            return
        if value is None:
            self.stored.pop(target, None)
            self.derived.discard(target)
            return
        whole = 4 if self.has_batch_dim else 3
        self.stored[target] = value.transpose(-3, -2) if layout == "heads_last" and value.dim() == whole else value

    def _transformer_lens(self, key: str) -> torch.Tensor:
        if key in TL_ROOT:
            return self[TL_ROOT[key]]
        if key == "ln_final.hook_scale":
            return self.norm_scale(self.num_layers)
        if key == "ln_final.hook_normalized":
            stream = self[f"layers.{self.num_layers - 1}.layer_output"]
            return self.norm_form.centre(stream.float()) / self.norm_scale(self.num_layers)
        if key == "hook_unembed":
            if self.logits is None:
                raise KeyError("hook_unembed: this cache kept no logits (model.cache(..., logits=True) keeps them)")
            if self.logit_transform is not None:
                raise Unavailable("hook_unembed", "model", f"TransformerLens's hook_unembed is the unembedding's "
                                  f"output, before the {self.logit_transform}; cache.logits are after it")
            return self.logits
        if key == "hook_pos_embed":
            if not self.learned_positions:
                raise Unavailable("hook_pos_embed", "model", f"a {self.model_type} model adds no position embedding "
                                  "to the stream (its positions enter inside attention, by rotary or not at all)")
            # Exact: block 0's input is the token embeddings plus the position embeddings.
            return self["layers.0.layer_input"] - self["token_embeddings"]
        match = _TL_BLOCK_NAME.match(key)
        if match is None and act_name(key) != key:  # TL's shorthand string: cache["embed"], cache["scale2ln1"]
            return self[act_name(key)]
        if match is None:
            raise KeyError(f"{key!r} is neither a streamscope name (layers.3.layer_mid, token_embeddings) nor a "
                           f"TransformerLens hook name this cache knows ({', '.join(sorted(TL_ROOT))}, "
                           f"blocks.3.{{{', '.join([*TL_BLOCK, *TL_COMPUTED])}}}, or a tuple "
                           f"(\"pattern\", 3)); cache.keys() lists every name")
        index, hook = int(match.group(1)), match.group(2)
        if index < 0:
            index += self.num_layers
        if hook in TL_COMPUTED:
            return self._computed(index, hook)
        if hook in TL_UNSERVED:
            raise Unavailable(hook, f"blocks.{index}", TL_UNSERVED[hook])
        if hook not in TL_BLOCK:
            raise KeyError(f"{key!r}: TransformerLens hook {hook!r} has no streamscope counterpart; known: "
                           f"{', '.join([*TL_BLOCK, *TL_COMPUTED])}")
        name, layout = TL_BLOCK[hook]
        value = self[f"layers.{index}.{name}"]
        # TransformerLens lays per-head values out [batch, pos, head, d_head]; streamscope [batch, head, seq, d]. The
        # batch axis may be gone (remove_batch_dim), and the position axis too (a run's pos_slice=Slice(int)):
        # [head, d] then reads the same in both layouts.
        whole = 4 if self.has_batch_dim else 3
        return value.transpose(-3, -2) if layout == "heads_last" and value.dim() == whole else value

    def _computed(self, index: int, hook: str) -> torch.Tensor:
        """A TransformerLens block hook computed from served values (`TL_COMPUTED`)."""
        if hook == "attn.hook_result":
            return self.head_results(index)
        if hook == "hook_attn_in":
            if self.num_heads is None:
                raise KeyError("hook_attn_in needs the number of heads, which this cache was built without")
            stream = self[f"layers.{index}.layer_input"]
            return stream.unsqueeze(-2).expand(*stream.shape[:-1], self.num_heads, stream.shape[-1])
        mlp = hook.startswith(("ln2", "hook_mlp"))
        stream = self.norm_input(index, mlp)
        if hook == "hook_mlp_in":
            return stream
        if hook.endswith("hook_scale"):
            return self.norm_scale(index, mlp)
        return self.norm_form.centre(stream.float()) / self.norm_scale(index, mlp)

    # streamscope's own stacking; TransformerLens's ActivationCache methods come from `TransformerLensCache`.

    @property
    def last_positions(self) -> torch.Tensor:
        """``[batch]``: the position of each prompt's last real token (``seq - 1`` throughout when padded on the
        left, the default; each prompt's length less one on the right)."""
        return last_positions(self.mask if self.has_batch_dim else self.mask.unsqueeze(0))

    def last(self, value: Any) -> torch.Tensor:
        """Each prompt's value at its last real token, whichever side the cache is padded on: ``[batch, ...]``.

        `value` is ``"logits"``, a streamscope or TransformerLens name or shorthand tuple, or a tensor laid out
        ``[batch, seq, ...]`` over this cache's positions. The query-position axis goes (an attention pattern's
        or score's third axis, streamscope's per-head queries, keys and values' too); a key axis stays.
        """
        if not self.has_batch_dim:
            raise ValueError("cache.last needs the batch axis (this cache's was removed by remove_batch_dim)")
        if isinstance(value, torch.Tensor):
            tensor, axis = value, 1
        elif value == "logits":
            if self.logits is None:
                raise KeyError("this cache kept no logits (model.cache(..., logits=True) keeps them)")
            tensor, axis = self.logits, 1
        else:
            key = value if isinstance(value, str) else self.tl_key(value)
            tensor = self[key]
            heads_first = key.split(".")[-1] in _SEQ_AXES or key.endswith(("hook_pattern", "hook_attn_scores"))
            axis = 2 if heads_first else 1
        if tensor.dim() <= axis or tensor.shape[0] != self.mask.shape[0] or tensor.shape[axis] != self.mask.shape[1]:
            raise ValueError(f"a tensor of shape {tuple(tensor.shape)} is not laid out over this cache's "
                             f"[batch, seq] = {tuple(self.mask.shape)} positions")
        rows = torch.arange(tensor.shape[0])
        return tensor.movedim(axis, 1)[rows, self.last_positions]

    def stack(self, name: str, layers: Optional[Iterable[int]] = None) -> torch.Tensor:
        """``[blocks, ...]``: value `name` of every block (or of `layers`), a streamscope or TL block name.

        ``cache.stack("layer_mid")`` and ``cache.stack("hook_resid_mid")`` are the same tensor.
        """
        layers = range(self.num_layers) if layers is None else layers
        tl = name in TL_BLOCK or name in TL_COMPUTED or name in TL_UNSERVED
        return torch.stack([self[f"blocks.{i}.{name}" if tl else f"layers.{i}.{name}"] for i in layers])

    def __repr__(self) -> str:
        return (f"Cache({self.model_type}, {self.num_layers} blocks, batch {self.tokens.shape[0]}, "
                f"seq {self.tokens.shape[-1]}, {len(self.stored)} values)")

    def _repr_html_(self) -> str:
        # One row per value name, its blocks and shape (a block's values share their shapes).
        names: dict[str, list] = {}
        for key, value in self.stored.items():
            match = _BLOCK_NAME.match(key)
            name, block = (match.group(2), match.group(1)) if match else (key, "root")
            names.setdefault(name, [[], shape(value)])[0].append(block)
        rows = [[name, ", ".join(blocks) if len(blocks) < 6 else f"{blocks[0]}-{blocks[-1]}", size]
                for name, (blocks, size) in names.items()]
        if self.logits is not None:
            rows.append(["logits", "root", shape(self.logits)])
        return table(repr(self), ["value", "blocks", "shape"], rows)


class FinalNorm:
    """A final norm's parameters: applied to a stream (`__call__`), or its form for the scales (`streamscope.tl`)."""

    def __init__(self, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, centred: bool) -> None:
        self.weight, self.bias, self.eps, self.centred = weight, bias, eps, centred

    def normalize(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        centred = stream - stream.mean(-1, keepdim=True) if self.centred else stream
        scale = (centred.float().pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        return centred, scale

    def __call__(self, stream: torch.Tensor) -> torch.Tensor:
        """The norm's output on `stream`, from these parameters (checked against the model's own at build)."""
        centred, scale = self.normalize(stream)
        out = centred / scale * (self.weight if self.weight is not None else 1)
        return out + self.bias if self.bias is not None else out


def fit_final_norm(weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                   stream: torch.Tensor, output: torch.Tensor) -> FinalNorm:
    """The final norm's form (RMS or centred, ``w`` or Gemma's ``1 + w``) that reproduces the model's own output.

    `stream` is the final stream and `output` what the model's final norm made
    of it; each candidate form is checked against them, so a norm this cannot
    express is refused rather than approximated.
    """
    candidates = []
    for centred in (False, True):
        for offset in (0.0, 1.0):
            scaled = None if weight is None else weight.float() + offset
            candidates.append(FinalNorm(scaled, None if bias is None else bias.float(), eps, centred))
    errors = [((norm(stream.float()) - output.float()).abs().max() / output.abs().max().clamp_min(1e-30)).item()
              for norm in candidates]
    best = min(range(len(candidates)), key=errors.__getitem__)
    # The model's output is rounded to its dtype (bfloat16: 2^-8 relative), and the forms differ by far more.
    # The cache may hold it in float32, so the dtype is the model's: its norm weight's, where it has one.
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else output.dtype
    if errors[best] < max(1e-4, 2 * torch.finfo(dtype).eps):
        return candidates[best]
    raise ValueError(f"the final norm is neither an RMS norm nor a layer norm with an elementwise weight "
                     f"(best relative error {errors[best]:.2e}); decompose and logit_attrs cannot apply it")


# Building a cache on either engine.


def _block_keys(model: Any, values: Sequence[str], layers: Sequence[int],
                lenient: bool = False) -> tuple[list, dict[str, str]]:
    """(block, full name) pairs to read in the order each block computes them, and the unserved ones' reasons.

    A name no block row answers is refused, unless `lenient` (the default values, ``"all"``): then the block's
    reason is that it has no such value."""
    wanted = {name for name in values}
    reads, unavailable = [], {}
    for index in layers:
        rows = model.layers[index].support().rows
        if values == [ALL]:
            wanted = set(rows)
        for full, reason in rows.items():
            short = full.split(".")[-1]
            # A short name (``pattern``, ``attention_output``) selects the sublayer's value of that name.
            if full in wanted or (short in wanted and full in _spellings(short)):
                if reason is None:
                    reads.append((index, full))
                else:
                    unavailable[f"layers.{index}.{full}"] = reason
        for name in wanted:
            if name not in rows and not any(full.endswith("." + name) for full in rows):
                if lenient:
                    unavailable[f"layers.{index}.{name}"] = (f"model.layers[{index}] has no {name} (a "
                                                             f"{type(model.layers[index]).__name__}); its values: "
                                                             f"{', '.join(rows)}")
                    continue
                raise ValueError(f"{name!r} is not a value of model.layers[{index}]; its values: {', '.join(rows)}")
    return reads, unavailable


def _location(model: Any, index: int, full: str) -> Optional[tuple]:
    """Where a plain value is read (module, input or output, argument), or None for a computed or scaled one."""
    host = model.layers[index]
    *path, name = full.split(".")
    for part in path:
        host = getattr(host, part)
    descriptor = getattr(type(host), name, None)
    if type(descriptor) is not StreamValue or descriptor.factor is not None:
        return None
    _, where, position = descriptor.site(host)
    return descriptor.location(host), repr(position)


def _unique(model: Any, reads: list) -> tuple[list, dict[str, str]]:
    """The reads with each location read once (a trace cannot read a tensor the model already ran past),
    and ``{alias key: key read}`` for the others."""
    seen: dict[tuple, str] = {}
    unique, aliases = [], {}
    for index, full in reads:
        location = _location(model, index, full)
        key = f"layers.{index}.{full}"
        if location is not None and location in seen:
            aliases[key] = seen[location]
            continue
        if location is not None:
            seen[location] = key
        unique.append((index, full))
    return unique, aliases


def _ordered(stored: dict, aliases: dict[str, str], keys: list[str]) -> list[str]:
    """The keys in the order the blocks compute them, aliases where their block lists them."""
    return sorted(stored, key=lambda key: (_block_of(key), keys.index(key) if key in keys else keys.index(aliases[key])))


def _block_of(key: str) -> float:
    if key == "token_embeddings":
        return -1
    match = _BLOCK_NAME.match(key)
    return int(match.group(1)) if match else float("inf")


def _read(model: Any, index: int, full: str) -> torch.Tensor:
    envoy = model.layers[index]
    for part in full.split("."):
        envoy = getattr(envoy, part)
    return envoy


def _body(model: Any, reads: list, roots: Sequence[str], with_logits: bool) -> tuple:
    """Inside a trace: the root and block values, in the order the model computes them, and the logits."""
    found: list = []
    if "token_embeddings" in roots:
        found.append(model.token_embeddings)
    for index, full in reads:
        found.append(_read(model, index, full))
    if "final_norm_output" in roots:
        found.append(model.final_norm_output)
    logits = model.prompt_logits if with_logits else None
    return found, logits


def _keep(cache: Cache, keep: Any) -> None:
    """Drop every stored value whose streamscope name and TransformerLens names all fail `keep`."""
    tl_of: dict[str, list[str]] = {}
    for name in cache.tl_names():
        source = _source_of(cache, name)
        if source is not None:
            tl_of.setdefault(source, []).append(name)
    cache.stored = {key: value for key, value in cache.stored.items()
                    if keep(key) or any(keep(name) for name in tl_of.get(key, []))}


def _source_of(cache: Cache, tl: str) -> Optional[str]:
    """The stored key a TransformerLens name is read from unchanged, or None for a computed one."""
    if tl in TL_ROOT:
        return TL_ROOT[tl]
    match = _TL_BLOCK_NAME.match(tl)
    if match is None or match.group(2) not in TL_BLOCK:
        return None
    return cache._block_key(int(match.group(1)), TL_BLOCK[match.group(2)][0])


def _slice_positions(cache: Cache, pos_slice: Any) -> None:
    """Slice every value's query-position axis as TransformerLens's run_with_cache(pos_slice=...)."""
    cache.stored = {key: apply_slice(value, pos_slice, seq_axes(key)[0]) for key, value in cache.stored.items()}
    cache.tokens, cache.mask = apply_slice(cache.tokens, pos_slice, 1), apply_slice(cache.mask, pos_slice, 1)
    if cache.logits is not None:
        cache.logits = apply_slice(cache.logits, pos_slice, 1)


def build_cache(model: Any, prompts: Any, values: Optional[Sequence[str]] = None,
                layers: Optional[Sequence[int]] = None, *, logits: bool = True, batch_size: Optional[int] = None,
                progress: Optional[bool] = None, names_filter: Any = None, pos_slice: Any = None,
                prepend_bos: Optional[bool] = None, padding_side: str = "left",
                remove_batch_dim: bool = False, device: Optional[Union[str, torch.device]] = None) -> Cache:
    """Run `prompts` and keep `values` of `layers` (every block by default): `model.cache`'s work.

    `values` None keeps what TransformerLens 4.3's run_with_cache keeps
    (`DEFAULT_VALUES`, which states its memory: the scores and pattern grow
    with the square of the length), ``"all"`` every value every block serves,
    a list those named. A block that does not serve a default value says why
    in `Cache.unavailable`; reading it raises `Unavailable` with that reason.

    `prompts` are strings or token ids (`_token_ids`). `names_filter` (a
    callable on names, a name or a list of names, as TransformerLens's
    run_with_cache) keeps the values whose streamscope name or one of whose
    TransformerLens names it accepts; `pos_slice` keeps those positions of
    every value (TransformerLens's ``Slice``: an int, a ``(start, stop)``
    tuple, a slice, a list of positions, a TransformerLens ``Slice``; an int
    keeps the axis with one entry, as TransformerLens's run_with_cache, a
    ``Slice(int)`` drops it). `remove_batch_dim` drops the batch axis of a
    run of one prompt (several are refused before the run). Several prompts are padded on
    `padding_side` (``"left"``: ``[:, -1]`` is every prompt's last token);
    `prepend_bos` None tokenizes text by the tokenizer's own rule, True puts
    one BOS first (TransformerLens's), False leaves it out. `device` keeps
    the tensors there (TL's ``device``: the model stays), None where run.
    """
    if not model.engine.runs_traces:  # a server (a streamscope.Client): its engine builds it from harvests
        return model.engine.cache(prompts, values, layers, logits=logits, batch_size=batch_size, progress=progress,
                                  names_filter=names_filter, pos_slice=pos_slice, prepend_bos=prepend_bos,
                                  padding_side=padding_side, remove_batch_dim=remove_batch_dim, device=device)
    prompts, pos_slice = _checked_request(model, prompts, prepend_bos, padding_side, remove_batch_dim, pos_slice)
    roots, reads, aliases, unavailable = _plan(model, names(values), indices(layers, model.num_layers, "block",
                                                                               "model.cache"))
    keys = _keys(roots, reads)
    tokens, mask = padded(model.tokenizer, prompts, padding_side)
    longest = tokens.shape[1]
    axes = [seq_axes(key) for key in keys] + ([seq_axes("logits")] if logits else [])

    def body() -> list[torch.Tensor]:
        found, prompt_logits = _body(model, reads, roots, logits)
        return [*found, *([prompt_logits] if logits else [])]

    per_prompt: list[list[torch.Tensor]] = []  # each prompt's values, [1, ...] without padding
    per_logits: list[torch.Tensor] = []
    batch_size = model.engine.batch(batch_size, 8, len(prompts))  # vLLM: every prompt in one trace
    show = progress if progress is not None else len(prompts) > batch_size
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="cache", unit="batch", disable=not show):
        chunk = list(range(start, min(start + batch_size, len(prompts))))
        with torch.no_grad():  # not inference mode: its tensors keep no version, so every read would count as an edit
            found = model.engine.run([prompts[i] for i in chunk], body, axes)
        per_prompt.extend(values[: len(keys)] for values in found)
        per_logits.extend(values[len(keys)] for values in found if logits)

    rows = {key: [found[position] for found in per_prompt] for position, key in enumerate(keys)}
    stored = _stored(keys, rows, aliases, longest, padding_side)
    stored_logits = _pad("logits", per_logits, longest, padding_side) if logits else None
    cache = _assemble(model, stored, tokens, mask, stored_logits, unavailable, padding_side)
    apply_run_with_cache_arguments(cache, names_filter, pos_slice, remove_batch_dim, device)
    return cache


def _checked_request(model: Any, prompts: Any, prepend_bos: Optional[bool], padding_side: str,
                     remove_batch_dim: bool, pos_slice: Any) -> tuple[list[list[int]], Any]:
    """A cache's prompts as token ids (`_token_ids`) and its `pos_slice` as an index, with the request's other
    arguments checked before anything runs (in process, or on a server's harvests)."""
    check_padding_side(padding_side)
    ids = _token_ids(model, prompts, prepend_bos)
    if remove_batch_dim and len(ids) != 1:
        raise ValueError(f"remove_batch_dim=True needs one prompt, not {len(ids)} (as TransformerLens): run "
                         f"them without it, or pick one with cache.apply_slice_to_batch_dim(i)")
    if pos_slice is not None:
        # Checked before the run; a plain int keeps the position axis and a TL Slice(int) drops it, as TL 4.3.
        pos_slice = as_index(keep_axis(pos_slice))
    return list(ids), pos_slice


def _keys(roots: Sequence[str], reads: Sequence[tuple[int, str]]) -> list[str]:
    """The cache's keys of a run's reads, in the order the run returns them: the embeddings, the blocks' values
    (``layers.<index>.<full name>``), the final norm's output."""
    return [*(["token_embeddings"] if "token_embeddings" in roots else []),
            *(f"layers.{index}.{full}" for index, full in reads),
            *(["final_norm_output"] if "final_norm_output" in roots else [])]


def _stored(keys: list[str], rows: Mapping[str, list[torch.Tensor]], aliases: dict[str, str], longest: int,
            padding_side: str) -> dict[str, torch.Tensor]:
    """Each key's prompts' `rows` (``[1, ...]`` each, unpadded) padded into one ``[batch, ...]`` tensor (`_pad`),
    with each alias beside its key, in the order the blocks compute them."""
    stored = {key: _pad(key, rows[key], longest, padding_side) for key in keys}
    for alias, key in aliases.items():  # a value the block computes once under two names (GPT-J's one norm)
        stored[alias] = stored[key]
    return {key: stored[key] for key in _ordered(stored, aliases, keys)}


def _plan(model: Any, values: Optional[list], layers: Sequence[int]) -> tuple[list, list, dict, dict[str, str]]:
    """What a run reads: the root values, the (block, full name) reads with each location once, the aliases, and
    ``{key: reason}`` for what is not served. `values` None is `DEFAULT_VALUES`, ``["all"]`` every served value."""
    lenient = values is None or values == [ALL]
    roots = list(ROOT) if lenient else [name for name in values or () if name in ROOT]
    values = list(dict.fromkeys(DEFAULT_VALUES if values is None else values))  # a name given twice is read once
    root_rows = model.support().root.rows
    root_unavailable = {name: root_rows[name] for name in roots if root_rows.get(name) is not None}
    roots = [name for name in roots if name not in root_unavailable]
    block_values = [name for name in values if name not in ROOT]
    reads, unavailable = _block_keys(model, block_values, layers, lenient)
    unavailable.update(root_unavailable)
    reads, aliases = _unique(model, reads)
    return roots, reads, aliases, unavailable


def _assemble(model: Any, stored: dict[str, torch.Tensor], tokens: torch.Tensor, mask: torch.Tensor,
              logits: Optional[torch.Tensor], unavailable: dict[str, str], padding_side: str) -> Cache:
    """The `Cache` of a run's padded values, with what its methods read from the model."""
    final_norm = _final_norm(model, stored, mask)
    try:
        heads: Optional[int] = model.num_heads
    except Unavailable:
        heads = None
    return Cache(stored, tokens=tokens, mask=mask, logits=logits, model_type=model.config.model_type,
                 num_layers=model.num_layers, unavailable=unavailable, final_norm=final_norm,
                 unembedding=model.engine.unembedding_rows, head=model.engine.head_parameters,
                 norm_inputs=norm_inputs(model),
                 num_heads=heads, tokenizer=model.tokenizer, logit_transform=scaling_in_words(model.config),
                 output_weights=_output_weights(model), down_weights=model.engine.down_projections,
                 learned_positions=model.family_spec.learned_positions, padding_side=padding_side, model=model)


def apply_run_with_cache_arguments(cache: Cache, names_filter: Any, pos_slice: Any, remove_batch_dim: bool, device: Any) -> None:
    """TransformerLens's run_with_cache arguments applied to a built cache, in place, in TL's order (a model's
    cache here, a server's in `streamscope.serve.remote_cache`)."""
    keep = _names_filter(names_filter)
    if keep is not None:
        _keep(cache, keep)
        cache.names_filter = keep
    if pos_slice is not None:
        _slice_positions(cache, pos_slice)
    if remove_batch_dim:
        cache.remove_batch_dim()
    if device is not None:
        cache.to(device)


#: The axes of each value that run over positions (the rest are batch, heads or widths).
_SEQ_AXES = {"queries": (2,), "keys": (2,), "values": (2,), "scores": (2, 3), "pattern": (2, 3),
             "queries_pre_rotary": (2,), "keys_pre_rotary": (2,), "queries_projected": (2,),
             "keys_projected": (2,)}


def seq_axes(key: str) -> tuple[int, ...]:
    """The axes of the value under `key` that run over the prompt's positions."""
    return _SEQ_AXES.get(key.split(".")[-1], (1,))


def _pad(key: str, per_prompt: list[torch.Tensor], longest: int, side: str = "left") -> torch.Tensor:
    """``[batch, ...]``: one prompt's values each (``[1, ...]``), zero-padded on `side` along the seq axes (an
    attention pattern's query and key axes both)."""
    axes = seq_axes(key)
    shape = [len(per_prompt), *per_prompt[0].shape[1:]]
    for axis in axes:
        shape[axis] = longest
    out = per_prompt[0].new_zeros(shape)
    for row, tensor in enumerate(per_prompt):
        where: list[Any] = [slice(None)] * (tensor.dim() - 1)
        for axis in axes:
            size = tensor.shape[axis]
            where[axis - 1] = slice(0, size) if side == "right" else slice(longest - size, longest)
        out[(row, *where)] = tensor[0]
    return out


def _final_norm(model: Any, stored: dict[str, torch.Tensor], mask: torch.Tensor) -> Optional[FinalNorm]:
    """The final norm, in the form that reproduces the model's own output on this run (None where not read)."""
    key = f"layers.{model.num_layers - 1}.layer_output"
    if key not in stored or "final_norm_output" not in stored:
        return None
    weight, bias, eps = model.engine.norm_parameters()
    real = mask  # padded positions hold zeros, which a norm with a bias does not map to zero
    return fit_final_norm(weight, bias, eps, stored[key][real], stored["final_norm_output"][real])
