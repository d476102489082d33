"""TransformerLens 4.3's ActivationCache API as TL answers it: slices, iteration, cache_dict, model, toggle_autodiff
and run_with_cache(remove_batch_dim=, pos_slice=), called alike on TL's cache and on streamscope's.

Shared by tests/transformers/test_tl_cache_api.py and tests/vllm/test_tl_cache_api.py. The oracle is TransformerLens
4.3 itself (`transformer_lens_parity.Pair`: its bridge over the same tiny checkpoint, run on the same tokens);
every comparison goes through the parity's `check`/`close`: both refuse, or both answer with the same shape and the
same numbers to the parity's bound (`transformer_lens_parity.LIMIT`) at every real position.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

import transformer_lens_parity as parity
from streamscope.workflows.cache import DEFAULT_VALUES

#: Every form TransformerLens 4.3's ``Slice`` takes, by name; each is also passed wrapped in TL's own ``Slice``.
FORMS: dict[str, Any] = {
    "None": None, "int": 2, "negative int": -1, "(stop,)": (3,), "(start, stop)": (1, 4),
    "(start, stop, step)": (0, 5, 2), "slice": slice(1, 4), "list": [0, 2, 3], "long tensor": torch.tensor([1, 3]),
    "0-d tensor": torch.tensor(1), "numpy int": np.int64(2), "numpy array": np.array([0, 3]),
}


def _their_slice() -> Any:
    from transformer_lens.utilities import Slice

    return Slice


def forms(length: int, batch: bool = False) -> list[tuple[str, Any]]:
    """(name, slice) for every form, plain and wrapped in TL's ``Slice``, for an axis of `length` (a bool mask is
    as long as the axis, as TL takes one); `batch` picks indices that fit a batch of two."""
    Slice = _their_slice()
    chosen = dict(FORMS)
    if batch:
        chosen = {"None": None, "int": 1, "negative int": -1, "(start, stop)": (0, 1), "(stop,)": (1,),
                  "slice": slice(1, 2), "list": [1, 0], "long tensor": torch.tensor([1]),
                  "0-d tensor": torch.tensor(0), "numpy int": np.int64(1), "numpy array": np.array([1])}
    chosen["bool mask"] = torch.arange(length) % 3 != 1
    return [pair for name, form in chosen.items() for pair in ((name, form), (f"Slice({name})", Slice(form)))]


def sliced_mask(mask: torch.Tensor, form: Any, dim: int = 1) -> torch.Tensor:
    """`mask` sliced as TransformerLens slices a ``Slice(form)`` (TL's own code: the oracle)."""
    return _their_apply(mask, form, dim)


def every_slice_form_in_every_method(pair: Any) -> None:
    """pos_slice, batch_slice and neuron_slice in every form TL takes, a TL ``Slice`` among them, give TL's shapes
    and numbers (an int drops the axis, as TL's ``Slice(int)``; ``stack_neuron_results`` keeps a neuron int's)."""
    ours, theirs = pair.ours, pair.theirs
    seq = ours.tokens.shape[1]
    stack = theirs.accumulated_resid()
    hidden = ours["token_embeddings"].shape[-1]
    direction = torch.linspace(-1.0, 1.0, hidden)
    outcomes = {}
    for name, form in forms(seq):
        mask = sliced_mask(pair.mask, form)
        calls = [
            ("accumulated_resid", dict(apply_ln=True, return_labels=True)),
            ("decompose_resid", dict(apply_ln=True, return_labels=True)),
            ("stack_head_results", dict(layer=-1, apply_ln=True, return_labels=True)),
            ("get_full_resid_decomposition", dict(expand_neurons=False, return_labels=True,
                                                  project_output_onto=direction)),
            ("get_full_resid_decomposition", dict(apply_ln=True, return_labels=True)),
            ("stack_neuron_results", dict(layer=1, return_labels=True)),
            ("stack_neuron_results", dict(layer=1, apply_ln=True, project_output_onto=direction)),
        ]
        for method, arguments in calls:
            # On a post-normed family, TL's decomposition is one argument away (transformer_lens_parity.POST_NORMED).
            tl_numbers = parity.POST_NORMED.get(pair.name, {}) if method == "get_full_resid_decomposition" else {}
            what = f"{method}(pos_slice={name}, {arguments})"
            outcomes[what] = parity.check(what, lambda: getattr(ours, method)(pos_slice=form, **arguments, **tl_numbers),
                                          lambda: getattr(theirs, method)(pos_slice=form, **arguments), mask)
        what = f"get_neuron_results(pos_slice={name})"
        outcomes[what] = parity.check(what, lambda: ours.get_neuron_results(0, pos_slice=form),
                                      lambda: theirs.get_neuron_results(0, pos_slice=form), mask, batch_axis=0)
        # apply_ln_to_stack takes the stack already sliced in positions: the scale is what it slices.
        what = f"apply_ln_to_stack(pos_slice={name})"
        sliced_stack = _their_apply(stack, form, -2)
        outcomes[what] = parity.check(what, lambda: ours.apply_ln_to_stack(sliced_stack, pos_slice=form),
                                      lambda: theirs.apply_ln_to_stack(sliced_stack, pos_slice=form), mask)
        what = f"logit_attrs(pos_slice={name})"
        parts = _their_apply(theirs.decompose_resid(), form, -2)
        outcomes[what] = parity.check(
            what, lambda: ours.logit_attrs(parts, torch.tensor([7, 8]), pos_slice=form, convention="transformer_lens"),
            lambda: theirs.logit_attrs(parts, torch.tensor([7, 8]), pos_slice=form), mask)
    neurons = ours["blocks.1.mlp.hook_post"].shape[-1]
    for name, neuron_form in forms(neurons):
        for method in ("get_neuron_results", "stack_neuron_results"):
            what = f"{method}(neuron_slice={name})"
            axis = 0 if method == "get_neuron_results" else 1
            outcomes[what] = parity.check(what, lambda: getattr(ours, method)(1, neuron_slice=neuron_form),
                                          lambda: getattr(theirs, method)(1, neuron_slice=neuron_form), pair.mask,
                                          batch_axis=axis)
    batch = ours.tokens.shape[0]
    for name, form in forms(batch, batch=True):
        mask = sliced_mask(pair.mask, form, dim=0)
        batch_axis = None if mask.dim() == 1 else 0
        mine, reference = ours.apply_slice_to_batch_dim(form), theirs.apply_slice_to_batch_dim(form)
        assert mine.has_batch_dim == reference.has_batch_dim, name
        for key in ("blocks.1.hook_resid_post", "ln_final.hook_scale", "blocks.0.attn.hook_pattern"):
            parity.close(mine[key], reference[key], mask, f"apply_slice_to_batch_dim({name})[{key}]", batch_axis)
        what = f"logit_attrs(batch_slice={name})"
        parts = theirs.decompose_resid()
        outcomes[what] = parity.check(
            what, lambda: ours.logit_attrs(parts, 7, batch_slice=form, convention="transformer_lens"),
            lambda: theirs.logit_attrs(parts, 7, batch_slice=form), mask, batch_axis=None if mask.dim() == 1 else 1)
        what = f"apply_ln_to_stack(batch_slice={name})"
        outcomes[what] = parity.check(what, lambda: ours.apply_ln_to_stack(stack, batch_slice=form),
                                      lambda: theirs.apply_ln_to_stack(stack, batch_slice=form), mask,
                                      batch_axis=None if mask.dim() == 1 else 1)
    refused = [what for what, outcome in outcomes.items() if outcome != "ok"]
    assert not refused, f"refused by both, where TL answers every form: {refused}"
    # What TL refuses, streamscope refuses with the argument named (TL: ValueError "Invalid input_slice").
    for bad in ("1:3", 1.5, {1, 2}, torch.tensor([0.5, 1.0])):
        with pytest.raises(ValueError, match="pos_slice"):
            ours.accumulated_resid(pos_slice=bad)
    with pytest.raises(ValueError, match="batch_slice"):
        ours.apply_slice_to_batch_dim("0")


def _their_apply(tensor: torch.Tensor, form: Any, dim: int) -> torch.Tensor:
    Slice = _their_slice()
    return (form if isinstance(form, Slice) else Slice(form)).apply(tensor, dim=dim)


def iteration_keys_cache_dict_and_model(pair: Any) -> None:
    """Iterating the cache gives keys(), as TL's; cache_dict maps each key to its tensor (TL's values under TL's
    names); cache.model is the model the cache came from, answering the same calls as TL's cache.model."""
    ours, theirs = pair.ours, pair.theirs
    keys = list(ours.keys())
    assert list(ours) == keys and len(ours) == len(keys) == len(ours.cache_dict)
    assert list(theirs) == list(theirs.keys())  # what TL does, for the record
    assert list(ours.cache_dict) == keys and list(dict(ours.items())) == keys
    assert "layers.0.layer_input" in ours.cache_dict and "blocks.0.hook_resid_pre" in ours.cache_dict
    shared = [key for key in keys if key in theirs.cache_dict]
    assert len(shared) >= 10 * pair.layers, shared
    for key, value in zip(keys, ours.values()):
        assert value is ours.cache_dict[key] or torch.equal(value, ours.cache_dict[key]), key
    assert list(ours.keys()) == keys, "reading every value (a head's result computed on read) changed the keys"
    for key in shared:
        quirk = parity.QUIRKS.get((pair.name, key.split(".", 2)[-1]))
        expected = theirs.cache_dict[key]
        got = ours.cache_dict[quirk[0](key)] if quirk else ours.cache_dict[key]
        parity.close(got, expected, pair.mask, f"cache_dict[{key!r}]", batch_axis=0)
    assert isinstance(ours.cache_dict, dict) and ours.cache_dict is ours.cache_dict  # a plain dict, kept, as TL's
    cache_dict_is_writable_as_tl(pair)
    with pytest.raises(KeyError, match="full names"):
        ours.cache_dict[("resid_pre", 0)]
    # cache.model: the model the cache was run on, as TL's; the same call on each answers alike.
    assert ours.model is pair.model
    assert ours.model.to_str_tokens(ours.tokens[1]) == theirs.model.to_str_tokens(ours.tokens[1])
    assert ours.model.num_layers == theirs.model.cfg.n_layers


def cache_dict_is_writable_as_tl(pair: Any) -> None:
    """Assigning cache_dict[key] changes what cache[key] gives, under both names and in the methods, as assigning
    TL's cache_dict does (TL's attribution-patching demo writes it); on copies, the shared caches untouched."""
    ours, theirs = pair.ours.apply_slice_to_batch_dim(None), pair.theirs.apply_slice_to_batch_dim(None)
    doubled = ours["blocks.0.hook_resid_pre"] * 2
    for cache in (ours, theirs):
        cache.cache_dict["blocks.0.hook_resid_pre"] = doubled
    assert ours["layers.0.layer_input"] is doubled and ours["blocks.0.hook_resid_pre"] is doubled
    assert pair.ours["layers.0.layer_input"] is not doubled
    parity.check("accumulated_resid after a write", lambda: ours.accumulated_resid(layer=1),
                 lambda: theirs.accumulated_resid(layer=1), pair.mask)
    # A heads-last name is written back in streamscope's layout; a computed one and a new one are kept as given.
    v = theirs["blocks.0.attn.hook_v"] + 1
    scale = theirs["blocks.0.ln1.hook_scale"] * 3
    for cache in (ours, theirs):
        cache.cache_dict["blocks.0.attn.hook_v"] = v
        cache.cache_dict["blocks.0.ln1.hook_scale"] = scale
        cache.cache_dict["my_direction"] = v[..., 0]
    for key in ("blocks.0.attn.hook_v", "blocks.0.ln1.hook_scale", "my_direction"):
        parity.close(ours[key], theirs[key], pair.mask, f"{key} after a write", batch_axis=0)
        assert key in ours.keys() and key in ours.cache_dict
    del ours.cache_dict["my_direction"]
    assert "my_direction" not in ours.keys()


def toggle_autodiff_as_tl(pair: Any) -> None:
    """toggle_autodiff sets torch's global autograd switch as TL's does, and says so."""
    before = torch.is_grad_enabled()
    try:
        for mode in (False, True, False):
            pair.theirs.toggle_autodiff(mode)
            expected = torch.is_grad_enabled()
            torch.set_grad_enabled(not expected)
            pair.ours.toggle_autodiff(mode)
            assert torch.is_grad_enabled() == expected == mode
        torch.set_grad_enabled(True)
        pair.ours.toggle_autodiff()
        assert not torch.is_grad_enabled()
        assert not (torch.ones(2, requires_grad=True) * 2).requires_grad
    finally:
        torch.set_grad_enabled(before)


#: run_with_cache's pos_slice forms: a plain int keeps the position axis ([i]) there, a TL Slice(int) drops it.
RUN_SLICES = ["None", "int", "negative int", "(start, stop)", "list", "0-d tensor", "Slice(int)",
              "Slice((start, stop))", "Slice(negative int)"]


def _run_slice(name: str) -> Any:
    if name.startswith("Slice("):
        return _their_slice()(FORMS[name[len("Slice("):-1]])
    return FORMS[name]


def run_with_cache_remove_batch_dim_and_pos_slice(pair: Any) -> None:
    """model.cache(..., remove_batch_dim=, pos_slice=) holds what TL's run_with_cache(..., remove_batch_dim=,
    pos_slice=) holds, name for name and shape for shape, and its methods answer alike on it."""
    values = [*DEFAULT_VALUES, "token_embeddings", "final_norm_output", "self_attn.queries", "self_attn.keys",
              "self_attn.values", "self_attn.scores", "self_attn.pattern", "self_attn.head_outputs"]
    length = int(pair.mask[0].sum())
    ids = pair.ours.tokens[:1, :length]
    for name, remove in itertools.product(RUN_SLICES, [False, True]):
        pos_slice = _run_slice(name)
        what = f"model.cache(pos_slice={name}, remove_batch_dim={remove})"
        mine = pair.model.cache(ids, values=values, pos_slice=pos_slice, remove_batch_dim=remove, progress=False)
        with torch.no_grad():
            _, reference = pair.tl.run_with_cache(ids, pos_slice=pos_slice, remove_batch_dim=remove)
        assert mine.has_batch_dim == reference.has_batch_dim == (not remove), what
        shared = [key for key in mine.keys() if key in reference.cache_dict]
        assert len(shared) >= 10 * pair.layers, (what, shared)
        everywhere = torch.ones(length, dtype=torch.bool)
        for key in shared:
            quirk = parity.QUIRKS.get((pair.name, key.split(".", 2)[-1]))
            got = mine[quirk[0](key)] if quirk else mine[key]
            parity.close(got, reference[key], everywhere, f"{what}[{key!r}]", batch_axis=None)
        if remove and getattr(pos_slice, "mode", None) == "int":
            # One position of one prompt: every value is [d_model]. TL 4.3's methods raise IndexError here (their
            # identity pos_slice indexes axis -2 of a 1-d tensor); streamscope's stack TL's own values.
            layers = range(pair.layers)
            final = reference[f"blocks.{pair.layers - 1}.hook_resid_post"]
            expected = torch.stack([*(reference[f"blocks.{i}.hook_resid_pre"] for i in layers), final])
            parity.close(mine.accumulated_resid(), expected, everywhere, f"{what}.accumulated_resid", None)
            parts = [reference["hook_embed"], *(reference["hook_pos_embed"] for _ in range(pair.name == "gpt2"))]
            parts += [reference[f"blocks.{i}.hook_{kind}_out"] for i in layers for kind in ("attn", "mlp")]
            parity.close(mine.decompose_resid(), torch.stack(parts), everywhere, f"{what}.decompose_resid", None)
            parity.close(mine.decompose_resid().sum(0), final, everywhere, f"{what}: the parts' sum", None)
            continue
        # The methods on the run's cache (positions already sliced there: no pos_slice here).
        for method, arguments in (("accumulated_resid", dict(apply_ln=True, return_labels=True)),
                                  ("decompose_resid", dict(return_labels=True)),
                                  ("stack_head_results", dict(return_labels=True))):
            parity.check(f"{what}.{method}", lambda: getattr(mine, method)(**arguments),
                         lambda: getattr(reference, method)(**arguments), everywhere, batch_axis=None)
    # Several prompts with remove_batch_dim: refused before the run (TL asserts), and the engine serves the next.
    with pytest.raises(ValueError, match="remove_batch_dim=True needs one prompt"):
        pair.model.cache(parity.PROMPTS, remove_batch_dim=True)
    with pytest.raises(ValueError, match="pos_slice"):
        pair.model.cache(ids, pos_slice="last")
    after = pair.model.cache(ids, values=["layer_output"], pos_slice=-1, remove_batch_dim=True, progress=False)
    with torch.no_grad():
        _, reference = pair.tl.run_with_cache(ids, pos_slice=-1, remove_batch_dim=True)
    key = f"blocks.{pair.layers - 1}.hook_resid_post"
    parity.close(after[key], reference[key], torch.ones(1, dtype=torch.bool), "the run after the refusals", None)
