"""A cache of a run's values, answering streamscope's names and TransformerLens's hook names.

    cache = model.cache(["The Eiffel Tower is in", "Rome is the capital of"])
    cache["layers.3.layer_mid"]              # [batch, seq, hidden_size]
    cache["blocks.3.hook_resid_mid"]         # the same tensor, by its TransformerLens name
    cache.stack("layer_output")              # [blocks, batch, seq, hidden_size]
    parts, labels = cache.decompose_resid()  # embeddings, then each block's attention and MLP
    cache.logit_attrs(parts, tokens=answer)  # each part's direct effect on the answer's logit

Several prompts are padded on the right to the longest, and `mask`
``[batch, seq]`` says which positions are real; the values at padded positions
are zero. On transformers the prompts run as one batch with an attention mask
(right padding leaves every real position's value exactly as the prompt alone
gives it); on vLLM each prompt is its own request, and the values are padded
afterwards.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from ..blocks import BOUNDARIES, SHORT_CONTRIBUTIONS, Attention
from ..blocks.heads import INTERNALS
from ..engine import right_padded
from ..families.spec import ROOT_STREAMS
from ..errors import Unavailable

ATTENTION = tuple(f"{Attention.ROLE}.{name}" for name in INTERNALS)
ROOT = ROOT_STREAMS
#: What `model.cache` reads by default: every served boundary and contribution, and the root values.
DEFAULT_VALUES = (*BOUNDARIES, *SHORT_CONTRIBUTIONS)

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
    "ln1.hook_normalized": ("attention_norm_output", None),
    "ln2.hook_normalized": ("mlp_norm_output", None),
    "hook_attn_out": ("attention_output", None),
    "hook_mlp_in": ("mlp_input", None),
    "hook_mlp_out": ("mlp_output", None),
    "attn.hook_q": ("self_attn.queries", "heads_last"),
    "attn.hook_k": ("self_attn.keys", "heads_last"),
    "attn.hook_rot_q": ("self_attn.queries", "heads_last"),
    "attn.hook_rot_k": ("self_attn.keys", "heads_last"),
    "attn.hook_v": ("self_attn.values", "heads_last"),
    "attn.hook_z": ("self_attn.head_outputs", None),
    "attn.hook_attn_scores": ("self_attn.scores", None),
    "attn.hook_pattern": ("self_attn.pattern", None),
}
TL_ROOT = {"hook_embed": "token_embeddings", "ln_final.hook_normalized": "final_norm_output"}
#: TransformerLens hooks streamscope serves no value for, with the reason.
TL_UNSERVED = {
    "attn.hook_result": "streamscope serves each head's output before the output projection "
                        "(attn.hook_z, self_attn.head_outputs), not after it",
    "mlp.hook_pre": "streamscope serves the MLP's input and output, not its hidden activations",
    "mlp.hook_post": "streamscope serves the MLP's input and output, not its hidden activations",
    "ln1.hook_scale": "streamscope serves the norms' outputs, not their scales",
    "ln2.hook_scale": "streamscope serves the norms' outputs, not their scales",
    "hook_attn_in": "streamscope serves what the attention is called with as attention_norm_output "
                    "(ln1.hook_normalized), not per head",
}
_TL_BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")
_BLOCK_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


class Cache(Mapping):
    """The values of a run over one or more prompts, keyed ``layers.{i}.{value}`` and by root names.

    Attributes:
        tokens: ``[batch, seq]`` token ids, padded on the right with the pad id.
        mask: ``[batch, seq]``, True at real positions.
        logits: ``[batch, seq, vocab_size]``: the model's logits at every position.
        model_type: The family's ``config.model_type``.
        learned_positions: Whether the family adds learned position embeddings to the stream before block 0
            (`FamilySpec.learned_positions`: GPT-2, OPT).
        num_layers: The number of blocks.
        unavailable: ``{key: reason}`` for every asked-for value some block cannot serve.
        final_norm: The final norm as a frozen-scale map, see `apply_ln_to_stack`.
    """

    def __init__(self, values: dict[str, torch.Tensor], *, tokens: torch.Tensor, mask: torch.Tensor,
                 logits: Optional[torch.Tensor], model_type: str, num_layers: int,
                 unavailable: dict[str, str], final_norm: "FinalNorm | None", unembedding: Any = None,
                 learned_positions: bool = False) -> None:
        self.values = values
        self.tokens, self.mask, self.logits = tokens, mask, logits
        self.model_type, self.num_layers = model_type, num_layers
        self.learned_positions = learned_positions
        self.unavailable = unavailable
        self.final_norm = final_norm
        self._unembedding = unembedding

    # Mapping: keys are streamscope names.

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
            return True
        except (KeyError, Unavailable):
            return False

    def __getitem__(self, key: str) -> torch.Tensor:
        """The value under a streamscope name (``layers.3.layer_mid``, ``token_embeddings``) or a TL hook name."""
        if key in self.values:
            return self.values[key]
        block = _BLOCK_NAME.match(key)
        if block is not None:
            index, name = int(block.group(1)), block.group(2)
            if index >= self.num_layers:
                raise KeyError(f"{key!r}: block {index} is out of range: the model has {self.num_layers} "
                               f"(layers.0 to layers.{self.num_layers - 1})")
            for full in _spellings(name):
                if f"layers.{index}.{full}" in self.values:
                    return self.values[f"layers.{index}.{full}"]
                if f"layers.{index}.{full}" in self.unavailable:
                    raise Unavailable(full, f"model.layers[{index}]", self.unavailable[f"layers.{index}.{full}"])
            raise KeyError(f"{key!r} is not in this cache: model.cache(..., values=[{name!r}]) reads it")
        if key in self.unavailable:
            raise Unavailable(key, "model", self.unavailable[key])
        return self._transformer_lens(key)

    def _transformer_lens(self, key: str) -> torch.Tensor:
        if key in TL_ROOT:
            return self[TL_ROOT[key]]
        if key == "hook_pos_embed":
            if not self.learned_positions:
                raise Unavailable("hook_pos_embed", "model", f"a {self.model_type} model adds no position embedding "
                                  "to the stream (its positions enter inside attention, by rotary or not at all)")
            # Exact: block 0's input is the token embeddings plus the position embeddings.
            return self["layers.0.layer_input"] - self["token_embeddings"]
        match = _TL_BLOCK_NAME.match(key)
        if match is None:
            raise KeyError(f"{key!r} is neither a streamscope name (layers.3.layer_mid, token_embeddings) nor a "
                           f"TransformerLens hook name this cache knows ({', '.join(sorted(TL_ROOT))}, "
                           f"blocks.3.{{{', '.join(TL_BLOCK)}}})")
        index, hook = int(match.group(1)), match.group(2)
        if hook in TL_UNSERVED:
            raise Unavailable(hook, f"blocks.{index}", TL_UNSERVED[hook])
        if hook not in TL_BLOCK:
            raise KeyError(f"{key!r}: TransformerLens hook {hook!r} has no streamscope counterpart; known: "
                           f"{', '.join(TL_BLOCK)}")
        name, layout = TL_BLOCK[hook]
        if hook in ("attn.hook_q", "attn.hook_k") and self.rotary:
            raise Unavailable(hook, f"blocks.{index}", "streamscope serves queries and keys after the rotary "
                              f"embedding: read blocks.{index}.attn.hook_rot_{hook[-1]}")
        value = self[f"layers.{index}.{name}"]
        # TransformerLens lays per-head values out [batch, pos, head, d_head]; streamscope [batch, head, seq, d].
        return value.transpose(1, 2) if layout == "heads_last" else value

    @property
    def rotary(self) -> bool:
        """Whether the family rotates queries and keys (TransformerLens's hook_q is before the rotation)."""
        return not self.learned_positions

    # TransformerLens's ActivationCache operations.

    def stack(self, name: str, layers: Optional[Iterable[int]] = None) -> torch.Tensor:
        """``[blocks, ...]``: value `name` of every block (or of `layers`), a streamscope or TL block name.

        ``cache.stack("layer_mid")`` and ``cache.stack("hook_resid_mid")`` are the same tensor.
        """
        layers = range(self.num_layers) if layers is None else layers
        tl = name in TL_BLOCK or name in TL_UNSERVED
        return torch.stack([self[f"blocks.{i}.{name}" if tl else f"layers.{i}.{name}"] for i in layers])

    def accumulated_resid(self, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                          return_labels: bool = False) -> Any:
        """``[components, batch, seq, hidden]``: the stream entering each block, then the final stream.

        As TransformerLens's: block i's ``layer_input`` for i < `layer` (all blocks
        by default), with each ``layer_mid`` after it when `incl_mid`, then
        the stream after the last block read (``layer_output``). `apply_ln`
        applies the final norm frozen at the final stream's scale (see
        `apply_ln_to_stack`).
        """
        layer = self.num_layers if layer is None else layer
        parts, labels = [], []
        for index in range(layer):
            parts.append(self[f"layers.{index}.layer_input"])
            labels.append(f"{index}_pre")
            if incl_mid:
                parts.append(self[f"layers.{index}.layer_mid"])
                labels.append(f"{index}_mid")
        if layer == self.num_layers:
            parts.append(self[f"layers.{layer - 1}.layer_output"])
            labels.append("final_post")
        else:
            parts.append(self[f"layers.{layer}.layer_input"])
            labels.append(f"{layer}_pre")
        stack = torch.stack(parts)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, apply_ln: bool = False, return_labels: bool = True) -> Any:
        """``[components, batch, seq, hidden]``: what the final stream is the sum of.

        The stream entering block 0 (``embed``: token embeddings plus any
        position embeddings), then each block's attention and MLP
        contributions (``{i}_attn_out``, ``{i}_mlp_out``). They sum to the last
        block's ``layer_output``. A family whose blocks don't add their
        sublayers' outputs to the stream unchanged (a post-LN block) serves no
        contributions, and this raises `Unavailable` with the block's reason; a
        block with one sublayer (Mamba) contributes its mixer only.
        """
        parts, labels = [self["layers.0.layer_input"]], ["embed"]
        for index in range(self.num_layers):
            for short, label in (("attention_output", "attn_out"), ("mlp_output", "mlp_out")):
                try:
                    parts.append(self[f"layers.{index}.{short}"])
                except Unavailable as error:
                    # A block with one sublayer (Mamba's mixer) adds no MLP: nothing is missing from the sum.
                    if short == "mlp_output" and error.code in ("missing_module", "one_sublayer"):
                        continue
                    raise
                labels.append(f"{index}_{label}")
        stack = torch.stack(parts)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, stack: torch.Tensor) -> torch.Tensor:
        """The final norm applied to each component with the final stream's scale, as TransformerLens does.

        A norm is ``(x - mean(x)) / scale(x) * weight + bias`` (no centring for
        an RMS norm; Gemma's weight is ``1 + w``). Here ``scale`` is the
        final stream's (the last block's ``layer_output``), so the map is linear
        and the components' results sum to the final norm's output minus its
        bias. The weight is applied (not folded into the unembedding); the bias
        is left out, as it belongs to no component.
        """
        if self.final_norm is None:
            raise ValueError("this cache has no final norm parameters")
        return self.final_norm.frozen(stack, self[f"layers.{self.num_layers - 1}.layer_output"])

    def logit_attrs(self, stack: torch.Tensor, tokens: Any, incorrect_tokens: Any = None,
                    has_batch_dim: bool = True) -> torch.Tensor:
        """Each component's direct effect on the logit of `tokens` (minus `incorrect_tokens`'), ``[components, batch, seq]``.

        `stack` is a stack of streams ``[components, batch, seq, hidden]``
        (`decompose_resid`, `accumulated_resid`), before any norm: the final
        norm is applied here frozen at the final stream's scale
        (`apply_ln_to_stack`), then each is projected on the unembedding row of
        `tokens` (an id, or a ``[batch]`` tensor of ids). Summed over
        `decompose_resid`'s components this is the model's logit of the token
        before any soft cap or logit scale, less the unembedding of the norm's
        bias and the head's bias. Reads the unembedding rows from the model
        (on vLLM, from its worker).
        """
        normed = self.apply_ln_to_stack(stack)
        direction = self.unembedding_rows(tokens, normed.shape[1])
        if incorrect_tokens is not None:
            direction = direction - self.unembedding_rows(incorrect_tokens, normed.shape[1])
        return torch.einsum("cbsh,bh->cbs", normed, direction.to(normed.dtype))

    def unembedding_rows(self, tokens: Any, batch: int) -> torch.Tensor:
        """``[batch, hidden]``: the unembedding row of each prompt's token."""
        ids = torch.as_tensor(tokens).reshape(-1)
        if ids.numel() == 1:
            ids = ids.expand(batch)
        if self._unembedding is None:
            raise ValueError("this cache was built without access to the model's unembedding")
        return self._unembedding(ids)

    def __repr__(self) -> str:
        return (f"Cache({self.model_type}, {self.num_layers} blocks, batch {self.tokens.shape[0]}, "
                f"seq {self.tokens.shape[1]}, {len(self.values)} values)")

    def _repr_html_(self) -> str:
        from .display import shape, table

        # One row per value name, its blocks and shape (a block's values share their shapes).
        names: dict[str, list] = {}
        for key, value in self.values.items():
            match = _BLOCK_NAME.match(key)
            name, block = (match.group(2), match.group(1)) if match else (key, "root")
            names.setdefault(name, [[], shape(value)])[0].append(block)
        rows = [[name, ", ".join(blocks) if len(blocks) < 6 else f"{blocks[0]}-{blocks[-1]}", size]
                for name, (blocks, size) in names.items()]
        if self.logits is not None:
            rows.append(["logits", "root", shape(self.logits)])
        return table(repr(self), ["value", "blocks", "shape"], rows)


