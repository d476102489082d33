"""Conditional steering (CAST-style) held to the oracle, both engines.

The reference is transformers' float32 forward (tests/oracle.py) with two
plain torch hooks per steer: one at the condition's module computes each
row's projection (or cosine) on the condition direction and keeps which rows
pass (row scope) or whether the prompt's mean stream passes (request scope);
one at the steer's module applies the operation (tests/steer_checks.py's plain
torch) to the steered rows that passed. A generation is teacher-forced with
the engine's own tokens, as tests/steer_checks.py does.

Thresholds are picked from the oracle's own measures of a plain run, in the
middle of a gap between two of them, and every measure the checked run
compares is asserted to lie away from its threshold by a margin far above the
engines' agreement (`bulk_checks.RELATIVE`), so the decision is the oracle's,
not rounding's.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Optional

import torch

import oracle
from access import relative_error
from bulk_checks import PROMPTS, RELATIVE
from steer_checks import STEPS, edited_positions, plain_operation, vector
import streamscope

#: How far from its threshold every compared measure must lie, in units of its bound ``RELATIVE * |h|`` (a
#: projection; ``RELATIVE`` for a cosine): an engine's row within ``RELATIVE * |h|`` of the oracle's moves the
#: projection on a unit vector by at most that (Cauchy-Schwarz) and a cosine by at most twice ``RELATIVE``; ten
#: bounds keep every decision the oracle's, never rounding's.
MARGIN = 10.0


def measures(rows: torch.Tensor, condition) -> torch.Tensor:
    """The condition's measure of each row ``[n, hidden]``, plain float32 torch."""
    unit = condition.vector.float() / condition.vector.float().norm()
    along = rows.float() @ unit
    return along / rows.float().norm(dim=-1) if condition.measure == "cosine" else along


def bound(rows: torch.Tensor, condition) -> torch.Tensor:
    """How far an engine's measure of each row may lie from the oracle's: ``RELATIVE * |h|`` (projection), or
    ``2 * RELATIVE`` (cosine)."""
    if condition.measure == "cosine":
        return torch.full((rows.shape[0],), 2 * RELATIVE)
    return RELATIVE * rows.float().norm(dim=-1)


def passes(values: torch.Tensor, condition) -> torch.Tensor:
    return values > condition.threshold if condition.compare == "greater" else values < condition.threshold


def condition_rows(reference, family: str, ids: list[int], condition) -> torch.Tensor:
    """The condition value's rows ``[tokens, hidden]`` in the oracle's plain forward of `ids`."""
    found: list[torch.Tensor] = []
    module, where, _ = oracle.site(reference, family, condition.value.split(".")[-1],
                                   None if condition.layer is None else
                                   condition.layer % oracle.num_layers(reference, family))
    with oracle.hooked(module, where, lambda tensor: found.append(tensor.reshape(-1, tensor.shape[-1]).clone())), \
            torch.no_grad():
        reference(torch.tensor([ids]))
    return found[0]


