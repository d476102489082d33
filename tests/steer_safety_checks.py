"""Steering safety on both engines (issue 38 items 1, 2, 6, 11): checks shared by the engines' test files.

* The first prompt token is skipped by default: a default clamp and an
  ablation at every block equal the oracle edited at positions 1.. (and every
  generated token) by plain torch hooks, and differ from it edited at every
  position; a harvest under a default clamp keeps row 0 bit for bit.
* Every mode refuses the arguments it does not use, naming the argument, the
  mode and the fix, as the steer is built (and from JSON).
* Absurd scales are refused before the run with the stream's norm in the
  message; that norm equals the oracle's mean row norm of the calibration text.
* Bad positions are refused as a `SteerError` (a ValueError) before the run.

The oracle is transformers' float32 forward (tests/oracle.py) with plain torch
hooks; tolerances are bulk_checks.RELATIVE (float32 on the CPU: 1e-5).
"""

from __future__ import annotations

import re
from contextlib import ExitStack

import pytest
import torch

import oracle
from access import relative_error
from bulk_checks import PROMPTS, RELATIVE
import streamscope
from streamscope.bulk.spec import CALIBRATION_TEXT, SteerError, stream_norms

STEPS = 3


def direction(model, seed: int) -> torch.Tensor:
    return torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(seed))


def plain_edit(rows: torch.Tensor, mode: str, unit: torch.Tensor, amount: float) -> torch.Tensor:
    """A clamp to `amount` or an ablation along `unit`, rows ``[n, hidden]``, in plain float32 torch."""
    along = rows @ unit
    if mode == "clamp":
        return rows + torch.outer(amount - along, unit)
    return rows - torch.outer(along, unit)


def oracle_logits(reference, family: str, prompt_ids: list[int], generated: list[int],
                  edits: list[tuple[str, int, str, torch.Tensor, float]], first: int) -> torch.Tensor:
    """The oracle's logits at each generated step, ``[steps, vocab]``, teacher-forced on the engine's tokens, with
    each edit ``(value, block, mode, unit, amount)`` applied by a plain hook at every position from `first` on."""
    ids = torch.tensor([prompt_ids + generated[:-1]])
    length = len(prompt_ids)
    with ExitStack() as stack, torch.no_grad():
        for value, block, mode, unit, amount in edits:
            module, where, factor = oracle.site(reference, family, value, block)
            assert factor is None

            def edit(tensor: torch.Tensor, mode=mode, unit=unit, amount=amount) -> None:
                stream = tensor.reshape(*ids.shape, tensor.shape[-1])[0]
                stream[first:] = plain_edit(stream[first:], mode, unit, amount)
            stack.enter_context(oracle.hooked(module, where, edit))
        logits = reference(ids).logits[0]
    return logits[length - 1:length - 1 + len(generated)]


