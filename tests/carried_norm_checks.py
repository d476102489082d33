"""A direction's carried stream norm, held to the oracle and to `model.norms`, on both engines.

`streamscope.directions.find` records ``||h||`` at the direction's value and
block over the prompts it is fit on (`Direction.stream_norm`): the oracle's
mean row norm (transformers' float32 forward read by a plain hook) over those
prompts' positions after the first, pooled, and exactly `model.norms` of the
same prompts. Its steer carries it to the dose check, which uses it (and
measures nothing for it): a clamp against it runs as the steer given, by hand,
the scale that `model.norms` makes the limit, bit for bit. Once the model has
measured a norm there, the carried one is still its steer's (the check does not
depend on what ran before), and a steer carrying none takes the measured one.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import oracle
from bulk_checks import PROMPTS, RELATIVE
from steer_checks import STEPS
import streamscope
from streamscope.bulk.spec import MAX_DOSE, measured_norms, stream_norms

BLOCK = 1
#: A value no other dose check in a module measures, so that its norm is the carried one.
VALUE = "mlp_output"


def oracle_pooled_norm(reference, tokenizer, family: str, prompts: list[str]) -> float:
    """The oracle's mean row norm of `VALUE` at `BLOCK` over `prompts`' positions after the first, pooled."""
    rows = []
    module, where, _ = oracle.site(reference, family, VALUE, BLOCK)
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        found: list[torch.Tensor] = []
        with oracle.hooked(module, where, lambda tensor: found.append(
                tensor.reshape(*ids.shape, tensor.shape[-1])[0].float().clone())), torch.no_grad():
            reference(ids)
        rows.append(found[0][1:].norm(dim=-1))
    return float(torch.cat(rows).mean())


def check_carried_norm(model, reference, tokenizer, family: str, **options) -> None:
    positive, negative = PROMPTS[:2], PROMPTS[2:4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", streamscope.directions.UnreliableFitWarning)  # two prompts a class
        sweep = streamscope.directions.find(model, positive, negative, value=VALUE, layers=[BLOCK], held_out=0.0,
                                            steering=False, progress=False, **options)
    direction = sweep[BLOCK]
    expected = oracle_pooled_norm(reference, tokenizer, family, positive + negative)
    assert direction.stream_norm is not None
    assert abs(direction.stream_norm - expected) <= RELATIVE * expected, (direction.stream_norm, expected)
    by_norms = float(model.norms(positive + negative, VALUE, layers=[BLOCK])[0])
    assert direction.stream_norm == by_norms, (direction.stream_norm, by_norms)
    site = (VALUE, BLOCK)
    assert site not in measured_norms(model), "another check measured this site first: the carried norm is unused"
    length = float(direction.vector.norm())
    given = 1000 * by_norms / length  # dose 1000 against the carried norm
    run = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False, **options}
    steer = direction.steer(scale=given, on_dose="clamp")
    with pytest.warns(streamscope.DoseWarning, match=r"dose 1000 = .* at layers\[1\]\.mlp_output \(carried by the "
                                                     r"steer's vector") as caught:
        clamped = model.generate(PROMPTS[:2], steer=[steer], **run)
    assert not [item for item in caught if "calibration text" in str(item.message)]
    assert site not in measured_norms(model), "a carried norm spares the calibration harvest"
    number = given * MAX_DOSE / (given * length / by_norms)
    by_hand = streamscope.Steer(VALUE, BLOCK, direction.vector, scale=number, max_dose=None)
    again = model.generate(PROMPTS[:2], steer=[by_hand], **run)
    for index in range(2):
        assert torch.equal(clamped.logits[index], again.logits[index]), index
    # Once the model has measured the site, the carried norm is still the steer's; a steer without one takes the
    # measured norm.
    stream_norms(model, [site])
    with pytest.warns(streamscope.DoseWarning, match=r"at layers\[1\]\.mlp_output \(carried by the steer's vector"):
        model.generate(PROMPTS[:1], steer=[steer], **{**run, "max_tokens": 1})
    plain = streamscope.Steer(VALUE, BLOCK, direction.vector, scale=given, on_dose="clamp")
    with pytest.warns(streamscope.DoseWarning, match=r"at layers\[1\]\.mlp_output \(measured by streamscope on its "
                                                     r"calibration text"):
        model.generate(PROMPTS[:1], steer=[plain], **{**run, "max_tokens": 1})