def oracle_logits(reference, family: str, prompt_ids: list[int], generated: list[int], steers,
                  compared: list[torch.Tensor]) -> torch.Tensor:
    """The oracle's logits at each generated step, ``[steps, vocab]``, each conditional steer applied by plain hooks
    where its condition passes; each decision's measures are appended to `compared`, ``[3, n]``: the measure minus
    the threshold, whether it passed, and how far an engine's measure may lie from it (`bound`)."""
    ids = torch.tensor([prompt_ids + generated[:-1]])
    length, total = len(prompt_ids), ids.shape[1]
    with ExitStack() as stack, torch.no_grad():
        for steer in steers:
            condition = steer.condition
            state: dict[str, torch.Tensor] = {}
            positions = edited_positions(steer, length, total)
            layers = oracle.num_layers(reference, family)
            if condition is None:  # a plain steer beside them: every position it names
                state["rows"] = torch.ones(len(positions), dtype=torch.bool)

            def decide(tensor: torch.Tensor, condition=condition, state=state, positions=positions) -> None:
                stream = tensor.reshape(total, tensor.shape[-1])
                if condition.scope == "row":
                    rows = stream[positions] if positions else stream[:0]
                    values = measures(rows, condition)
                    state["rows"] = passes(values, condition)
                else:
                    prompt = stream[1:length] if length > 1 else stream[:1]
                    rows = prompt.float().mean(0, keepdim=True)
                    values = measures(rows, condition)
                    state["rows"] = passes(values, condition).expand(len(positions))
                compared.append(torch.stack([values - condition.threshold, passes(values, condition).float(),
                                             bound(rows, condition)]))

            def edit(tensor: torch.Tensor, steer=steer, state=state, positions=positions) -> None:
                stream = tensor.reshape(total, tensor.shape[-1])
                chosen = [position for position, passed in zip(positions, state["rows"].tolist()) if passed]
                if chosen:
                    stream[chosen] = plain_operation(stream[chosen], steer)

            if condition is not None:
                where = oracle.site(reference, family, condition.value.split(".")[-1],
                                    None if condition.layer is None else condition.layer % layers)
                stack.enter_context(oracle.hooked(where[0], where[1], decide))  # the condition first, at a shared call
            module, at, factor = oracle.site(reference, family, steer.value.split(".")[-1], steer.layer % layers)
            assert factor is None  # the bulk families' values are not scaled
            stack.enter_context(oracle.hooked(module, at, edit))
        logits = reference(ids).logits[0]
    return logits[length - 1:length - 1 + len(generated)]


def gap_threshold(values: torch.Tensor, at: float = 0.5) -> float:
    """A threshold in the widest gap between sorted `values` near their `at` quantile: between two measured rows."""
    ordered = values.float().sort().values
    middle = int(at * (len(ordered) - 1))
    window = range(max(0, middle - 3), min(len(ordered) - 1, middle + 3))
    best = max(window, key=lambda index: float(ordered[index + 1] - ordered[index]))
    return float(ordered[best] + ordered[best + 1]) / 2


def prompt_ids(tokenizer, prompts) -> list[list[int]]:
    return [tokenizer(prompt).input_ids for prompt in prompts]


def row_condition(model, reference, tokenizer, family: str, value: str, layer: int, seed: int,
                  compare: str = "greater", measure: str = "projection") -> "streamscope.Condition":
    """A row-scoped condition whose threshold splits the prompts' rows (after the first) in the oracle."""
    direction = vector(model, seed)
    probe = streamscope.Condition(value, layer, direction, 0.0, compare=compare, measure=measure)
    rows = torch.cat([measures(condition_rows(reference, family, ids, probe)[1:], probe)
                      for ids in prompt_ids(tokenizer, PROMPTS[:2])])
    return streamscope.Condition(value, layer, direction, gap_threshold(rows), compare=compare, measure=measure)


def request_condition(model, reference, tokenizer, family: str, value: str, layer: int, seed: int,
                      measure: str = "cosine") -> tuple["streamscope.Condition", list[bool]]:
    """A request-scoped condition that passes for one of the first two prompts and not the other, and which."""
    direction = vector(model, seed)
    probe = streamscope.Condition(value, layer, direction, 0.0, measure=measure, scope="request")
    means = torch.cat([measures(condition_rows(reference, family, ids, probe)[1:].mean(0, keepdim=True), probe)
                       for ids in prompt_ids(tokenizer, PROMPTS[:2])])
    threshold = float(means.sum()) / 2
    condition = streamscope.Condition(value, layer, direction, threshold, measure=measure, scope="request")
    return condition, [bool(mean > threshold) for mean in means]