def check_default_skips_the_first_token(model, reference, tokenizer, family: str, **options) -> None:
    """A default clamp and an ablation at every block edit positions 1.. and every generated token, not 0."""
    vector = direction(model, 0) * 3
    unit = vector / vector.norm()
    steers = [streamscope.Steer("layer_output", 0, vector, mode="clamp", projection=30.0),
              *[streamscope.Steer("layer_output", block, vector, mode="ablate") for block in range(1, model.num_layers)]]
    assert all(steer.positions == "all_but_first" for steer in steers)
    edits = [("layer_output", 0, "clamp", unit, 30.0),
             *[("layer_output", block, "ablate", unit, 1.0) for block in range(1, model.num_layers)]]
    prompts = PROMPTS[:2]
    result = model.generate(prompts, max_tokens=STEPS, steer=steers, return_logits=True, ignore_eos=True,
                            progress=False, **options)
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt).input_ids
        skipped = oracle_logits(reference, family, ids, list(result.tokens[index]), edits, first=1)
        everywhere = oracle_logits(reference, family, ids, list(result.tokens[index]), edits, first=0)
        got = result.logits[index]
        assert relative_error(got, skipped) <= RELATIVE, (index, relative_error(got, skipped))
        # Position 0 matters to these logits: a steer that edited it would be far from the oracle that skips it.
        assert relative_error(everywhere, skipped) > 100 * RELATIVE, index
    # positions="all" still edits every token: the oracle that edits position 0 too.
    every = [streamscope.Steer(steer.value, steer.layer, steer.vector, mode=steer.mode, projection=steer.projection,
                               scale=steer.scale, positions="all") for steer in steers]
    result = model.generate(prompts[:1], max_tokens=STEPS, steer=every, return_logits=True, ignore_eos=True,
                            progress=False, **options)
    ids = tokenizer(prompts[0]).input_ids
    expected = oracle_logits(reference, family, ids, list(result.tokens[0]), edits, first=0)
    assert relative_error(result.logits[0], expected) <= RELATIVE
    # A harvest under the default clamp: row 0 is the plain run's bit for bit, the others are clamped to 30.
    clamp = steers[:1]
    under = model.harvest(prompts, "layer_output", layers=[0], positions="all", steer=clamp, progress=False, **options)
    plain = model.harvest(prompts, "layer_output", layers=[0], positions="all", progress=False, **options)
    for index in range(len(prompts)):
        rows, before = under["layer_output"][index][0].float(), plain["layer_output"][index][0].float()
        assert torch.equal(rows[0], before[0]), index
        projections = rows[1:] @ unit
        assert float((projections - 30.0).abs().max()) <= RELATIVE * 30.0 * 10, index


#: (arguments, the field refused, the mode) for every mode: each argument its mode does not use.
UNUSED = [
    ({"mode": "clamp", "scale": 5.0}, "scale", "clamp"),
    ({"mode": "clamp", "scale": 1.0}, "scale", "clamp"),   # the old default, given: still refused
    ({"mode": "add", "projection": 3.0}, "projection", "add"),
    ({"mode": "ablate", "projection": 3.0}, "projection", "ablate"),
    ({"mode": "set", "projection": 0.0}, "projection", "set"),
    ({"mode": "sae_clamp", "scale": 2.0}, "scale", "sae_clamp"),
    ({"mode": "sae_clamp", "norm_match": True}, "norm_match", "sae_clamp"),
    ({"mode": "add", "feature": 3}, "feature", "add"),
    ({"mode": "clamp", "sae": object()}, "sae", "clamp"),
    ({"mode": "add", "generated": False, "from_step": 2}, "from_step", "add"),
    ({"mode": "ablate", "generated": False, "positions": "none"}, "positions", "ablate"),
]


def check_unused_arguments_are_refused(model, **options) -> None:
    """Each argument a mode does not use is refused when the steer is built and from JSON, naming the argument,
    the mode and the fix; the defaults are resolved per mode; the engine serves the next request."""
    vector = direction(model, 1)
    for arguments, field, mode in UNUSED:
        with pytest.raises(SteerError) as raised:
            streamscope.Steer("layer_output", 0, vector, **arguments)
        message = str(raised.value)
        assert isinstance(raised.value, ValueError)
        fixes = ("leave", "set generated", "steer some")  # each message ends with what to do instead
        assert field in message and repr(mode) in message and any(fix in message for fix in fixes), message
        assert raised.value.field == field, (arguments, raised.value.field)
        if "sae" not in arguments:
            data = {"value": "layer_output", "layer": 0, "vector": vector.tolist(), **arguments}
            with pytest.raises(SteerError, match=field):
                streamscope.Steer.from_dict(data)
    clamp = streamscope.Steer("layer_output", 0, vector, mode="clamp")
    add = streamscope.Steer("layer_output", 0, vector)
    assert (clamp.scale, clamp.projection, add.scale, add.projection) == (None, 0.0, 1.0, None)
    again = streamscope.Steer.from_dict(clamp.to_dict())  # a built steer travels as JSON and back
    assert (again.scale, again.projection, again.mode) == (None, 0.0, "clamp")
    after = model.generate(PROMPTS[:1], max_tokens=1, steer=[clamp], progress=False, **options)
    assert len(after.tokens[0]) == 1


