"""The dose guard's actions (`Steer.on_dose`: refuse, clamp, warn) held to the oracle, both engines.

The dose is ``edit / ||h||`` with ``||h||`` the stream's norm streamscope
measures at the steered value and block (`streamscope.bulk.spec.stream_norms`),
which equals the oracle's (transformers' float32 forward read by a plain
hook: tests/steer_safety_checks.py's `oracle_norm`). A clamped steer runs at
exactly the limit: its harvested edit is ``max_dose * ||h||`` along the
direction (the oracle's norm), and its generation equals, bit for bit, the run
of the same steer given the clamped number by hand. A warned steer runs as
given, bit for bit as with the limit lifted.
"""

from __future__ import annotations

import pytest
import torch

from bulk_checks import PROMPTS, RELATIVE
from steer_checks import STEPS
from steer_safety_checks import direction, oracle_norm
import streamscope
from streamscope.bulk.spec import MAX_DOSE, SteerError, stream_norms

BLOCK = 1


def settings(norm: float, length: float) -> dict[str, dict]:
    """Per mode, a steer's numbers at ten times (ablate: 1.5 times) the default limit."""
    return {"add": {"scale": 1000 * norm / length}, "clamp": {"projection": -1000 * norm},
            "ablate": {"scale": 150.0}}


def clamped_number(mode: str, given: float, norm: float, length: float) -> float:
    """The number `Steer.on_dose="clamp"` runs with: the given one times ``max_dose / dose``."""
    size = {"add": abs(given) * length, "clamp": abs(given), "ablate": abs(given) * norm}[mode]
    return given * (MAX_DOSE / (size / norm))


def check_clamp(model, reference, tokenizer, family: str, **options) -> None:
    """Each mode past the limit with ``on_dose="clamp"`` warns with the dose and the limit, and runs as the same
    steer given the clamped number, bit for bit; an add's clamped edit is ``max_dose * ||h||`` with the oracle's
    norm."""
    expected = oracle_norm(reference, tokenizer, family, "layer_output", BLOCK)
    measured = stream_norms(model, [("layer_output", BLOCK)])[("layer_output", BLOCK)]
    assert abs(measured - expected) <= RELATIVE * expected, (measured, expected)
    vector = direction(model, 50)
    length = float(vector.norm())
    run = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False, **options}
    for mode, numbers in settings(measured, length).items():
        field, given = next(iter(numbers.items()))
        steer = streamscope.Steer("layer_output", BLOCK, vector, mode=mode, on_dose="clamp", **numbers)
        dose = "1000" if mode != "ablate" else "150"
        with pytest.warns(streamscope.DoseWarning, match=rf"dose {dose} = .* limit is max_dose=100; clamped to the "
                                                         rf"limit: {field}"):
            clamped = model.generate(PROMPTS[:2], steer=[steer], **run)
        number = clamped_number(mode, given, measured, length)
        by_hand = streamscope.Steer("layer_output", BLOCK, vector, mode=mode, max_dose=None, **{field: number})
        again = model.generate(PROMPTS[:2], steer=[by_hand], **run)
        for index in range(2):
            assert torch.equal(clamped.logits[index], again.logits[index]), (mode, index)
    # The clamped add's edit, read where it is made: max_dose * ||h|| along the direction, ||h|| the oracle's.
    steer = streamscope.Steer("layer_output", BLOCK, vector, positions="all", on_dose="clamp",
                              **settings(measured, length)["add"])
    read = {"layers": [BLOCK], "positions": "all", "progress": False, **options}
    with pytest.warns(streamscope.DoseWarning):
        steered = model.harvest(PROMPTS[:1], "layer_output", steer=[steer], **read)["layer_output"][0][0]
    plain = model.harvest(PROMPTS[:1], "layer_output", **read)["layer_output"][0][0]
    edit = MAX_DOSE * expected * vector / length
    assert float((steered - plain - edit).norm() / (plain + edit).norm()) <= RELATIVE


def check_warn_and_refuse(model, **options) -> None:
    """``on_dose="warn"`` warns with the dose and the limit and runs as given (bit for bit the run with the limit
    lifted); the default refuses, naming on_dose; an unknown action is refused as the steer is built."""
    measured = stream_norms(model, [("layer_output", BLOCK)])[("layer_output", BLOCK)]
    vector = direction(model, 51)
    scale = 1000 * measured / float(vector.norm())
    run = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False, **options}
    with pytest.warns(streamscope.DoseWarning, match=r"dose 1000 = .* limit is max_dose=100; it runs as given"):
        warned = model.generate(PROMPTS[:2], steer=[streamscope.Steer("layer_output", BLOCK, vector, scale=scale,
                                                                      on_dose="warn")], **run)
    lifted = model.generate(PROMPTS[:2], steer=[streamscope.Steer("layer_output", BLOCK, vector, scale=scale,
                                                                  max_dose=None)], **run)
    for index in range(2):
        assert torch.equal(warned.logits[index], lifted.logits[index]), index
    with pytest.raises(SteerError, match="on_dose='clamp'") as raised:
        model.generate(PROMPTS[:1], steer=[streamscope.Steer("layer_output", BLOCK, vector, scale=scale)], **run)
    assert raised.value.field == "scale"
    with pytest.raises(SteerError, match="on_dose='shrink'") as raised:
        streamscope.Steer("layer_output", BLOCK, vector, on_dose="shrink")
    assert raised.value.field == "on_dose"
    # Within the limit nothing is said and nothing changes.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", streamscope.DoseWarning)
        model.generate(PROMPTS[:1], steer=[streamscope.Steer("layer_output", BLOCK, vector, scale=scale / 100,
                                                             on_dose="clamp")], **run)


def check_norms(model, reference, tokenizer, family: str) -> None:
    """`model.norms(prompts)` per block is the oracle's mean row norm over the prompts' positions after the first,
    pooled; `model.norms()` is the calibration text's, the norms the dose check measures against."""
    import oracle

    layers = list(range(model.num_layers))
    calibration = model.norms()
    assert calibration.shape == (model.num_layers,)
    for layer in layers:
        expected = oracle_norm(reference, tokenizer, family, "layer_output", layer)
        assert abs(float(calibration[layer]) - expected) <= RELATIVE * expected, layer
        measured = stream_norms(model, [("layer_output", layer)])[("layer_output", layer)]
        assert abs(float(calibration[layer]) - measured) <= RELATIVE * measured, layer
    got = model.norms(PROMPTS[:2], "mlp_output", layers=[0, model.num_layers - 1])
    for index, layer in enumerate([0, model.num_layers - 1]):
        rows = []
        for prompt in PROMPTS[:2]:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            module, where, _ = oracle.site(reference, family, "mlp_output", layer)
            found = []
            with oracle.hooked(module, where, lambda tensor: found.append(
                    tensor.reshape(*ids.shape, tensor.shape[-1])[0].float().clone())), torch.no_grad():
                reference(ids)
            rows.append(found[0][1:].norm(dim=-1))
        expected = float(torch.cat(rows).mean())
        assert abs(float(got[index]) - expected) <= RELATIVE * expected, (layer, float(got[index]), expected)
