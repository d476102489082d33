"""TransformerLens's runs on a streamscope model: ``run_with_hooks`` and ``run_with_cache``, with TL's losses.

    logits = model.run_with_hooks("The Eiffel Tower is in", fwd_hooks=[
        ("blocks.1.hook_resid_pre", lambda resid, hook: resid * 0.5),           # a returned tensor replaces it
        ("layers.2.self_attn.pattern", lambda pattern, hook: None),            # streamscope names too (a read)
    ])
    loss = model.run_with_hooks(prompts, fwd_hooks=hooks, return_type="loss")  # mean next-token cross entropy
    per_token = model.run_with_hooks(prompts, return_type="loss", loss_per_token=True)   # [batch, pos - 1]
    logits, cache = model.run_with_cache(prompts)

A hook is named by a TransformerLens 4.3 hook name (``blocks.3.hook_resid_pre``, ``blocks.0.attn.hook_z``,
``hook_embed``, ``ln_final.hook_out``), resolved with the same map `model.cache` answers them with
(`streamscope.workflows.cache.TL_BLOCK`), by a streamscope name (``layers.3.layer_input``,
``layers.0.self_attn.queries``, ``token_embeddings``), or by a filter: a function of a TransformerLens hook name,
applied to every TransformerLens name this model serves (`hook_names`). A hook function is called as TL calls it,
``hook_fn(value, hook)`` with ``hook.name`` the name it matched, and it runs inside the engine's run, where the
value is computed: a tensor it returns takes the value's place, and an in-place edit of the value reaches the model
too (both are streamscope writes, checked for shape and dtype before they reach the model). Values come in
TransformerLens's layout (``attn.hook_q`` ``[batch, pos, head, d_head]``) under TL names and in streamscope's
(``self_attn.queries`` ``[batch, head, seq, head_dim]``) under streamscope names.

How a run batches follows the engine, as a trace does: on transformers several prompts run as one batch padded on
the left (a hook sees ``[batch, seq, ...]``, position -1 every prompt's last token, padding rows included); on
vLLM each prompt is one request and a hook is called once per prompt with ``[1, tokens, ...]``. The logits and
losses that come back are the same on both: ``[batch, seq, vocab_size]`` padded on the left with zeros, and TL's
loss over the real tokens only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..engine import padded
from ..errors import Unavailable
from .cache import TL_BLOCK, TL_COMPUTED, TL_ROOT, TL_UNSERVED, _location, _slice_positions, _token_ids, build_cache
from .tl import as_index, keep_axis

#: What `run_with_hooks` and `run_with_cache` return, by TransformerLens's ``return_type``.
RETURN_TYPES = ("logits", "loss", "both", None)
#: A hook function, as TransformerLens calls it: ``(value, hook) -> a tensor to put in its place, or None``.
HookFunction = Callable[[torch.Tensor, "Hook"], Optional[torch.Tensor]]
#: A hook's name: a TransformerLens or streamscope name, or a filter of TransformerLens names.
HookName = Union[str, Callable[[str], bool]]

_TL_BLOCK_NAME = re.compile(r"^blocks\.(-?\d+)\.(.+)$")
_BLOCK_NAME = re.compile(r"^layers\.(-?\d+)\.(.+)$")
_ROOTS = ("token_embeddings", "final_norm_output")


class Hook:
    """The second argument of a hook function, as TransformerLens's ``HookPoint``: which value it was called on.

    Attributes:
        name: The name the hook was asked for under (or, for a filter, the TransformerLens name it matched).
        ctx: A dict the hook functions of one run may keep things in (TL's ``hook.ctx``); each run starts empty.
    """

    def __init__(self, name: str, layer: Optional[int]) -> None:
        self.name = name
        self._layer = layer
        self.ctx: dict[str, Any] = {}

    def layer(self) -> int:
        """The block the value belongs to (TL's ``hook.layer()``); a root value (embeddings, final norm) has none."""
        if self._layer is None:
            raise ValueError(f"{self.name} is a value of the model's root, not of a block: it has no layer")
        return self._layer

    def __repr__(self) -> str:
        return f"Hook({self.name!r})"


@dataclass(frozen=True)
class HookSite:
    """A value a hook is called on: a block's value (`layer` its index) or a root value (`layer` None).

    Attributes:
        value: Its streamscope name within the block (``self_attn.queries``) or at the root (``token_embeddings``).
        heads_last: Whether the hook sees it in TransformerLens's ``[batch, pos, head, d_head]`` layout, the
            transpose of streamscope's ``[batch, head, seq, head_dim]`` (TL's ``attn.hook_q``/``k``/``v``).
    """

    layer: Optional[int]
    value: str
    heads_last: bool = False

    def host(self, model: Any) -> tuple[Any, str]:
        """The envoy that holds the value, and the value's attribute name on it."""
        envoy = model if self.layer is None else model.layers[self.layer]
        *path, name = self.value.split(".")
        for part in path:
            envoy = getattr(envoy, part)
        return envoy, name


def _block_value(model: Any, index: int, name: str, asked: str) -> str:
    """Block `index`'s full name for `name` (a short contribution name reaches its sublayer's), served or refused."""
    rows = model.layers[index].support().rows
    matches = [full for full in rows if full == name or full.endswith("." + name)]
    served = [full for full in matches if rows[full] is None]
    if served:
        return served[0]
    if matches:
        raise Unavailable(matches[0], f"model.layers[{index}]", rows[matches[0]] or "")
    raise ValueError(f"{asked!r}: {name!r} is not a value of model.layers[{index}]; its values: {', '.join(rows)}")


def _index(model: Any, text: str, asked: str) -> int:
    index = int(text)
    count = model.num_layers
    if not -count <= index < count:
        raise ValueError(f"{asked!r}: block {index} is out of range: the model has {count} (0 to {count - 1})")
    return index % count


def resolve(model: Any, name: str) -> HookSite:
    """The value a hook named `name` (a TransformerLens 4.3 hook name or a streamscope name) is called on.

    TransformerLens names go through `model.cache`'s map (`streamscope.workflows.cache.TL_BLOCK`, `TL_ROOT`);
    a value the block does not serve raises `Unavailable` with the reason, a TL hook streamscope computes from other
    values (``attn.hook_result``, ``ln1.hook_scale``) raises with what it is computed from, since no edit of it can
    reach the model."""
    if name in _ROOTS:
        reason = model.support().root.rows.get(name)
        if reason is not None:
            raise Unavailable(name, "model", reason)
        return HookSite(None, name)
    if name in TL_ROOT:
        return resolve(model, TL_ROOT[name])
    block = _BLOCK_NAME.match(name)
    if block is not None:
        index = _index(model, block.group(1), name)
        return HookSite(index, _block_value(model, index, block.group(2), name))
    match = _TL_BLOCK_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is neither a TransformerLens hook name ({', '.join(TL_ROOT)}, "
                         f"blocks.3.hook_resid_pre, ...) nor a streamscope name (layers.3.layer_input, "
                         f"token_embeddings, final_norm_output); `streamscope.workflows.runs.hook_names(model)` "
                         f"lists the TransformerLens names this model serves")
    index, hook = _index(model, match.group(1), name), match.group(2)
    if hook in TL_UNSERVED:
        raise Unavailable(hook, f"blocks.{index}", TL_UNSERVED[hook])
    if hook in TL_COMPUTED:
        raise ValueError(f"{name!r} is computed from other values for a cache ({TL_COMPUTED[hook]}), not a value "
                         f"the model holds, so a hook cannot edit it there: hook the value it is computed from")
    if hook not in TL_BLOCK:
        raise ValueError(f"{name!r}: TransformerLens hook {hook!r} has no streamscope counterpart to hook; known: "
                         f"{', '.join(TL_BLOCK)}")
    value, layout = TL_BLOCK[hook]
    return HookSite(index, _block_value(model, index, value, name), heads_last=layout == "heads_last")


def hook_names(model: Any) -> list[str]:
    """Every TransformerLens 4.3 hook name a hook can be put on in this model, in the order the model computes
    them: what a filter given to `run_with_hooks` is applied to."""
    found = [tl for tl, root in TL_ROOT.items() if root == "token_embeddings"]
    for index in range(model.num_layers):
        for hook in TL_BLOCK:
            try:
                resolve(model, f"blocks.{index}.{hook}")
            except (Unavailable, ValueError):
                continue
            found.append(f"blocks.{index}.{hook}")
    found += [tl for tl, root in TL_ROOT.items() if root == "final_norm_output"]
    return [name for name in found if _served_root(model, name)]


def _served_root(model: Any, name: str) -> bool:
    if name not in TL_ROOT:
        return True
    return model.support().root.rows.get(TL_ROOT[name]) is None


def _order(model: Any, site: HookSite) -> tuple[float, int]:
    """Where `site` comes in the model's computation: (block, its place in the block's support rows)."""
    if site.layer is None:
        return (-1.0 if site.value == "token_embeddings" else float("inf"), 0)
    return (float(site.layer), list(model.layers[site.layer].support().rows).index(site.value))


def plan(model: Any, fwd_hooks: Sequence[tuple[HookName, HookFunction]]) -> list[tuple[HookSite, list]]:
    """The hooks grouped by the tensor they are called on, in the order the model computes those tensors.

    Each entry is ``(site, [(name, layout site, function), ...])``: hooks on one value, or on two names of one
    tensor (GPT-J's one norm, read as both ``ln1`` and ``ln2``), run in the order given, each on what the one
    before left."""
    if isinstance(fwd_hooks, tuple) and len(fwd_hooks) == 2 and callable(fwd_hooks[1]):
        raise TypeError("fwd_hooks is a list of (name, hook_fn) pairs: wrap the one pair in a list")
    hooks: list[tuple[str, HookSite, HookFunction]] = []
    for entry in fwd_hooks:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[1])):
            raise TypeError(f"each of fwd_hooks is a (name or filter, hook_fn) pair, not {entry!r:.80}")
        name, function = entry
        if callable(name):
            matched = [tl for tl in hook_names(model) if name(tl)]
            hooks += [(tl, resolve(model, tl), function) for tl in matched]
        elif isinstance(name, str):
            hooks.append((name, resolve(model, name), function))
        else:
            raise TypeError(f"a hook's name is a string or a filter (a function of a name), not {name!r:.80}")
    groups: dict[Any, list] = {}
    sites: dict[Any, HookSite] = {}
    for name, site, function in hooks:
        key = _location(model, site.layer, site.value) if site.layer is not None else None
        key = key if key is not None else (site.layer, site.value)
        sites.setdefault(key, HookSite(site.layer, site.value))
        groups.setdefault(key, []).append((name, site, function))
    ordered = sorted(groups, key=lambda key: _order(model, sites[key]))
    return [(sites[key], groups[key]) for key in ordered]