class FinalNorm:
    """A final norm's parameters, for applying it frozen at a given stream's scale."""

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

    def frozen(self, stack: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        _, scale = self.normalize(final)
        centred = stack - stack.mean(-1, keepdim=True) if self.centred else stack
        return centred / scale * (self.weight if self.weight is not None else 1)


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


def _block_keys(model: Any, values: Sequence[str], layers: Sequence[int]) -> tuple[list, dict[str, str]]:
    """(block, full name) pairs to read in the order each block computes them, and the unserved ones' reasons."""
    wanted = {name for name in values}
    reads, unavailable = [], {}
    for index in layers:
        rows = model.layers[index].support().rows
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
                raise ValueError(f"{name!r} is not a value of model.layers[{index}]; its values: {', '.join(rows)}")
    return reads, unavailable


def _location(model: Any, index: int, full: str) -> Optional[tuple]:
    """Where a plain value is read (module, input or output, argument), or None for a computed or scaled one."""
    from ..values import StreamValue

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


def build_cache(model: Any, prompts: str | Sequence[str], values: Optional[Sequence[str]] = None,
                layers: Optional[Sequence[int]] = None, *, logits: bool = True, batch_size: int = 8,
                progress: Optional[bool] = None) -> Cache:
    """Run `prompts` and keep `values` of `layers` (every block by default): `model.cache`'s work."""
    from tqdm.auto import tqdm

    from ..input_checks import indices, names

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("model.cache needs at least one prompt")
    if not all(isinstance(prompt, str) for prompt in prompts):
        raise TypeError("model.cache takes a prompt (a string) or a list of them")
    values = names(values)
    roots = list(ROOT) if values is None else [name for name in values if name in ROOT]
    values = list(DEFAULT_VALUES if values is None else values)
    root_rows = model.support().root.rows
    root_unavailable = {name: root_rows[name] for name in roots if root_rows.get(name) is not None}
    roots = [name for name in roots if name not in root_unavailable]
    block_values = [name for name in values if name not in ROOT]
    layers = indices(layers, model.num_layers, "block", "model.cache")
    reads, unavailable = _block_keys(model, block_values, layers)
    unavailable.update(root_unavailable)
    reads, aliases = _unique(model, reads)
    keys = [*(["token_embeddings"] if "token_embeddings" in roots else []),
            *(f"layers.{index}.{full}" for index, full in reads),
            *(["final_norm_output"] if "final_norm_output" in roots else [])]
    tokens, mask = right_padded(model.tokenizer, prompts)
    longest = tokens.shape[1]
    axes = [seq_axes(key) for key in keys] + ([seq_axes("logits")] if logits else [])

    def body() -> list[torch.Tensor]:
        found, prompt_logits = _body(model, reads, roots, logits)
        return [*found, *([prompt_logits] if logits else [])]

    per_prompt: list[list[torch.Tensor]] = []  # each prompt's values, [1, ...] without padding
    per_logits: list[torch.Tensor] = []
    show = progress if progress is not None else len(prompts) > batch_size
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="cache", unit="batch", disable=not show):
        chunk = list(range(start, min(start + batch_size, len(prompts))))
        with torch.no_grad():  # not inference mode: its tensors keep no version, so every read would count as an edit
            found = model.engine.run([prompts[i] for i in chunk], body, axes)
        per_prompt.extend(values[: len(keys)] for values in found)
        per_logits.extend(values[len(keys)] for values in found if logits)

    stored: dict[str, torch.Tensor] = {}
    for position, key in enumerate(keys):
        stored[key] = _pad(key, [found[position] for found in per_prompt], longest)
    for alias, key in aliases.items():  # a value the block computes once under two names (GPT-J's one norm)
        stored[alias] = stored[key]
    stored = {key: stored[key] for key in _ordered(stored, aliases, keys)}
    stored_logits = _pad("logits", per_logits, longest) if logits else None
    final_norm = _final_norm(model, stored, mask)
    return Cache(stored, tokens=tokens, mask=mask, logits=stored_logits, model_type=model.config.model_type,
                 num_layers=model.num_layers, unavailable=unavailable, final_norm=final_norm,
                 unembedding=model.engine.unembedding_rows, learned_positions=model.family_spec.learned_positions)


