"""The attention oracle: transformers' own attention tensors, caught at the kernel call, and its eager weights.

Nothing here imports streamscope's serving code (the pre-rotary values' map of where each family holds them is
streamscope.testing.oracle's data). The queries, keys and values are the
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


def _module_at(root: torch.nn.Module, alternatives) -> Optional[torch.nn.Module]:
    for path, _ in alternatives:
        module = root.get_submodule(path) if path in dict(root.named_modules()) else None
        if module is not None:
            return module
    return None


@contextmanager
def pre_rotary_caught(model, family: str, on: Callable[[int, str, torch.Tensor], None]) -> Iterator[None]:
    """While the model runs, call `on(block, name, tensor)` with each attention's queries and keys before the rotary
    embedding, ``[batch, heads, seq, head_dim]``, where an edit in place reaches the model (views of a module's
    output, or copies of the rotary's arguments handed to it in their stead), where transformers' modules hold
    them (`PRE_ROTARY` of streamscope.testing.oracle): the rotary
    function's arguments, caught by wrapping it in the modeling module, or the outputs of the modules a forward
    slices the rotated channels from (forward hooks). A block whose rotary does not run is not called for."""
    from streamscope.testing.oracle import PRE_ROTARY  # data only: where transformers' modules hold them

    spec = PRE_ROTARY.get(family)
    modules = attention_modules(model)
    current: dict[str, Optional[int]] = {"block": None}
    handles = [module.register_forward_pre_hook(lambda _, __, index=index: current.__setitem__("block", index))
               for index, module in modules.items()]
    restore: list[Callable[[], None]] = []
    try:
        if spec is not None and spec[0] == "call":
            _, function, layout = spec
            for modeling in {sys.modules[type(module).__module__] for module in modules.values()}:
                original = getattr(modeling, function)

                def wrapped(q, k, *rest, original=original, layout=layout, **kwargs):
                    # copies, handed on in their stead: an edit must reach the rotary even where the model's
                    # tensor cannot take it in place (Falcon broadcasts its keys per query head)
                    q, k = q.clone(), k.clone()
                    for name, tensor in (("queries_pre_rotary", q), ("keys_pre_rotary", k)):
                        on(current["block"], name, tensor.transpose(1, 2) if layout == "bshd" else tensor)
                    return original(q, k, *rest, **kwargs)

                setattr(modeling, function, wrapped)
                restore.append(lambda m=modeling, f=function, o=original: setattr(m, f, o))
        elif spec is not None:
            config = model.config
            heads = config.num_attention_heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            for index, module in modules.items():
                for name, alternatives, count in (("queries_pre_rotary", spec[1], heads),
                                                  ("keys_pre_rotary", spec[2], kv_heads)):
                    def keep(_, __, output, index=index, name=name, count=count):
                        if output.dim() == 3:  # a flat projection, [batch, seq, heads * head_dim]
                            output = output.unflatten(-1, (count, -1)).transpose(1, 2)
                        on(index, name, output)
                    handles.append(_module_at(module, alternatives).register_forward_hook(keep))
        yield
    finally:
        for undo in reversed(restore):
            undo()
        for handle in handles:
            handle.remove()


@torch.no_grad()
def pre_rotary_tensors(model, family: str, input_ids, kernel: dict[int, dict[str, torch.Tensor]]
                       ) -> dict[int, dict[str, torch.Tensor]]:
    """Per attention block: its queries and keys before the rotary embedding, [batch, heads, seq, head_dim]
    (TransformerLens's hook_q / hook_k), as `pre_rotary_caught` finds them; a block whose rotary does not run gets
    its kernel's queries and keys (`kernel`, as `kernel_tensors` caught them)."""
    caught: dict[int, dict[str, torch.Tensor]] = {}
    with pre_rotary_caught(model, family, lambda block, name, tensor: caught.setdefault(block, {}).__setitem__(
            name, tensor.clone())):
        model(input_ids)
    for block, tensors in kernel.items():
        if block not in caught:
            caught[block] = {"queries_pre_rotary": tensors["queries"], "keys_pre_rotary": tensors["keys"]}
    return caught


@torch.no_grad()
def logits_with_pre_rotary_edit(model, family: str, input_ids, block: int, name: str,
                                edit: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """The logits with `edit` applied in place to block `block`'s pre-rotary `name` (``queries_pre_rotary`` or
    ``keys_pre_rotary``, [batch, heads, seq, head_dim]) where `pre_rotary_caught` finds it; on a block whose
    rotary does not run, to the query or key its kernel receives."""
    done = []

    def on(index, caught, tensor):
        if index == block and caught == name:
            edit(tensor)
            done.append(index)

    with pre_rotary_caught(model, family, on):
        logits = model(input_ids).logits
    if done:
        return logits

    def edited(index, kernel, before, query, key, value, *rest, **kwargs):
        if index == block:
            if name == "queries_pre_rotary":
                query = query.clone()  # the kernel's query may be a view autograd forbids editing in place
                edit(query)
            else:
                key = key.clone()
                edit(key)
        return _call(kernel, before, query, key, value, *rest, **kwargs)

    with kernel_wrapped(model, family, edited):
        return model(input_ids).logits


def _per_head(tensor: torch.Tensor, heads: int, seq: int) -> torch.Tensor:
    """`tensor`, a q/k norm's input, as [batch, heads, seq, head_dim] (a view: an edit of it reaches the tensor),
    its layout told from its shape: [batch, seq, heads * head_dim], [batch, seq, heads, head_dim] or
    [batch, heads, seq, head_dim]."""
    if tensor.dim() == 3:
        return tensor.unflatten(-1, (heads, -1)).transpose(1, 2)
    assert heads != seq, "the oracle tells a norm input's layout by its shape: use a prompt longer than the heads"
    if tuple(tensor.shape[1:3]) == (heads, seq):
        return tensor
    assert tuple(tensor.shape[1:3]) == (seq, heads), (tuple(tensor.shape), heads, seq)
    return tensor.transpose(1, 2)


@contextmanager
def projected_caught(model, family: str, seq: int, on: Callable[[int, str, torch.Tensor], None]) -> Iterator[None]:
    """While the model runs, call `on(block, name, tensor)` with each attention's query and key projections before
    its q/k norm (``queries_projected`` / ``keys_projected``, [batch, heads, seq, head_dim], a view where an edit
    in place reaches the norm), caught with forward pre-hooks on the norm modules `PROJECTED` of
    streamscope.testing.oracle names. A block without such a norm is not called for."""
    from streamscope.testing.oracle import PROJECTED  # data only: where transformers' modules hold them

    config = model.config
    heads = getattr(config, "num_attention_heads", None)  # None on a model without attention (Mamba)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    handles = []
    try:
        for index, module in attention_modules(model).items():
            for name, alternatives, count in zip(("queries_projected", "keys_projected"),
                                                 PROJECTED.get(family, ((), ())), (heads, kv_heads)):
                norm = _module_at(module, alternatives)
                if norm is None:
                    continue

                def caught(_, args, index=index, name=name, count=count):
                    on(index, name, _per_head(args[0], count, seq))
                handles.append(norm.register_forward_pre_hook(caught))
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def projected_tensors(model, family: str, input_ids, pre_rotary: dict[int, dict[str, torch.Tensor]]
                      ) -> dict[int, dict[str, torch.Tensor]]:
    """Per attention block: its query and key projections before any q/k norm, [batch, heads, seq, head_dim]
    (TransformerLens's hook_q / hook_k), as `projected_caught` finds them; a block without such a norm gets its
    pre-rotary queries and keys (`pre_rotary`, as `pre_rotary_tensors` found them)."""
    caught: dict[int, dict[str, torch.Tensor]] = {}
    with projected_caught(model, family, input_ids.shape[-1], lambda block, name, tensor: caught.setdefault(
            block, {}).__setitem__(name, tensor.clone())):
        model(input_ids)
    for block, tensors in pre_rotary.items():
        if block not in caught:
            caught[block] = {"queries_projected": tensors["queries_pre_rotary"],
                             "keys_projected": tensors["keys_pre_rotary"]}
    return caught


@torch.no_grad()
def logits_with_projected_edit(model, family: str, input_ids, block: int, name: str,
                               edit: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """The logits with `edit` applied in place to block `block`'s projection `name` (``queries_projected`` or
    ``keys_projected``, [batch, heads, seq, head_dim]) where `projected_caught` finds it (the q/k norm's input);
    on a block without such a norm, to its pre-rotary value (`logits_with_pre_rotary_edit`)."""
    done = []

    def on(index, caught, tensor):
        if index == block and caught == name:
            edit(tensor)
            done.append(index)

    with projected_caught(model, family, input_ids.shape[-1], on):
        logits = model(input_ids).logits
    if done:
        return logits
    pre_rotary = {"queries_projected": "queries_pre_rotary", "keys_projected": "keys_pre_rotary"}[name]
    return logits_with_pre_rotary_edit(model, family, input_ids, block, pre_rotary, edit)