def _run_hooks(model: Any, site: HookSite, hooks: list) -> None:
    """Inside a run: read `site`, call its hooks in order, and write back what they return."""
    host, attribute = site.host(model)
    value = getattr(host, attribute)
    current = value
    for name, shown_as, function in hooks:
        shown = current.transpose(-3, -2) if shown_as.heads_last else current
        result = function(shown, Hook(name, site.layer))
        if result is None or result is shown:
            continue
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(shown.shape):
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise ValueError(f"the hook on {name} returned {got}; return None (an in-place edit reaches the model "
                             f"too) or a tensor of the value's shape {tuple(shown.shape)}")
        current = result.transpose(-3, -2) if shown_as.heads_last else result
    if current is not value:
        setattr(host, attribute, current)


def _check_return_type(return_type: Any) -> None:
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type={return_type!r}: give \"logits\", \"loss\", \"both\" (logits, then the "
                         f"loss) or None, as TransformerLens")


def lm_cross_entropy_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: Optional[torch.Tensor] = None,
                          per_token: bool = False) -> torch.Tensor:
    """TransformerLens's language-model loss: the cross entropy of each next token, over real positions.

    Args:
        logits: ``[batch, seq, vocab_size]``.
        tokens: ``[batch, seq]`` token ids.
        mask: ``[batch, seq]``, True at real positions (None: all real). A prediction counts where it and the
            token it predicts are both real, as TL's ``lm_cross_entropy_loss`` with an attention mask.
        per_token: Give each prediction's loss instead of their mean.

    Returns:
        ``[]``: the mean over every counted prediction of every prompt (TL's, one mean over the batch, not a mean
        of per-prompt means); with `per_token`, ``[batch, seq - 1]``, the loss of predicting token ``t + 1`` at
        ``t``, 0 where it does not count. Computed in float32 (at least).
    """
    log_probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    predicted = log_probs[:, :-1].gather(-1, tokens[:, 1:, None].to(log_probs.device))[..., 0]
    if mask is None:
        counted = torch.ones_like(predicted, dtype=torch.bool)
    else:
        mask = mask.to(predicted.device, torch.bool)
        counted = mask[:, :-1] & mask[:, 1:]
    losses = torch.where(counted, -predicted, torch.zeros_like(predicted))
    if per_token:
        return losses
    count = int(counted.sum())
    if count == 0:
        raise ValueError("no prompt has two real tokens, so there is no next token to predict and no loss: give "
                         "prompts of at least two tokens")
    return losses.sum() / count