def cases(model, reference, tokenizer, family: str) -> dict[str, list]:
    """name -> the conditional steers of one run."""
    last = model.num_layers - 1
    return {
        # A condition at an earlier block than the steer, each token deciding for itself, prefill and decode.
        "row_earlier_block": [streamscope.Steer(
            "layer_output", last, vector(model, 20), scale=6.0,
            condition=row_condition(model, reference, tokenizer, family, "layer_output", 0, 21))],
        # At the steered value itself: the condition reads the row before the steer edits it.
        "row_same_site_less": [streamscope.Steer(
            "layer_output", 0, vector(model, 22), mode="ablate",
            condition=row_condition(model, reference, tokenizer, family, "layer_output", 0, 23, compare="less"))],
        # An earlier value of the same block (its attention's output), by cosine; a clamp of generated tokens only from step 1.
        "row_cosine_mid": [streamscope.Steer(
            "layer_output", 0, vector(model, 24), mode="clamp", projection=3.0, from_step=1,
            condition=row_condition(model, reference, tokenizer, family, "attention_output", 0, 25, measure="cosine"))],
        # One decision a request, from its prompt's mean stream: steers every selected row of it, or none.
        "request_cosine": [streamscope.Steer(
            "mlp_output", last, vector(model, 26), scale=5.0,
            condition=request_condition(model, reference, tokenizer, family, "layer_input", 0, 27)[0])],
        "request_projection_with_a_plain_steer": [
            streamscope.Steer("layer_output", 0, vector(model, 28), scale=2.0, positions="last"),
            streamscope.Steer("layer_output", last, vector(model, 29), mode="ablate",
                              condition=request_condition(model, reference, tokenizer, family, "attention_output", 0, 30,
                                                          measure="projection")[0])],
    }


def check_case(model, reference, tokenizer, family: str, name: str, **options) -> None:
    """A conditional generation equals the oracle's hooked forward at every step, on 2 prompts; every decision
    lies clear of its threshold; and the run differs from the plain one where a condition passed."""
    steers = cases(model, reference, tokenizer, family)[name]
    prompts = PROMPTS[:2]
    run = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False, **options}
    result = model.generate(prompts, steer=steers, **run)
    plain = model.generate(prompts, **run)
    compared: list[torch.Tensor] = []
    steered_any = False
    for index, ids in enumerate(prompt_ids(tokenizer, prompts)):
        expected = oracle_logits(reference, family, ids, list(result.tokens[index]), steers, compared)
        got = result.logits[index]
        assert got.shape == expected.shape == (STEPS, model.vocab_size)
        assert relative_error(got, expected) <= RELATIVE, (name, index, relative_error(got, expected))
        steered_any = steered_any or not torch.equal(got, plain.logits[index])
    gaps, passed, bounds = torch.cat(compared, dim=1)
    assert bool((gaps.abs() > MARGIN * bounds).all()), (name, float((gaps.abs() / bounds).min()))
    assert 0 < float(passed.sum()) < len(passed), (name, passed)  # some decisions pass, some do not
    assert steered_any, name


def check_never_passing_and_batchmates(model, reference, tokenizer, family: str, **options) -> None:
    """A request whose condition never passes runs bit for bit as the unsteered run; a conditional steer of one
    prompt leaves its batchmate bit for bit as the unsteered run; a request-scoped condition steers exactly the
    request it passes for."""
    prompts = PROMPTS[:2]
    run = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False, **options}
    plain = model.generate(prompts, **run)
    never = streamscope.Condition("layer_output", 0, vector(model, 31), 1e6)
    nothing = model.generate(prompts, steer=[streamscope.Steer("layer_output", 1, vector(model, 32), scale=8.0,
                                                              positions="all", condition=never)], **run)
    for index in range(len(prompts)):
        assert torch.equal(nothing.logits[index], plain.logits[index]), index
        assert nothing.tokens[index] == plain.tokens[index], index
    always = streamscope.Condition("layer_output", 0, vector(model, 31), -1e6)
    only_first = model.generate(prompts, steer=[streamscope.Steer("layer_output", 1, vector(model, 32), scale=8.0,
                                                                 prompts=[0], condition=always)], **run)
    assert torch.equal(only_first.logits[1], plain.logits[1])
    assert not torch.equal(only_first.logits[0], plain.logits[0])
    condition, passed = request_condition(model, reference, tokenizer, family, "layer_output", 0, 33)
    assert sorted(passed) == [False, True]
    gated = model.generate(prompts, steer=[streamscope.Steer("layer_output", 1, vector(model, 34), scale=8.0,
                                                            condition=condition)], **run)
    for index in range(len(prompts)):
        same = torch.equal(gated.logits[index], plain.logits[index])
        assert same != passed[index], (index, passed)


