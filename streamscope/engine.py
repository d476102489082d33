"""What differs between the engines that the workflows need, as one object a model holds: `model.engine`.

A workflow (a cache, the logit lens, patching) is written once against this
object and the public names; it never asks which engine runs the model. Each
engine supplies a subclass (`streamscope.transformers.engine`,
`streamscope.vllm.engine`) that the model builds on first use. To add an
engine, subclass `Engine` and provide every method below that raises
NotImplementedError.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, Union

import torch

from . import nnsight_seam as seam
from .errors import Unavailable
from .values import resolve

#: What a transformers model is built inside, each called for a context manager: added by another engine whose
#: presence in this process changes that build. vLLM's Transformers backend decorates transformers' model classes in
#: place, so `streamscope.vllm.model` adds its `beside_engine` when it loads; the engines never import each other.
TRANSFORMERS_BUILD_CONTEXTS: list[Callable[[], contextlib.AbstractContextManager]] = []

#: A prompt as a run takes it: text (tokenized by the model's tokenizer) or token ids, run as they are.
Prompt = Union[str, list[int]]
#: What a run's body returns for one prompt: the tensors to bring back, in order.
Body = Callable[[], Sequence["torch.Tensor"]]


class Engine:
    """One engine's way of running prompts and reaching its weights, for a model of it (`model.engine`).

    Methods that run prompts take a `body`, called inside the trace (on vLLM
    in its worker) where the model's values can be read, and bring back what
    it returns for every prompt as a list, one entry per prompt: never a
    single value for one prompt and a list for several.
    """

    #: The engine's name, as `streamscope.load(engine=...)` takes it.
    name: ClassVar[str] = "engine"
    #: The settings a trace takes to run its prompts through one forward pass (no further tokens sampled).
    one_forward: ClassVar[Mapping[str, Any]] = {}
    #: Whether the engine computes with transformers' own kernels, the reference's: then in float32 its values are
    #: the reference's on any device, up to the order of operations (`streamscope.testing.precision`).
    reference_kernels: ClassVar[bool] = False
    #: Why the engine serves no gradients, a sentence naming the fix; None where a trace computes them
    #: (`streamscope.gradients`). Workflows that need gradients (attribution patching) refuse by it before running.
    no_gradients: ClassVar[Optional[str]] = None
    #: Whether the engine runs a trace's body (`run`, `run_each`, `unembed`). A server's engine
    #: (`streamscope.serve.remote.RemoteEngine`) does not: workflows that can work from harvests ask it for
    #: those and the engine's head instead.
    runs_traces: ClassVar[bool] = True

    def __init__(self, model: Any) -> None:
        self.model = model

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    def precision(self) -> tuple[str, "torch.dtype"]:
        """Where and in what the model computes: its device's type (``"cpu"``, ``"cuda"``) and its dtype."""
        raise NotImplementedError

    def run(self, prompts: Sequence[Prompt], body: Body, seq_axes: Sequence[tuple[int, ...]]) -> list[list[torch.Tensor]]:
        """Each prompt's tensors from `body`, run once per prompt: ``[prompt][tensor]``, each ``[1, ...]``.

        A prompt is a string or its token ids (a list of ints, run as they are).

        `seq_axes` gives, per tensor `body` returns, the axes that run over the
        prompt's positions: every tensor comes back cut to the prompt's own
        tokens, whether the engine ran the prompts as one padded batch or as
        one request each.
        """
        raise NotImplementedError

    def trace_input(self, prompts: Sequence[Prompt]) -> Any:
        """The one input a trace hands the engine for `prompts` (`trace_prompts`: text, or token ids without
        padding), so that each prompt's values at its real positions are the ones it gives alone.

        Engines that run several prompts in one invoke pad them on the left (position -1 is every prompt's last
        token) with an attention mask and mask-derived position ids; one that runs a request per prompt (vLLM)
        hands the trace one invoke per prompt, each running the trace's body.
        """
        raise NotImplementedError

    def run_each(self, prompt: str, bodies: Sequence[Body]) -> list[list[torch.Tensor]]:
        """`prompt` run once per body, each in its own invoke (an edit each, say): ``[body][tensor]``."""
        raise NotImplementedError

    def set_each(self, prompt: str, edits: Sequence[tuple[str, int, int, torch.Tensor]]) -> list[torch.Tensor]:
        """`prompt` run once per edit without a trace: each run sets one block value at one position, and answers
        its last position's logits ``[vocab_size]``.

        An edit is ``(value, block, position, vector)``: the run's value `value` of block `block` (a name as
        `model.harvest` takes it) becomes `vector` (``[width]``, the value's last axis) at `position`, as a
        trace's ``model.layers[block].<value>[:, position] = vector`` does. Engines without such a route say
        so with `settable`; the workflows then run the edits as invokes (`run_each`).
        """
        raise NotImplementedError

    def settable(self, value: str, block: int) -> Optional[str]:
        """None where `set_each` can set `value` of block `block`, else why not (a sentence)."""
        return f"the {self.name} engine runs edits as invokes of a trace"

    def batch(self, asked: Optional[int], default: int, count: int) -> int:
        """How many of a workflow's `count` prompts (or patches) one `run` (`run_each`) takes: `asked` where the
        caller gave it, else the engine's choice. Here `default`, the workflow's batch of one padded forward."""
        if asked is None:
            return default
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            raise ValueError(f"batch_size={asked!r}: give a positive whole number (or leave it out for the "
                             f"engine's choice)")
        return asked

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        """Inside a trace: the logits ``[tokens, vocab_size]`` of final-norm outputs ``[tokens, hidden_size]``.

        The model's own unembedding, then whatever scaling or soft cap its
        head applies after it, as the model computes its logits.
        """
        raise NotImplementedError

    def norm_parameters(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        """The final norm's ``(weight, bias, eps)``, copies on this process (None where the norm has none)."""
        raise NotImplementedError

    def unembedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids), hidden_size]``: the unembedding's rows for token `ids` (the head's, or the tied embedding's)."""
        raise NotImplementedError

    def head_parameters(self) -> tuple[Optional[torch.Tensor], float, Optional[float]]:
        """What the head does after the unembedding's matrix ``W_U``: ``(bias, scale, soft_cap)``.

        The model's logits of a final-norm output ``x`` are ``scale * cap(W_U x + bias)``, where ``cap(z)`` is
        ``soft_cap * tanh(z / soft_cap)`` (identity where `soft_cap` is None). `bias` is ``[vocab_size]`` or None,
        a copy on this process (GPT-J's head has one); `scale` is Cohere's ``logit_scale`` or Granite's
        ``1 / logits_scaling`` (1.0 elsewhere); `soft_cap` Gemma 2's ``final_logit_softcapping``.
        """
        raise NotImplementedError

    def output_projections(self) -> list[torch.Tensor | str]:
        """Per block: its attention's output projection as a Linear's weight ``[hidden_size, heads * head_dim]``
        (`output_projection`), copies on this process, or the reason the block has none (a sentence)."""
        raise NotImplementedError

    def down_projections(self) -> list[torch.Tensor | str]:
        """Per block: its MLP's down projection as a Linear's weight ``[hidden_size, intermediate_size]``, scaled
        as the block scales the MLP's output (`streamscope.engine.down_projections`; TransformerLens's ``W_out``,
        transposed), copies on this process, or the reason the block has no neurons (a sentence)."""
        raise NotImplementedError

    def close(self) -> None:
        """Give the engine's resources back; the model serves no more traces where the engine holds any."""


