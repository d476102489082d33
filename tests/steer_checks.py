"""Steering operations (add, set, ablate, clamp, norm_match; positions and steps) held to the oracle, both engines.

The reference is transformers' float32 forward (tests/oracle.py) edited with
plain torch hooks: each steer's operation written out here in plain torch,
applied at the oracle's own module for the value, at the positions the
steer names. A generation is checked by teacher forcing: the engine's own
tokens run through the oracle in one forward, every position edited as the
steer says (prompt positions; generated tokens from `from_step` on), and
the logits at each step compared.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable

import pytest
import torch

import oracle
from access import relative_error
from bulk_checks import PROMPTS, RELATIVE
import streamscope

STEPS = 4


def plain_operation(rows: torch.Tensor, steer) -> torch.Tensor:
    """The steer's operation on rows ``[n, hidden]``, in plain float32 torch."""
    vector = steer.vector.float()
    direction = vector / vector.norm()
    if steer.mode == "add":
        edited = rows + steer.scale * vector
    elif steer.mode == "set":
        edited = (steer.scale * vector).expand_as(rows)
    elif steer.mode == "ablate":
        edited = rows - steer.scale * torch.outer(rows @ direction, direction)
    elif steer.mode == "clamp":
        edited = rows + torch.outer(steer.projection - rows @ direction, direction)
    else:
        raise AssertionError(steer.mode)
    if steer.norm_match:
        edited = edited * (rows.norm(dim=-1, keepdim=True) / edited.norm(dim=-1, keepdim=True))
    return edited


def edited_positions(steer, length: int, total: int) -> list[int]:
    """The positions of a prompt of `length` tokens followed by generated ones (`total` in all) the steer edits."""
    rule = steer.positions
    if rule == "all":
        chosen = list(range(length))
    elif rule == "all_but_first":  # the default: the first prompt token (a sink in trained models) left alone
        chosen = list(range(1, length))
    elif rule == "none":
        chosen = []
    elif rule == "last":
        chosen = [length - 1]
    else:
        chosen = sorted({index % length for index in rule})
    if steer.generated:
        chosen += list(range(length + steer.from_step, total))
    return chosen


def oracle_logits(reference, family: str, prompt_ids: list[int], generated: list[int], steers) -> torch.Tensor:
    """The oracle's logits at each generated step, ``[steps, vocab]``, with the steers applied by plain hooks."""
    ids = torch.tensor([prompt_ids + generated[:-1]])
    length, total = len(prompt_ids), ids.shape[1]

    def hook_for(steer) -> Callable[[torch.Tensor], None]:
        positions = edited_positions(steer, length, total)

        def edit(tensor: torch.Tensor) -> None:
            stream = tensor.reshape(*ids.shape, tensor.shape[-1])[0]
            if positions:
                stream[positions] = plain_operation(stream[positions], steer)
        return edit

    with ExitStack() as stack, torch.no_grad():
        for steer in steers:
            name = steer.value.split(".")[-1]
            module, where, factor = oracle.site(reference, family, name, steer.layer % oracle.num_layers(reference, family))
            assert factor is None  # the bulk families' values are not scaled
            stack.enter_context(oracle.hooked(module, where, hook_for(steer)))
        logits = reference(ids).logits[0]
    return logits[length - 1:length - 1 + len(generated)]


def vector(model, seed: int) -> torch.Tensor:
    return torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(seed))


#: name -> the steers of one run, given the model: every operation, norm-matched or not, at several values and
#: blocks, prompt positions only or generated tokens only from a step on.
CASES: dict[str, Callable] = {
    "ablate": lambda m: [streamscope.Steer("layer_output", 0, vector(m, 0), mode="ablate")],
    "ablate_half_from_step_2": lambda m: [
        streamscope.Steer("layer_output", 0, vector(m, 1), mode="ablate", scale=0.5, positions="none", from_step=2)],
    "clamp": lambda m: [streamscope.Steer("mlp_output", 1, vector(m, 2) * 3, mode="clamp", projection=6.0)],
    "clamp_norm_match_generated_only": lambda m: [
        streamscope.Steer("layer_output", 1, vector(m, 3), mode="clamp", projection=-8.0, norm_match=True,
                          positions="none")],
    "add_norm_match": lambda m: [streamscope.Steer("attention_output", 1, vector(m, 4), scale=3.0, norm_match=True)],
    "set_norm_match_prompt_positions": lambda m: [
        streamscope.Steer("layer_output", 0, vector(m, 5), mode="set", norm_match=True, positions=[0, -1],
                          generated=False)],
    "several_blocks": lambda m: [
        streamscope.Steer("layer_input", 0, vector(m, 6), scale=2.0, positions="last"),
        *[streamscope.Steer("layer_output", block, vector(m, 7), mode="ablate") for block in range(m.num_layers)],
        streamscope.Steer("mlp_output", 1, vector(m, 8), mode="clamp", projection=2.0, from_step=1),
    ],
}


