"""The attention oracle: transformers' own attention tensors, caught at the kernel call, and its eager weights.

Nothing here imports streamscope. The queries, keys and values are the
arguments transformers hands its attention kernel (after its own rotary and
q/k norms), caught by wrapping the kernel function the attention module calls
while the model runs: the attention interface's entry for the implementation
(``ALL_ATTENTION_FUNCTIONS``; eager: the modeling module's
``eager_attention_forward``), GPT-J's ``_attn``, Falcon's
``F.scaled_dot_product_attention``. A forward pre-hook on each attention module
says which block a call belongs to. The pattern is transformers' eager
weights (``output_attentions=True`` on an eager model). Edits are made in the
same places: a pre-hook on the output projection, the wrapped kernel's query.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

#: The output projection's name on each attention, tried in order.
OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "out_proj", "dense")
#: Families whose kernel returns [batch, heads, seq, head_dim] rather than [batch, seq, heads, head_dim].
HEADS_FIRST = {"gptj", "falcon"}


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each block's softmax attention module, by block index (hybrids: the attention blocks only)."""
    found = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] in ("self_attn", "attn", "attention", "self_attention") \
                and parts[-2].isdigit() and any(hasattr(module, p) for p in OUTPUT_PROJECTIONS):
            found[int(parts[-2])] = module
    return found


def output_projection(module: torch.nn.Module) -> torch.nn.Module:
    return next(getattr(module, name) for name in OUTPUT_PROJECTIONS if hasattr(module, name))


@contextmanager
def kernel_wrapped(model: torch.nn.Module, family: str, wrapper: Callable) -> Iterator[None]:
    """Run `wrapper(block, kernel, query, key, value, *rest, **kwargs)` in place of each attention kernel call."""
    modules = attention_modules(model)
    current: dict[str, Optional[int]] = {"block": None}
    handles = [module.register_forward_pre_hook(lambda _, __, index=index: current.__setitem__("block", index))
               for index, module in modules.items()]
    implementation = model.config._attn_implementation
    restore: list[Callable[[], None]] = []

    def wrap(kernel, offset):  # offset: arguments before the query (the module, for the interface)
        def wrapped(*args, **kwargs):
            return wrapper(current["block"], kernel, args[:offset], *args[offset:], **kwargs)
        return wrapped

    try:
        if family == "gptj":
            for module in modules.values():
                module._attn = wrap(module._attn, 0)
                restore.append(lambda module=module: module.__dict__.pop("_attn"))
        elif family == "falcon":
            original = torch.nn.functional.scaled_dot_product_attention
            torch.nn.functional.scaled_dot_product_attention = wrap(original, 0)
            restore.append(lambda: setattr(torch.nn.functional, "scaled_dot_product_attention", original))
        elif implementation == "eager":
            for modeling in {sys.modules[type(module).__module__] for module in modules.values()}:
                original = modeling.eager_attention_forward
                modeling.eager_attention_forward = wrap(original, 1)
                restore.append(lambda m=modeling, o=original: setattr(m, "eager_attention_forward", o))
        else:
            mapping = type(ALL_ATTENTION_FUNCTIONS)._global_mapping
            original = mapping[implementation]
            mapping[implementation] = wrap(original, 1)
            restore.append(lambda: mapping.__setitem__(implementation, original))
        yield
    finally:
        for undo in reversed(restore):
            undo()
        for handle in handles:
            handle.remove()


def _call(kernel, before, query, key, value, *rest, **kwargs):
    return kernel(*before, query, key, value, *rest, **kwargs)


def _per_position(family: str, output: torch.Tensor) -> torch.Tensor:
    return output.transpose(1, 2) if family in HEADS_FIRST else output


@torch.no_grad()
def kernel_tensors(model, family: str, input_ids) -> dict[int, dict[str, torch.Tensor]]:
    """Per attention block: the queries, keys and values its kernel receives, and its output per head."""
    caught: dict[int, dict[str, torch.Tensor]] = {}

    def catch(block, kernel, before, query, key, value, *rest, **kwargs):
        output = _call(kernel, before, query, key, value, *rest, **kwargs)
        attn = output[0] if isinstance(output, tuple) else output
        caught[block] = {"queries": query.clone(), "keys": key.clone(), "values": value.clone(),
                         "head_outputs": _per_position(family, attn).clone()}
        return output

    with kernel_wrapped(model, family, catch):
        model(input_ids)
    return caught


