"""Conditional steering and the dose guard over HTTP: one real `streamscope serve` shared by the module.

A conditional steer sent by `streamscope.Client` is decided in the server's
worker at every step: the greedy tokens are the oracle's (transformers'
float32 forward of the same checkpoint, gated by plain torch hooks:
tests/conditional_steer_checks.py) and the harvested rows are the plain rows
plus the edit exactly where the oracle's condition passes. A request whose
condition never passes is the unsteered request bit for bit. A dose past the
limit is refused by default, run at the limit with ``on_dose="clamp"`` (the
server's log names it), and ``"warn"`` is refused by a server whose
--steer-dose-action does not allow running past its limit; a server that does
clamps or warns for the requests that do not say (checked on the front end's
`Checker`).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import conditional_steer_checks as checks
import precision
from bulk_checks import PROMPTS, RELATIVE
from serve_process import KEY, running
from steer_checks import STEPS
import streamscope
from streamscope.bulk.spec import CALIBRATION_TEXT

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="a server subprocess would ask for vLLM's default 90% of "
                                "the GPU beside the GPU suite's engines; the worker's gates run the bulk path's "
                                "`Gate`, held to the oracle on the GPU by tests/vllm/test_conditional_steer.py")

FAMILY = "llama"


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints(FAMILY)


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    return tmp_path_factory.mktemp("serve") / "server.log"


@pytest.fixture(scope="module")
def server(path, log):
    # a request-scoped condition decides on the whole prompt: a server that may split one refuses it
    # (tests/vllm/test_serve_safety.py)
    with running(path, log, "--no-enable-chunked-prefill") as url:
        yield url


@pytest.fixture(scope="module")
def reference(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(path):
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def shape(reference):
    """What the checks need of a model: its width and depth."""
    return SimpleNamespace(hidden_size=reference.config.hidden_size, num_layers=reference.config.num_hidden_layers)


@pytest.fixture(scope="module")
def client(server):
    return streamscope.Client(server, api_key=KEY, concurrency=1)  # one request at a time: solo runs, bit for bit


def last_rows(client, shape, steers=(), prompts=PROMPTS[:2]):
    """Each prompt's greedy tokens and its harvested last-block output at every prompt position."""
    harvest = {"values": "layer_output", "layers": [shape.num_layers - 1], "positions": "all"}
    result = client.generate(list(prompts), max_tokens=STEPS, steer=list(steers), harvest=harvest, ignore_eos=True)
    return result.tokens, [rows[0] for rows in result.harvest["layer_output"]]


@pytest.mark.parametrize("case", ["row_earlier_block", "request_cosine"])
def test_a_conditional_generation_over_http_is_the_oracles(client, shape, reference, tokenizer, case):
    """Each greedy token is the oracle's gated forward's argmax, clear of the runner-up; the run is steered."""
    steers = checks.cases(shape, reference, tokenizer, FAMILY)[case]
    tokens, _ = last_rows(client, shape, steers)
    plain, _ = last_rows(client, shape)
    compared: list[torch.Tensor] = []
    for index, ids in enumerate(checks.prompt_ids(tokenizer, PROMPTS[:2])):
        logits = checks.oracle_logits(reference, FAMILY, ids, list(tokens[index]), steers, compared)
        top = logits.topk(2, dim=-1)
        assert [int(token) for token in top.indices[:, 0]] == list(tokens[index]), (case, index)
        gap = top.values[:, 0] - top.values[:, 1]
        assert bool((gap > 10 * RELATIVE * logits.abs().max(dim=-1).values).all()), (case, index, gap)
    gaps, passed, bounds = torch.cat(compared, dim=1)
    assert bool((gaps.abs() > checks.MARGIN * bounds).all()), case
    assert 0 < float(passed.sum()) < len(passed), case
    assert tokens != plain, case