def check_case(model, reference, tokenizer, family: str, case: str, **options) -> None:
    """A bulk generation with the case's steers equals the oracle's edited forward at every step, on 2 prompts."""
    steers = CASES[case](model)
    prompts = PROMPTS[:2]
    run = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False, **options}
    result = model.generate(prompts, steer=steers, **run)
    plain = model.generate(prompts, harvest={"values": "layer_output", "layers": [0]}, **run)
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt).input_ids
        expected = oracle_logits(reference, family, ids, list(result.tokens[index]), steers)
        got = result.logits[index]
        assert got.shape == expected.shape == (STEPS, model.vocab_size)
        assert relative_error(got, expected) <= RELATIVE, (case, index, relative_error(got, expected))
        # Logits before the first edited row are the plain run's; from it on the steer changes them.
        untouched = min(steer.from_step + 1 if steer.positions == "none" else 0 for steer in steers)
        assert (got[untouched:] - plain.logits[index][untouched:]).abs().max() > 1e-3, case
        assert torch.equal(got[:untouched], plain.logits[index][:untouched]), case


def check_bad_steers(model, **options) -> None:
    """Bad steers are refused before the engine runs, naming the fix; the engine serves the next request."""
    good = vector(model, 9)
    # Built inside the check: a steer's own fields are refused when it is built, the rest when it runs.
    bad = {
        "NaN or inf": lambda: streamscope.Steer("layer_output", 0, torch.full((model.hidden_size,), float("nan"))),
        "all zeros.*no direction": lambda: streamscope.Steer("layer_output", 0, torch.zeros(model.hidden_size),
                                                             mode="ablate"),
        "mode 'scale'": lambda: streamscope.Steer("layer_output", 0, good, mode="scale"),
        "from_step=-1": lambda: streamscope.Steer("layer_output", 0, good, from_step=-1),
        "projection=nan": lambda: streamscope.Steer("layer_output", 0, good, mode="clamp", projection=float("nan")),
        "floating-point": lambda: streamscope.Steer("layer_output", 0, torch.ones(model.hidden_size,
                                                                                  dtype=torch.long)),
        r"vector of shape \(3,\)": lambda: streamscope.Steer("layer_output", 0, torch.ones(3), mode="clamp"),
    }
    for message, build in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            model.generate(PROMPTS[:1], max_tokens=2, steer=[build()], progress=False, **options)
    after = model.generate(PROMPTS[:1], max_tokens=1, steer=[streamscope.Steer("layer_output", 0, good,
                                                                               mode="ablate")],
                           progress=False, **options)
    assert len(after.tokens[0]) == 1


def check_harvest_under_steers(model, **options) -> None:
    """`model.harvest(..., steer=[...])` reads the values under the steers: the same rows a steered generation's
    harvest reads, and an ablated direction is gone from the value it was ablated at."""
    direction = vector(model, 10)
    steers = [streamscope.Steer("layer_output", 0, direction, mode="ablate", positions="all"),
              streamscope.Steer("mlp_output", 1, vector(model, 11), mode="clamp", projection=2.0, norm_match=True,
                                positions="all")]
    harvest = model.harvest(PROMPTS, "layer_output", layers=[0, 1], positions="all", steer=steers, progress=False,
                            **options)
    generated = model.generate(PROMPTS, max_tokens=1, steer=steers, progress=False,
                               harvest={"values": "layer_output", "layers": [0, 1], "positions": "all"}, **options)
    plain = model.harvest(PROMPTS, "layer_output", layers=[0, 1], positions="all", progress=False, **options)
    unit = direction / direction.norm()
    for index in range(len(PROMPTS)):
        steered = harvest["layer_output"][index]
        assert relative_error(steered, generated.harvest["layer_output"][index]) <= RELATIVE, index
        assert float((steered[0] @ unit).abs().max()) <= 1e-5 * float(steered[0].abs().max()), index
        assert (steered[1] - plain["layer_output"][index][1]).abs().max() > 1e-3, index