#: The axes of each value that run over positions (the rest are batch, heads or widths).
_SEQ_AXES = {"queries": (2,), "keys": (2,), "values": (2,), "scores": (2, 3), "pattern": (2, 3)}


def seq_axes(key: str) -> tuple[int, ...]:
    """The axes of the value under `key` that run over the prompt's positions."""
    return _SEQ_AXES.get(key.split(".")[-1], (1,))


def _pad(key: str, per_prompt: list[torch.Tensor], longest: int) -> torch.Tensor:
    """``[batch, ...]``: one prompt's values each (``[1, ...]``), zero-padded on the right along the seq axes."""
    shape = [len(per_prompt), *per_prompt[0].shape[1:]]
    for axis in seq_axes(key):
        shape[axis] = longest
    out = per_prompt[0].new_zeros(shape)
    for row, tensor in enumerate(per_prompt):
        out[(row, *(slice(0, size) for size in tensor.shape[1:]))] = tensor[0]
    return out


def _final_norm(model: Any, stored: dict[str, torch.Tensor], mask: torch.Tensor) -> Optional[FinalNorm]:
    """The final norm, in the form that reproduces the model's own output on this run (None where not read)."""
    key = f"layers.{model.num_layers - 1}.layer_output"
    if key not in stored or "final_norm_output" not in stored:
        return None
    weight, bias, eps = model.engine.norm_parameters()
    real = mask  # padded positions hold zeros, which a norm with a bias does not map to zero
    return fit_final_norm(weight, bias, eps, stored[key][real], stored["final_norm_output"][real])