def oracle_norm(reference, tokenizer, family: str, value: str, block: int) -> float:
    """The value's mean row norm over the calibration text's positions after the first, from the oracle."""
    ids = torch.tensor([tokenizer(CALIBRATION_TEXT).input_ids])
    found = {}
    module, where, _ = oracle.site(reference, family, value, block)

    def keep(tensor: torch.Tensor) -> None:
        found["rows"] = tensor.reshape(*ids.shape, tensor.shape[-1])[0].detach().float().clone()
    with oracle.hooked(module, where, keep), torch.no_grad():
        reference(ids)
    return float(found["rows"][1:].norm(dim=-1).mean())


def check_absurd_scales_are_refused(model, reference, tokenizer, family: str, **options) -> None:
    """Scales that overflow or dwarf the stream are refused before the run, with the measured norm in the message,
    and that norm is the oracle's; normal doses run; max_dose lifts the dose limit but not the overflow."""
    block = 1
    expected = oracle_norm(reference, tokenizer, family, "layer_output", block)
    measured = stream_norms(model, [("layer_output", block)])[("layer_output", block)]
    assert abs(measured - expected) <= RELATIVE * expected, (measured, expected)
    vector = direction(model, 2)
    length = float(vector.norm())

    def refused(steer, field: str, words: str) -> None:
        with pytest.raises(SteerError) as raised:
            model.generate(PROMPTS[:1], max_tokens=2, steer=[steer], progress=False, **options)
        message = str(raised.value)
        assert raised.value.field == field and words in message, message
        shown = re.search(r"\|\|h\|\| = ([0-9.e+-]+)", message)
        assert shown is not None, message
        assert abs(float(shown.group(1)) - expected) <= 5e-4 * expected, (shown.group(1), expected)

    refused(streamscope.Steer("layer_output", block, vector, scale=1e30), "scale", "overflows")
    refused(streamscope.Steer("layer_output", block, vector, scale=1e30, max_dose=None), "scale", "overflows")
    refused(streamscope.Steer("layer_output", block, vector, scale=1000 * expected / length), "scale", "dose 1000")
    refused(streamscope.Steer("layer_output", block, vector, mode="ablate", scale=1e6), "scale", "dose 1e+06")
    refused(streamscope.Steer("layer_output", block, vector, mode="clamp", projection=500 * expected), "projection",
            "dose 500")
    for steer in (streamscope.Steer("layer_output", block, vector, scale=15 * expected / length),  # a strong dose
                  streamscope.Steer("layer_output", block, vector, scale=1000 * expected / length, max_dose=None)):
        ran = model.generate(PROMPTS[:1], max_tokens=2, steer=[steer], ignore_eos=True, progress=False, **options)
        assert len(ran.tokens[0]) == 2


def check_bad_positions_are_refused(model, **options) -> None:
    """Positions that are no rule are refused as the steer is built, ones past a prompt before the run; both as a
    `SteerError` (a ValueError) naming the field; the engine serves the next request."""
    vector = direction(model, 3)
    for positions in ("first", [[0, 1]], 1.5, ["0"]):
        with pytest.raises(SteerError, match="positions") as raised:
            streamscope.Steer("layer_output", 0, vector, positions=positions)
        assert raised.value.field == "positions"
    length = len(model.tokenizer(PROMPTS[0])["input_ids"])
    past = streamscope.Steer("layer_output", 0, vector, positions=[100])
    with pytest.raises(SteerError, match=f"index 100 is out of range for prompt 0, which has {length} tokens"):
        model.generate(PROMPTS[:1], max_tokens=2, steer=[past], progress=False, **options)
    with pytest.raises(ValueError, match="positions"):
        model.harvest(PROMPTS[:1], "layer_output", layers=[0], steer=[past], progress=False, **options)
    after = model.generate(PROMPTS[:1], max_tokens=1, steer=[streamscope.Steer("layer_output", 0, vector)],
                           progress=False, **options)
    assert len(after.tokens[0]) == 1