@torch.no_grad()
def output_projection_inputs(model, input_ids) -> dict[int, torch.Tensor]:
    """Per attention block: what its output projection reads, [batch, seq, heads * head_dim] (torch hooks)."""
    caught = {}
    handles = [output_projection(module).register_forward_pre_hook(
        lambda _, args, index=index: caught.__setitem__(index, args[0].clone()))
        for index, module in attention_modules(model).items()]
    try:
        model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return caught


def eager_adds_alibi_twice(family: str, config: Any) -> bool:
    """Whether transformers' eager forward computes another function than its sdpa one: Falcon with ALiBi. Its
    model folds ALiBi into the mask, which the sdpa path adds once, and the eager path adds ALiBi to the scores
    as well (4e-2 apart on the logits of a tiny checkpoint); vLLM computes the sdpa path's function."""
    return family == "falcon" and bool(getattr(config, "alibi", False))


@torch.no_grad()
def kernel_weights(model, family: str, input_ids) -> dict[int, torch.Tensor]:
    """The attention weights per block as an sdpa kernel computes them from its arguments, [batch, heads, q_seq,
    k_seq]: softmax(q k^T * scale + mask), for a family whose eager weights are another function's."""
    caught: dict[int, torch.Tensor] = {}

    def catch(block, kernel, before, query, key, value, *rest, attn_mask=None, is_causal=False, scale=None,
              **kwargs):
        keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        logits = query.float() @ keys.float().transpose(-1, -2) * (scale or query.shape[-1] ** -0.5)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, float("-inf"))
        elif attn_mask is not None:
            logits = logits + attn_mask.float()
        elif is_causal:
            logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
        caught[block] = torch.softmax(logits, dim=-1)
        return kernel(*before, query, key, value, *rest, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                      **kwargs)

    with kernel_wrapped(model, family, catch):
        model(input_ids)
    return caught


@torch.no_grad()
def eager_weights(eager_model, input_ids) -> dict[int, torch.Tensor]:
    """transformers' eager attention weights per block, [batch, heads, q_seq, k_seq] (None for a recurrent block)."""
    attentions = list(eager_model(input_ids, output_attentions=True).attentions)
    blocks = sorted(attention_modules(eager_model))
    if len(attentions) == len(blocks) and blocks != list(range(len(blocks))):  # a hybrid lists its attention blocks
        return {block: weights for block, weights in zip(blocks, attentions)}
    return dict(enumerate(attentions))


@torch.no_grad()
def logits_with_head_zeroed(model, input_ids, block: int, head: int, head_dim: int) -> torch.Tensor:
    """The logits with one head's slice of the output projection's input zeroed (a torch pre-hook)."""
    def zero(_, args):
        args[0][..., head * head_dim:(head + 1) * head_dim] = 0

    handle = output_projection(attention_modules(model)[block]).register_forward_pre_hook(zero)
    try:
        return model(input_ids).logits
    finally:
        handle.remove()


@torch.no_grad()
def logits_with_query_edit(model, family: str, input_ids, block: int, edit: Callable[[torch.Tensor], None]):
    """The logits with `edit` applied in place to the queries block `block`'s kernel receives."""
    def edited(index, kernel, before, query, key, value, *rest, **kwargs):
        if index == block:
            query = query.clone()  # the kernel's query may be a view autograd forbids editing in place
            edit(query)
        return _call(kernel, before, query, key, value, *rest, **kwargs)

    with kernel_wrapped(model, family, edited):
        return model(input_ids).logits


#: Families whose sdpa path in transformers computes another function than their eager one: Gemma 2's sdpa
#: path drops its attention logit soft cap (2e-4 relative on the tiny checkpoint). An engine that computes the
#: family's own function (vLLM: 6e-7 from eager, 2e-4 from sdpa) is held to the eager forward.
SDPA_DIFFERS = {"gemma2"}