def test_the_harvest_under_a_conditional_steer_is_edited_where_the_oracle_passes(client, shape, reference,
                                                                                 tokenizer):
    steer = checks.cases(shape, reference, tokenizer, FAMILY)["row_earlier_block"][0]
    _, steered = last_rows(client, shape, [steer])
    _, plain = last_rows(client, shape)
    for index, ids in enumerate(checks.prompt_ids(tokenizer, PROMPTS[:2])):
        passed = checks.passes(checks.measures(checks.condition_rows(reference, FAMILY, ids, steer.condition),
                                               steer.condition), steer.condition)
        passed[0] = False  # the default positions skip the first token
        expected = plain[index] + passed.unsqueeze(-1).float() * (steer.scale * steer.vector)
        assert float((steered[index] - expected).norm() / expected.norm()) <= RELATIVE, index
        assert torch.equal(steered[index][~passed], plain[index][~passed]), index
        assert 0 < int(passed.sum()) < len(ids) - 1, index


def test_a_request_whose_condition_never_passes_is_the_plain_request_bit_for_bit(client, shape, reference,
                                                                                  tokenizer):
    never = streamscope.Condition("layer_output", 0, checks.vector(shape, 31), 1e6)
    steer = streamscope.Steer("layer_output", 1, checks.vector(shape, 32), scale=8.0, positions="all",
                              condition=never)
    tokens, rows = last_rows(client, shape, [steer])
    plain_tokens, plain = last_rows(client, shape)
    assert tokens == plain_tokens
    for index in range(2):
        assert torch.equal(rows[index], plain[index]), index
    # A request-scoped condition steers the request it passes for, and leaves the other as it was, bit for bit.
    condition, passed = checks.request_condition(shape, reference, tokenizer, FAMILY, "layer_output", 0, 33)
    gated = streamscope.Steer("layer_output", 1, checks.vector(shape, 34), scale=8.0, condition=condition)
    _, rows = last_rows(client, shape, [gated])
    for index in range(2):
        assert torch.equal(rows[index], plain[index]) != passed[index], (index, passed)


def oracle_norm(reference, tokenizer, layer: int) -> float:
    """``||h||`` of layer_output at `layer` as the dose check measures it: the mean row norm over the calibration
    text's positions after the first, in the oracle."""
    found = []
    handle = reference.model.layers[layer].register_forward_hook(lambda _, args, output: found.append(
        (output[0] if isinstance(output, tuple) else output)[0].detach().clone()))
    try:
        with torch.no_grad():
            reference(torch.tensor([tokenizer(CALIBRATION_TEXT).input_ids]))
    finally:
        handle.remove()
    return float(found[0][1:].norm(dim=-1).mean())


def test_a_dose_past_the_limit_is_clamped_to_it_on_request_and_the_log_says_so(client, shape, reference, tokenizer,
                                                                                log):
    last = shape.num_layers - 1
    direction = checks.vector(shape, 40)
    norm = oracle_norm(reference, tokenizer, last)
    scale = 1000.0 * norm / float(direction.norm())  # dose 1000, ten times the server's limit
    steer = streamscope.Steer("layer_output", last, direction, scale=scale, positions="all", generated=False,
                              on_dose="clamp")
    # The client is told as the log is: the response's warning header, raised as a DoseWarning.
    with pytest.warns(streamscope.DoseWarning, match=r"dose 1000 = .*the limit is max_dose=100; clamped to the limit"):
        _, rows = last_rows(client, shape, [steer], PROMPTS[:1])
    _, plain = last_rows(client, shape, (), PROMPTS[:1])
    # Clamped: scale x (max_dose / dose), so the edit is max_dose * ||h|| along the direction.
    expected = plain[0] + 100.0 * norm * direction / direction.norm()
    assert float((rows[0] - expected).norm() / expected.norm()) <= RELATIVE
    assert "clamped to the limit" in log.read_text()
    refused = streamscope.Steer("layer_output", last, direction, scale=scale, positions="all")
    with pytest.raises(Exception, match="on_dose='clamp'"):
        last_rows(client, shape, [refused], PROMPTS[:1])
    # A steer's own lower limit is the one applied: dose 50, within the server's 100, clamped to the steer's 10.
    own = streamscope.Steer("layer_output", last, direction, scale=scale / 20, positions="all", generated=False,
                            max_dose=10.0, on_dose="clamp")
    with pytest.warns(streamscope.DoseWarning, match=r"dose 50 = .*the limit is max_dose=10; clamped to the limit"):
        _, rows = last_rows(client, shape, [own], PROMPTS[:1])
    expected = plain[0] + 10.0 * norm * direction / direction.norm()
    assert float((rows[0] - expected).norm() / expected.norm()) <= RELATIVE