def check_harvest(model, reference, tokenizer, family: str, **options) -> None:
    """`model.harvest(..., steer=[conditional])` reads the steered value: the plain row plus ``scale * v`` exactly
    at the rows whose condition passes in the oracle (a steer at the harvested value, the last block's output,
    changes nothing before it), the plain row elsewhere (position 0 too: the default positions skip it)."""
    steer = cases(model, reference, tokenizer, family)["row_earlier_block"][0]
    last = model.num_layers - 1
    read = {"positions": "all", "progress": False, **options}
    steered = model.harvest(PROMPTS[:2], "layer_output", layers=[last], steer=[steer], **read)["layer_output"]
    plain = model.harvest(PROMPTS[:2], "layer_output", layers=[last], **read)["layer_output"]
    counts = []
    for index, ids in enumerate(prompt_ids(tokenizer, PROMPTS[:2])):
        passed = passes(measures(condition_rows(reference, family, ids, steer.condition), steer.condition),
                        steer.condition)
        passed[0] = False
        expected = plain[index][0] + passed.unsqueeze(-1).float() * (steer.scale * steer.vector)
        assert relative_error(steered[index][0], expected) <= RELATIVE, index
        assert torch.equal(steered[index][0][~passed], plain[index][0][~passed]), index
        counts.append(int(passed.sum()))
    assert 0 < sum(counts) < sum(len(ids) - 1 for ids in prompt_ids(tokenizer, PROMPTS[:2])), counts


def check_bad_conditions(model, **options) -> None:
    """A condition that cannot run is refused before the engine runs, naming the fix; the engine serves on."""
    good = vector(model, 35)
    last = model.num_layers - 1
    bad = {
        "computes after the steered value": lambda: streamscope.Steer(
            "layer_output", 0, good, condition=streamscope.Condition("layer_output", last, good, 0.0)),
        r"\[hidden_size\]": lambda: streamscope.Steer(
            "layer_output", 1, good, condition=streamscope.Condition("layer_output", 0, torch.ones(3), 0.0)),
        "compare='above'": lambda: streamscope.Condition("layer_output", 0, good, 0.0, compare="above"),
        "scope='prompt'": lambda: streamscope.Condition("layer_output", 0, good, 0.0, scope="prompt"),
        "all zeros": lambda: streamscope.Condition("layer_output", 0, torch.zeros(model.hidden_size), 0.0),
        "threshold=nan": lambda: streamscope.Condition("layer_output", 0, good, float("nan")),
        "out of range": lambda: streamscope.Steer(
            "layer_output", 1, good, condition=streamscope.Condition("layer_output", 99, good, 0.0)),
    }
    for message, build in bad.items():
        try:
            steer = build()
            model.generate(PROMPTS[:1], max_tokens=2, steer=[steer], progress=False, **options)
        except (ValueError, TypeError) as error:
            import re

            assert re.search(message, str(error)), (message, str(error))
        else:
            raise AssertionError(f"not refused: {message}")
    after = model.generate(PROMPTS[:1], max_tokens=1, progress=False, **options)
    assert len(after.tokens[0]) == 1


def round_trip(steer) -> Optional[dict]:
    """A conditional steer's data, read back: the same steer (`Steer.to_dict` / `from_dict`)."""
    data = steer.to_dict()
    back = streamscope.Steer.from_dict(data)
    assert back.condition is not None and torch.equal(back.condition.vector, steer.condition.vector.float())
    assert back.to_dict() == data
    return data