def exact_implementation(family: str) -> str:
    """The implementation whose forward is the family's own function, for an engine that computes it itself."""
    return "eager" if family in SDPA_DIFFERS else "sdpa"


def reference_model(path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model of the checkpoint at `path`, computing the family's own function: its default (sdpa)
    kernel, or the eager one where sdpa computes another (`SDPA_DIFFERS`). Both engines run that function."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = AutoConfig.from_pretrained(path).model_type
    return AutoModelForCausalLM.from_pretrained(
        path, **{**load_kwargs(family, exact_implementation(family)), "dtype": dtype}).eval()


def load_kwargs(family: str, implementation: str) -> dict[str, Any]:
    """from_pretrained's arguments for `implementation`; GPT-J has only its own eager attention, Mamba none."""
    if family in ("gptj", "mamba"):
        implementation = "eager"
    return {"dtype": torch.float32, "attn_implementation": implementation}


@torch.no_grad()
def logits_with_head_result_patched(model, clean_ids, corrupted_ids, block: int, head: int, head_dim: int,
                                    positions) -> torch.Tensor:
    """The corrupted run's logits with head `head`'s result at `positions` (its output times its columns of the
    output projection's weight, TransformerLens's attn.hook_result) replaced by the clean run's: the difference
    of the two results added to the projection's output."""
    clean = output_projection_inputs(model, clean_ids)[block]
    corrupted = output_projection_inputs(model, corrupted_ids)[block]
    projection = output_projection(attention_modules(model)[block])
    weight = projection.weight if isinstance(projection, torch.nn.Linear) else projection.weight.t()  # GPT-2 Conv1D
    columns = slice(head * head_dim, (head + 1) * head_dim)
    difference = (clean[..., columns] - corrupted[..., columns]) @ weight[:, columns].t()
    keep = torch.zeros(difference.shape[1], dtype=torch.bool)
    keep[positions] = True
    difference[:, ~keep] = 0

    def add(_, args, output):
        return output + difference.reshape(output.shape)

    handle = projection.register_forward_hook(add)
    try:
        return model(corrupted_ids).logits[0, -1]
    finally:
        handle.remove()


def projection_columns(projection: torch.nn.Module, heads: int) -> torch.Tensor:
    """A projection's weight as ``[hidden, heads, head_dim]``: a Linear's ``[out, in]``; GPT-2's Conv1D keeps
    ``[in, out]``."""
    weight = projection.weight.detach().float()
    if type(projection).__name__ == "Conv1D":
        weight = weight.t()
    return weight.unflatten(-1, (heads, -1))


def results_of(inputs: torch.Tensor, projection: torch.nn.Module, heads: int) -> torch.Tensor:
    """Each head's result, ``[batch, seq, heads, hidden]``: the projection's input split per head times that
    head's columns, without the bias (TransformerLens's attn.hook_result)."""
    return torch.einsum("bshd,mhd->bshm", inputs.float().unflatten(-1, (heads, -1)),
                        projection_columns(projection, heads))


@torch.no_grad()
def head_results(model, input_ids, kernel: dict[int, dict[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Per attention block whose kernel `kernel` caught: each head's result (`results_of`), from the output
    projection's input read with a torch hook; the head count is that of the kernel's head_outputs."""
    inputs = output_projection_inputs(model, input_ids)
    modules = attention_modules(model)
    return {block: results_of(inputs[block], output_projection(modules[block]),
                              kernel[block]["head_outputs"].shape[-2])
            for block in kernel if block in inputs}


@torch.no_grad()
def logits_with_head_scaled(model, input_ids, block: int, head: int, heads: int, scale: float) -> torch.Tensor:
    """The logits when `head`'s result at `block` is `scale` times what it was: a forward hook on the output
    projection adds ``(scale - 1)`` times that head's result (`results_of` of the hook's input) to its output."""
    projection = output_projection(attention_modules(model)[block])

    def add(_, args, output):
        change = (scale - 1) * results_of(args[0], projection, heads)[:, :, head]
        return output + change.to(output.dtype)

    handle = projection.register_forward_hook(add)
    try:
        return model(input_ids).logits
    finally:
        handle.remove()