def test_warn_is_refused_by_a_server_that_refuses_past_its_limit(server, shape):
    body = {"model": streamscope.Client(server, api_key=KEY).model, "prompt": PROMPTS[0], "max_tokens": 2,
            "streamscope": {"steer": [{"value": "layer_output", "layer": 1, "on_dose": "warn",
                                       "vector": checks.vector(shape, 41).tolist()}]}}
    response = httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "streamscope.steer[0].on_dose" and "--steer-dose-action" in error["message"], error
    bad = {**body, "streamscope": {"steer": [{"value": "layer_output", "layer": 1,
                                              "vector": checks.vector(shape, 41).tolist(),
                                              "condition": {"value": "layer_output", "layer": 1, "threshold": 0.0,
                                                            "vector": [0.0] * shape.hidden_size}}]}}
    response = httpx.post(server + "/v1/completions", json=bad, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "streamscope.steer[0].condition.vector", \
        response.text
    assert httpx.post(server + "/v1/completions", json={k: v for k, v in body.items() if k != "streamscope"},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120).status_code == 200


@pytest.mark.parametrize("action", ["clamp", "warn"])
def test_the_servers_dose_action_applies_to_requests_that_do_not_say(checkpoints, reference, tokenizer, shape,
                                                                       action, caplog):
    """`--steer-dose-action clamp|warn` on the front end's check: a steer past the limit is sent to the worker
    at the limit (clamp) or as sent (warn), and the log names the dose and the limit; a request may still ask
    to refuse."""
    from streamscope.serve.protocol import Checker, Limits, RequestError
    from streamscope.serve.storage import Vectors
    from streamscope.vllm.model import StandardizedVLLM

    model = StandardizedVLLM(str(checkpoints(FAMILY)), dispatch=False, dtype="float32")
    limits = Limits(steer_dose_action=action)
    checker = Checker(model, Vectors(limits), limits)
    last = shape.num_layers - 1
    norm = oracle_norm(reference, tokenizer, last)
    checker.norms[("layer_output", last)] = norm
    direction = checks.vector(shape, 42)
    scale = 500.0 * norm / float(direction.norm())
    raw = {"value": "layer_output", "layer": last, "vector": direction.tolist(), "scale": scale}
    with caplog.at_level(logging.WARNING, logger="streamscope.serve"):
        steer, payload = checker.steer(raw, "steer[0]", [])
    sent = scale * 100.0 / 500.0 if action == "clamp" else scale
    assert abs(payload["scale"] - sent) <= 1e-6 * sent and abs(steer.scale - sent) <= 1e-6 * sent
    assert "limit is max_dose=100" in caplog.text and "dose 500" in caplog.text
    with pytest.raises(RequestError, match="on_dose='clamp'"):
        checker.steer({**raw, "on_dose": "refuse"}, "steer[0]", [])


def test_a_request_scoped_decision_is_never_read_from_the_prefix_cache(client, shape, tokenizer):
    """The same request-scoped request twice, its prompt longer than two of vLLM's KV blocks (128 tokens on this
    CPU): the second is not handed the first's cached prefix (which would leave it nothing to decide on, and
    unsteered), so both are the same steered run."""
    prompt = " ".join([PROMPTS[0]] * 200)
    ids = tokenizer(prompt).input_ids[:300]
    prompt = tokenizer.decode(ids)
    assert 256 < len(tokenizer(prompt).input_ids) < 400
    always = streamscope.Condition("layer_output", 0, checks.vector(shape, 35), -1e9, scope="request")
    steer = streamscope.Steer("layer_output", 1, checks.vector(shape, 36), scale=8.0, condition=always)
    runs = [client.generate([prompt], max_tokens=STEPS, steer=steers, ignore_eos=True).tokens[0]
            for steers in ([steer], [steer], [])]  # no harvest: its salt would hide a shared prefix
    assert runs[1] == runs[0]
    assert runs[0] != runs[2]