def _outputs(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, return_type: Optional[str],
             loss_per_token: bool) -> Any:
    if return_type is None:
        return None
    if return_type == "logits":
        return logits
    loss = lm_cross_entropy_loss(logits, tokens, mask, loss_per_token)
    return loss if return_type == "loss" else (logits, loss)


def _padded_left(per_prompt: list[torch.Tensor], longest: int) -> torch.Tensor:
    """``[batch, longest, ...]`` from each prompt's ``[1, tokens, ...]``, zeros on the left."""
    first = per_prompt[0]
    out = first.new_zeros(len(per_prompt), longest, *first.shape[2:])
    for row, tensor in enumerate(per_prompt):
        out[row, longest - tensor.shape[1]:] = tensor[0]
    return out


def run_with_hooks(model: Any, input: Any, fwd_hooks: Sequence[tuple[HookName, HookFunction]] = (),
                   bwd_hooks: Sequence[Any] = (), reset_hooks_end: bool = True, clear_contexts: bool = False,
                   return_type: Optional[str] = "logits", loss_per_token: bool = False,
                   prepend_bos: Optional[bool] = None, batch_size: Optional[int] = None) -> Any:
    """Run `input` with hook functions on named values, as TransformerLens 4.3's ``run_with_hooks``.

    Args:
        model: A streamscope model on either engine.
        input: A string, a list of strings, or token ids (``[batch, seq]``, ``[seq]``, lists of ints). Text is
            tokenized by the tokenizer's own BOS rule; ``prepend_bos=True`` puts one BOS first (TL's default).
        fwd_hooks: ``[(name or filter, hook_fn), ...]``: see the module's docstring. A hook returning a tensor
            puts it in the value's place; an in-place edit reaches the model as well.
        bwd_hooks: Not taken: gradients by name are served in a trace (``with loss.backward(): value.grad``).
        reset_hooks_end, clear_contexts: TL's; the hooks live for this run only, so only True is taken for
            `reset_hooks_end`, and every run starts with empty contexts.
        return_type: ``"logits"`` (``[batch, seq, vocab_size]``, left-padded with zeros), ``"loss"``
            (`lm_cross_entropy_loss`), ``"both"`` (``(logits, loss)``) or None.
        loss_per_token: The loss per prediction, ``[batch, seq - 1]``, instead of its mean.
        batch_size: Prompts per run (transformers, default 8: one padded forward each; vLLM: every prompt in one
            engine run by default). Hooks are called once per run (per prompt on vLLM).
    """
    _check_return_type(return_type)
    if bwd_hooks:
        raise ValueError("bwd_hooks are not taken: on transformers read gradients by name in a trace, "
                         "`with loss.backward(): model.layers[3].layer_mid.grad` (streamscope.gradients), where an "
                         "assigned .grad flows on upstream; vLLM keeps no gradients")
    if not reset_hooks_end:
        raise ValueError("reset_hooks_end=False keeps TransformerLens's hooks on the model after the run; "
                         "streamscope's hooks live for one run only: pass the same fwd_hooks to each run")
    del clear_contexts  # every run's hooks start with empty contexts
    steps = plan(model, fwd_hooks)
    prompts = _token_ids(model, input, prepend_bos)
    tokens, mask = padded(model.tokenizer, prompts, "left")

    def body() -> list[torch.Tensor]:
        for site, hooks in steps:
            _run_hooks(model, site, hooks)
        return [model.prompt_logits] if return_type is not None else []

    size = model.engine.batch(batch_size, 8, len(prompts))
    logits: list[torch.Tensor] = []
    for start in range(0, len(prompts), size):
        with torch.no_grad():  # not inference mode: an in-place edit of a read is seen by its version counter
            found = model.engine.run(prompts[start: start + size], body, [(1,)] if return_type is not None else [])
        logits += [values[0] for values in found if values]
    if return_type is None:
        return None
    return _outputs(_padded_left(logits, tokens.shape[1]), tokens, mask, return_type, loss_per_token)