#: The sides a batch of prompts can be padded on; streamscope pads on the left unless told otherwise.
PADDING_SIDES = ("left", "right")


def check_padding_side(side: Any) -> str:
    """`side` if it is ``"left"`` or ``"right"``, else a ValueError naming both."""
    if side not in PADDING_SIDES:
        raise ValueError(f"padding_side={side!r}: give \"left\" (the default: position -1 is every prompt's last "
                         f"token) or \"right\"")
    return side


def padded(tokenizer: Any, prompts: Sequence[Prompt], side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, mask)``, both ``[len(prompts), longest]``: the prompts' token ids padded on `side` with the
    tokenizer's pad id (its EOS, else 0, where it has none), and True at each prompt's real positions.

    A prompt is text (tokenized here, with the tokenizer's own special tokens) or its token ids (kept as they
    are). On the left (the default) position -1 is every prompt's last token.
    """
    check_padding_side(side)
    encoded = [tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt) for prompt in prompts]
    longest = max(map(len, encoded))
    pad = pad_id(tokenizer)
    tokens = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for row, ids in enumerate(encoded):
        where = slice(0, len(ids)) if side == "right" else slice(longest - len(ids), longest)
        tokens[row, where] = torch.tensor(ids, dtype=torch.long)
        mask[row, where] = True
    return tokens, mask


def pad_id(tokenizer: Any) -> int:
    """The id a batch is padded with: the tokenizer's pad token, else its EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def right_padded(tokenizer: Any, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """`padded` on the right: how the transformers engine runs a workflow's prompts before cutting each out
    (`cut`). Right padding leaves every real position's value exactly as the prompt alone gives it."""
    return padded(tokenizer, prompts, "right")


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` position ids of a padded batch's attention mask ``[batch, seq]``: each real token counted
    from its prompt's first real token (the cumulative sum of the mask, less one), 0 at padded positions. A
    left-padded prompt then sits at the positions it has alone, which learned and rotary positions both read."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def last_positions(mask: torch.Tensor) -> torch.Tensor:
    """``[batch]``: the index of each row's last real position in a padded batch's mask ``[batch, seq]``."""
    seq = mask.shape[-1]
    reversed_first = mask.flip(-1).long().argmax(-1)
    return (seq - 1 - reversed_first).to(torch.long)


def prepends_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer` puts its BOS token first by itself (TransformerLens's ``tokenizer_prepends_bos``)."""
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def encode(tokenizer: Any, text: str, prepend_bos: Optional[bool] = None) -> list[int]:
    """The token ids of `text`: by default (`prepend_bos` None) what ``tokenizer(text)`` gives, the tokenizer's own
    rule for BOS, as vLLM and the server tokenize; True puts one BOS first whether or not the tokenizer adds it
    (TransformerLens's ``prepend_bos=True``); False leaves it out even where the tokenizer adds it."""
    if prepend_bos is not None and not isinstance(prepend_bos, bool):
        raise ValueError(f"prepend_bos={prepend_bos!r}: give None (the tokenizer's own rule), True or False")
    adds = prepends_bos(tokenizer)
    if prepend_bos and not adds and tokenizer.bos_token is not None:
        text = tokenizer.bos_token + text
    ids = list(tokenizer(text)["input_ids"])
    if prepend_bos is False and adds and ids and ids[0] == tokenizer.bos_token_id:
        ids = ids[1:]
    return ids


#: How to run several prompts in one trace when an input cannot say which of its positions are padding.
_PADDED_TENSOR = ("rows of this [batch, seq] token tensor {where} with different numbers of the pad token (id {pad}): "
                  "it looks padded, and without its attention mask the pads would run as tokens. Pass the mask "
                  "(model.trace(tokens, attention_mask=mask), or the tokenizer's output {{'input_ids', "
                  "'attention_mask'}}), or the prompts as text or as a list of token-id lists, which streamscope "
                  "pads itself")


def trace_prompts(tokenizer: Any, data: Any, attention_mask: Any = None,
                  prepend_bos: Optional[bool] = None) -> Optional[list[Prompt]]:
    """The prompts a trace's input stands for, one per prompt (text, or token ids without padding), or None for
    an input handed to the engine as it is (an engine's own prompt form, embeddings, another encoding).

    Taken: a string; a list of strings; token ids as a list of ints (one prompt), a list of id lists, or an
    integer tensor ``[seq]``, ``[1, seq]`` or ``[batch, seq]``; a tokenizer's output ``{input_ids,
    attention_mask}``. A mask (there, or `attention_mask`) keeps each row's ids where it is nonzero. A
    ``[batch, seq]`` tensor without one is taken row by row, whole, unless its rows start or end with different
    numbers of pad tokens: that is a padded batch without its mask, refused with the fix. `prepend_bos`
    (`encode`) applies to text; with token ids, which run as given, it is refused.
    """
    mask = attention_mask
    if isinstance(data, Mapping):
        if "input_ids" not in data or set(data) - {"input_ids", "attention_mask"}:
            return None
        if mask is not None and data.get("attention_mask") is not None:
            raise ValueError("an attention mask is given twice (in the input and as attention_mask=): give one")
        data, mask = data["input_ids"], data.get("attention_mask", mask)
    if isinstance(data, str) or (isinstance(data, (list, tuple)) and data and all(isinstance(item, str)
                                                                                      for item in data)):
        if mask is not None:
            raise ValueError("attention_mask= goes with token ids; text is tokenized and padded by streamscope")
        texts = [data] if isinstance(data, str) else list(data)
        return [text if prepend_bos is None else encode(tokenizer, text, prepend_bos) for text in texts]
    rows = _id_rows(data)
    if rows is None:
        return None
    if prepend_bos is not None:
        raise ValueError(f"prepend_bos={prepend_bos!r} applies to text; token ids run as given (add or drop the BOS "
                         f"id in them, or pass the text)")
    if mask is not None:
        flags = torch.as_tensor(mask).reshape(len(rows), -1).tolist() if len(rows) else []
        if any(len(flag) != len(row) for flag, row in zip(flags, rows)):
            raise ValueError(f"attention_mask has shape {tuple(torch.as_tensor(mask).shape)}, not the token ids' "
                             f"[{len(rows)}, {len(rows[0])}]")
        rows = [[token for token, keep in zip(row, flag) if keep] for row, flag in zip(rows, flags)]
    elif isinstance(data, torch.Tensor) and len(rows) > 1:
        pad = pad_id(tokenizer)
        for where, ordered in (("start", lambda row: row), ("end", lambda row: row[::-1])):
            counts = {next((index for index, token in enumerate(ordered(row)) if token != pad), len(row))
                      for row in rows}
            if len(counts) > 1:
                raise ValueError(_PADDED_TENSOR.format(where=where, pad=pad))
    if any(not row for row in rows):
        raise ValueError("a prompt with no tokens cannot run: every prompt needs at least one token")
    return list(rows)


def _id_rows(data: Any) -> Optional[list[list[int]]]:
    """Token ids as rows of ints, or None where `data` is not token ids."""
    if isinstance(data, torch.Tensor):
        if data.is_floating_point() or data.is_complex():
            return None
        if data.dim() not in (1, 2):
            raise ValueError(f"token ids come as [seq] or [batch, seq], not a tensor of shape {tuple(data.shape)}")
        return data.reshape(-1, data.shape[-1]).tolist()
    if isinstance(data, (list, tuple)) and data:
        if all(isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in data):
            return [[int(item) for item in data]]
        if all(isinstance(item, (list, tuple, torch.Tensor)) for item in data):
            rows = []
            for item in data:
                found = _id_rows(item)
                if found is None or len(found) != 1:
                    return None
                rows.extend(found)
            return rows
    return None


def cut(value: torch.Tensor, row: int, length: int, axes: tuple[int, ...], side: str = "right") -> torch.Tensor:
    """Row `row` of a batch padded on `side` as ``[1, ...]``, its `axes` cut to the prompt's `length` positions
    (the first `length` where padded on the right, the last where padded on the left)."""
    index: list[Any] = [slice(row, row + 1)] + [slice(None)] * (value.dim() - 1)
    for axis in axes:
        index[axis] = slice(0, length) if side == "right" else slice(value.shape[axis] - length, value.shape[axis])
    return value[tuple(index)]


def norm_parameters(module: torch.nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
    """A norm module's ``(weight, bias, eps)``, detached copies (None where it has none; eps 1e-5 where unstated)."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    eps = next((getattr(module, name) for name in ("eps", "variance_epsilon", "epsilon")
                if isinstance(getattr(module, name, None), float)), 1e-5)
    return (None if weight is None else weight.detach().clone(),
            None if bias is None else bias.detach().clone(), float(eps))


#: What the attention's output projection is called, across the families (a Linear, or GPT-2's Conv1D).
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj")


def output_projection(attention: torch.nn.Module, width: int) -> torch.Tensor | str:
    """`attention`'s output projection as a Linear's weight ``[hidden, width]``, or the reason it has none.

    Under tensor parallelism (vLLM's row-parallel projection) this rank's
    columns only, ``[hidden, width / ranks]``: `join_shards` puts the ranks'
    together.
    """
    for name in OUTPUT_PROJECTIONS:
        module = getattr(attention, name, None)
        if isinstance(module, torch.nn.Module):
            return linear_weight(module, width)
    return (f"its attention ({type(attention).__name__}) has none of the output projections streamscope knows "
            f"({', '.join(OUTPUT_PROJECTIONS)})")


def linear_weight(module: torch.nn.Module, width: int, in_trace: bool = False) -> torch.Tensor:
    """What the linear `module` computes, as a Linear's weight ``[out, width]`` without its bias, a float32 copy.

    Read by applying it to the identity, less its output at zero (the bias):
    the engines keep the weight in layouts of their own (GPT-2's Conv1D is
    ``[in, out]``; vLLM's CPU kernels pack it and leave ``weight`` empty), and
    this reads what the projection computes whatever the layout. A vLLM
    row-parallel linear (``input_size_per_partition``) is applied through its
    own kernel without the all-reduce of its forward, on this rank's share of
    the input: the result is this rank's columns, ``[out, width / ranks]``.
    `in_trace`: read inside a running trace (head_results), where the call goes
    to the module's class's forward, past the trace's hooks on the module.
    """
    reference = next(iter(module.parameters()), None)
    dtype = reference.dtype if reference is not None else torch.float32
    device = reference.device if reference is not None else "cpu"
    shard = getattr(module, "input_size_per_partition", None)
    method = getattr(module, "quant_method", None)
    if shard is not None and method is not None:
        probe = torch.eye(int(shard), dtype=dtype, device=device)
        with torch.no_grad():
            return method.apply(module, probe, None).t().float().cpu().clone()
    probe = torch.cat([torch.zeros(1, width), torch.eye(width)]).to(dtype=dtype, device=device)
    with torch.no_grad():
        # Inside a trace a hooked call would be one more call of a module the trace intervenes on.
        out = type(module).forward(module, probe) if in_trace else module(probe)
    out = out[0] if isinstance(out, tuple) else out
    return (out[1:] - out[:1]).t().float().cpu().clone()


def join_shards(answers: Sequence[list]) -> list:
    """One list of per-block weights from every tensor-parallel rank's (in rank order): each block's columns
    side by side, ``[out, width]``, as the ranks split a row-parallel linear's input; a reason as it is."""
    return [parts[0] if isinstance(parts[0], str) else torch.cat(list(parts), dim=1) for parts in zip(*answers)]


def down_projections(root: Any, num_layers: int) -> list[torch.Tensor | str]:
    """Per block of the envoy tree `root`: its MLP's down projection as a Linear's weight ``[hidden_size,
    intermediate_size]`` (this rank's columns under tensor parallelism), times the factor the block scales the
    MLP's output by (Granite's residual multiplier), so ``neurons @ weight.T`` is what the neurons add to
    mlp_output; or the reason the block has no neurons (a sentence)."""
    found: list[torch.Tensor | str] = []
    for index in range(num_layers):
        try:
            mlp = root.layers[index].mlp
        except (AttributeError, Unavailable) as error:
            found.append(f"there is no MLP to read its down projection from ({error})")
            continue
        reason = mlp.reason("neurons")
        if reason is not None:
            found.append(reason)
            continue
        place = mlp.neuron_sites()["neurons"][0]
        module = seam.module_of(mlp if place is None else resolve(mlp, place))
        width = next(int(getattr(module, name)) for name in ("in_features", "nx", "input_size")
                     if hasattr(module, name))
        weight = linear_weight(module, width)
        factor = type(mlp).mlp_output.factor
        found.append(weight * factor(mlp) if factor is not None else weight)
    return found


def attention_modules(root: Any, num_layers: int) -> list[Any]:
    """Per block of the envoy tree `root`: its attention module, or the reason it has none (a sentence)."""
    found: list[Any] = []
    for index in range(num_layers):
        try:
            found.append(seam.module_of(root.layers[index].self_attn))
        except (AttributeError, Unavailable) as error:
            found.append(f"there is no attention module to read its output projection from ({error})")
    return found