def run_with_cache(model: Any, input: Any, *, return_type: Optional[str] = "logits", loss_per_token: bool = False,
                   return_cache_object: bool = True, pos_slice: Any = None, remove_batch_dim: bool = False,
                   **cache_options: Any) -> tuple[Any, Any]:
    """``(output, cache)``, as TransformerLens 4.3's ``run_with_cache``: one run that keeps the cache's values.

    `output` is what `return_type` asks for (`run_with_hooks`'s: logits ``[batch, seq, vocab_size]``, padded on
    the left with zeros, the loss, both, or None), of the whole run whatever `pos_slice` keeps in the cache (as
    TL). `cache` is `model.cache`'s `streamscope.Cache` of the same run, with `pos_slice` and `remove_batch_dim`
    applied to it; ``return_cache_object=False`` gives its `cache_dict` instead. Other keyword arguments are
    `model.cache`'s (``values``, ``layers``, ``names_filter``, ``prepend_bos``, ``batch_size``, ...).
    """
    _check_return_type(return_type)
    if return_type is not None and cache_options.get("logits") is False:
        raise ValueError(f"logits=False keeps no logits, and return_type={return_type!r} needs them: pass "
                         f"return_type=None, or leave logits out")
    if cache_options.get("padding_side", "left") != "left":
        raise ValueError("run_with_cache pads several prompts on the left (its logits' position -1 is every "
                         "prompt's last token); model.cache(..., padding_side=\"right\") gives a right-padded cache")
    if pos_slice is not None:
        pos_slice = as_index(keep_axis(pos_slice))  # checked before the run
    if remove_batch_dim and len(_token_ids(model, input, cache_options.get("prepend_bos"))) != 1:
        raise ValueError("remove_batch_dim=True needs one prompt (as TransformerLens): run them without it, or "
                         "pick one with cache.apply_slice_to_batch_dim(i)")
    cache = build_cache(model, input, **cache_options)
    output = None
    if return_type is not None and cache.logits is not None:  # kept: logits=False was refused above
        output = _outputs(cache.logits, cache.tokens, cache.mask, return_type, loss_per_token)
    if pos_slice is not None:
        _slice_positions(cache, pos_slice)
    if remove_batch_dim:
        cache.remove_batch_dim()
    return output, (cache if return_cache_object else cache.cache_dict)
