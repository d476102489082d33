"""``streamscope serve``: vLLM's own server in a subprocess, spoken to with the ``openai`` client and streamscope.Client.

One server for the module (tiny Llama, float32, vLLM's serving defaults:
prefix caching on, its own engine process), held to an in-process engine of
the same checkpoint: steered completions equal ``model.generate(steer=...)``
(tokens, and log-probs within the suite's CPU 1e-5), unsteered ones equal
plain vLLM's, harvests equal ``model.harvest`` bit for bit, 32 concurrent
mixed requests each equal its solo run, and every refused request is followed
by a request that must equal a fresh server's answer.
"""

from __future__ import annotations

import json
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

import precision
from serve_process import KEY, running
import streamscope
from streamscope import Steer

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="the CPU build's server; the GPU run is benchmarks/serve_load.py")

TOLERANCE = precision.CPU_FLOAT32
HIDDEN = 64
#: Long enough to fill whole KV blocks (128 tokens on the CPU), so prefix caching has blocks to share.
LONG = " ".join(["The quick brown fox jumps over the lazy dog while the cat sleeps in the garden."] * 12)
PROMPTS = ["Once upon a time", "Rome is in Italy, Berlin is in Germany", "def add(a, b):", LONG]
STEPS = 6
#: A chat template for the tiny tokenizer (it has none), which renders a message as its text after BOS: a chat
#: request then runs the same tokens as the completion of that text.
TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def server(path, tmp_path_factory):
    """The module's server: an API key, small limits, a chat template for the tiny tokenizer."""
    with running(path, tmp_path_factory.mktemp("serve") / "server.log", "--max-harvest-bytes",
                 str(2 * 300 * HIDDEN * 4), "--max-steers-per-request", "4", "--max-stored-vectors", "3",
                 "--chat-template", TEMPLATE) as url:
        yield url


@pytest.fixture(scope="module")
def model(path, server):
    engine = streamscope.load(path, engine="vllm")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return streamscope.Client(server, api_key=KEY)


def vector(seed: int) -> torch.Tensor:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


def complete(api, prompt, field=None, **options):
    extra = {"streamscope": field} if field is not None else None
    response = api.completions.create(model=api.models.list().data[0].id, prompt=prompt, max_tokens=STEPS,
                                      temperature=0, logprobs=1, extra_body=extra, **options)
    choice = response.choices[0]
    return response, choice.logprobs.tokens, choice.logprobs.token_logprobs


def steer_json(steer: Steer) -> dict:
    """The request field's form of `steer`, written out here (not by streamscope.Client) to pin the wire format."""
    from streamscope.serve.protocol import rule_json

    return {"value": steer.value, "layer": steer.layer, "vector": steer.vector.tolist(), "scale": steer.scale,
            "positions": rule_json(steer.positions), "mode": steer.mode, "generated": steer.generated,
            "projection": steer.projection, "norm_match": steer.norm_match, "from_step": steer.from_step}


def in_process(model, prompt, steers):
    """Tokens and the log-prob of each from `model.generate` in this process (greedy)."""
    result = model.generate([prompt], max_tokens=STEPS, steer=steers, return_logits=True, progress=False)
    tokens = result.tokens[0]
    logprobs = torch.log_softmax(result.logits[0].float(), dim=-1)
    return tokens, [float(logprobs[step, token]) for step, token in enumerate(tokens)]


def same_run(tokens, logprobs, expected_tokens, expected_logprobs, what):
    """Token for token, log-probs within 1e-5 (up to a near tie of a random checkpoint, where both must agree)."""
    for step, (got, want) in enumerate(zip(logprobs, expected_logprobs)):
        assert abs(got - want) <= TOLERANCE, f"{what}: step {step} log-prob {got} vs {want}"
        if tokens[step] != expected_tokens[step]:
            pytest.fail(f"{what}: step {step} sampled token {tokens[step]} vs {expected_tokens[step]}")


def ids(api, response):
    return response.choices[0].model_extra.get("token_ids")


STEERS = {
    "add-all": [Steer("layer_output", 1, vector(1), scale=4.0)],
    "set-last-prompt-only": [Steer("layer_mid", 0, vector(2), positions="last", mode="set", generated=False)],
    "indices-and-slice": [Steer("mlp_output", 2, vector(3), scale=2.0, positions=[0, -1]),
                          Steer("layer_input", 1, vector(4), positions=slice(1, 3))],
    "root": [Steer("token_embeddings", None, vector(5), scale=0.5)],
    "same-site-twice": [Steer("layer_output", 0, vector(6)), Steer("layer_output", 0, vector(7), mode="set",
                                                                    positions="last")],
    # issue 21's operations, each as model.generate runs it in process
    "ablate-every-block": [Steer("layer_output", layer, vector(9), mode="ablate") for layer in range(3)],
    "ablate-half-last": [Steer("mlp_output", 1, vector(10), mode="ablate", scale=0.5, positions="last")],
    "clamp": [Steer("layer_mid", 1, vector(11), mode="clamp", projection=6.0)],
    "clamp-norm-matched": [Steer("layer_output", 0, vector(12), mode="clamp", projection=-4.0, norm_match=True)],
    "add-norm-matched": [Steer("layer_output", 1, vector(13), scale=8.0, norm_match=True, positions=[0, 1])],
    "set-norm-matched": [Steer("attention_output", 2, vector(14), mode="set", scale=3.0, norm_match=True)],
    "generated-from-step-2": [Steer("layer_output", 1, vector(15), scale=6.0, positions="none", from_step=2)],
    "several-modes-several-blocks": [
        Steer("layer_output", 0, vector(16), scale=3.0, positions="last", from_step=1),
        Steer("layer_output", 0, vector(17), mode="ablate"),
        Steer("layer_mid", 2, vector(18), mode="clamp", projection=2.0, norm_match=True, generated=False),
        Steer("token_embeddings", None, vector(19), mode="set", scale=0.5, positions=[1])],
}


def token_ids_of(model, prompt):
    return list(model.tokenizer(prompt)["input_ids"])


@pytest.mark.parametrize("name", list(STEERS))
def test_steered_completion_equals_in_process_generate(api, model, name):
    steers = STEERS[name]
    for prompt in PROMPTS[:3]:
        response = api.completions.create(model=api.models.list().data[0].id, prompt=prompt, max_tokens=STEPS,
                                          temperature=0, logprobs=1,
                                          extra_body={"streamscope": {"steer": [steer_json(item) for item in steers]},
                                                      "return_token_ids": True})
        tokens, logprobs = ids(api, response), response.choices[0].logprobs.token_logprobs
        expected_tokens, expected = in_process(model, prompt, steers)
        same_run(tokens, logprobs, expected_tokens, expected, f"{name} {prompt!r}")
        plain_tokens, plain = in_process(model, prompt, [])
        changed = tokens != plain_tokens or max(abs(a - b) for a, b in zip(logprobs, plain)) > 1e-3
        assert changed, f"{name}: the steer changed nothing on {prompt!r}"


def test_a_prompt_list_is_steered_prompt_by_prompt(api, server, model):
    """The completions API's prompt list, with one steer for all of them: each choice equals its prompt's
    in-process run. A steer that depends on where a prompt ends, or a harvest, takes one prompt a request."""
    steers = [Steer("layer_output", 1, vector(20), scale=4.0), Steer("layer_mid", 0, vector(21), mode="ablate")]
    response = api.completions.create(model=api.models.list().data[0].id, prompt=PROMPTS, max_tokens=STEPS,
                                      temperature=0, logprobs=1,
                                      extra_body={"streamscope": {"steer": [steer_json(item) for item in steers]},
                                                  "return_token_ids": True})
    assert len(response.choices) == len(PROMPTS)
    for choice in response.choices:
        expected_tokens, expected = in_process(model, PROMPTS[choice.index], steers)
        same_run(choice.model_extra["token_ids"], choice.logprobs.token_logprobs, expected_tokens, expected,
                 f"prompt {choice.index} of a list")
    auth = {"Authorization": f"Bearer {KEY}"}
    plain = complete(api, LONG)
    for field, named in (({"steer": [steer_json(Steer("layer_output", 1, vector(20), positions="last"))]},
                          "its own request"),
                         ({"harvest": {"values": "layer_output"}}, "one prompt per request")):
        body = {"model": api.models.list().data[0].id, "prompt": PROMPTS[:2], "max_tokens": STEPS,
                "streamscope": field}
        refused = httpx.post(server + "/v1/completions", json=body, headers=auth)
        assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text
        assert complete(api, LONG)[2] == plain[2]


def test_client_sends_prompts_that_can_share_a_request_together(server, model):
    client = streamscope.Client(server, api_key=KEY, batch=3)
    sent = []
    complete_one = client._complete

    def recording(prompt, options, field):
        sent.append(prompt)
        return complete_one(prompt, options, field)

    client._complete = recording
    uniform_steer = [Steer("layer_output", 2, vector(22), scale=3.0)]
    remote = client.generate(PROMPTS, max_tokens=STEPS, steer=uniform_steer)
    local = model.generate(PROMPTS, max_tokens=STEPS, steer=uniform_steer, progress=False)
    assert remote.tokens == local.tokens and remote.texts == local.texts
    assert sorted(1 if isinstance(item, str) else len(item) for item in sent) == [1, 3], "four prompts went as one request of 3 and one of 1"
    sent.clear()
    last_only = [Steer("layer_output", 2, vector(22), scale=3.0, positions="last")]
    remote = client.generate(PROMPTS, max_tokens=STEPS, steer=last_only)
    assert remote.tokens == model.generate(PROMPTS, max_tokens=STEPS, steer=last_only, progress=False).tokens
    assert all(isinstance(item, str) for item in sent) and len(sent) == len(PROMPTS), "one request a prompt"


def tiny_sae(activation: str = "relu", k=None, seed: int = 30, width: int = HIDDEN, layer: int = 1):
    """A random SAE on layer_output of block `layer` (weights scaled so that a fair share of features fire)."""
    from streamscope.sae import SAE

    generator, features = torch.Generator().manual_seed(seed), 96
    return SAE(torch.randn(width, features, generator=generator) / width ** 0.5,
               torch.randn(features, generator=generator) * 0.1,
               torch.randn(features, width, generator=generator) / features ** 0.5,
               torch.randn(width, generator=generator) * 0.1, "layer_output", layer, activation, k=k)


def test_saes_over_http_equal_in_process(client, api, model, server):
    """A stored SAE: its features harvested in the server's engine (dense and top k) equal ``model.harvest(...,
    sae=...)``; a feature clamped in the loop and a steer along a feature's direction, sent by the SAE's name,
    equal ``model.generate(steer=[sae.clamp(...)])`` and ``[sae.steer(...)]``. Each bad SAE request is refused,
    naming the field, and the server serves on."""
    from streamscope.serve.storage import sae_bytes

    relu, topk = tiny_sae(), tiny_sae("topk", k=8, seed=31)
    client.store_sae("relu", relu)
    client.store_sae("topk", topk)
    assert [(item["name"], item["d_sae"]) for item in client.saes()] == [("relu", 96), ("topk", 96)]
    for sae in (relu, topk):
        for top_k in (None, 5):
            remote = client.harvest(PROMPTS[:3], sae=sae, positions="all", top_k=top_k)
            local = model.harvest(PROMPTS[:3], sae=sae, positions="all", top_k=top_k, progress=False)
            assert sorted(remote.values) == sorted(local.values) and remote.positions == local.positions
            for name in local.values:
                for got, want in zip(remote[name], local[name]):
                    assert got.shape == want.shape and got.dtype == want.dtype, name
                    if name == "sae_indices":
                        assert torch.equal(got, want)
                    else:
                        assert (got - want).abs().max() <= TOLERANCE * max(1.0, float(want.abs().max())), name
    clamp = [relu.clamp(3, 12.0, positions=[0, -1]), topk.clamp(7, 5.0)]
    remote_run = client.generate(PROMPTS[:3], max_tokens=STEPS, steer=clamp)
    assert remote_run.tokens == model.generate(PROMPTS[:3], max_tokens=STEPS, steer=clamp, progress=False).tokens
    by_name = [{"mode": "sae_clamp", "sae": "relu", "feature": 3, "projection": 12.0},
               {"sae": "topk", "feature": 11, "scale": 6.0, "positions": "last"}]
    in_process_steers = [relu.clamp(3, 12.0), topk.steer(11, scale=6.0, positions="last")]
    for prompt in PROMPTS[:2]:
        response = api.completions.create(model=api.models.list().data[0].id, prompt=prompt, max_tokens=STEPS,
                                          temperature=0, logprobs=1,
                                          extra_body={"streamscope": {"steer": by_name}, "return_token_ids": True})
        expected_tokens, expected = in_process(model, prompt, in_process_steers)
        same_run(ids(api, response), response.choices[0].logprobs.token_logprobs, expected_tokens, expected,
                 f"SAE steers by name on {prompt!r}")
        plain_tokens, plain_logprobs = in_process(model, prompt, [])
        assert ids(api, response) != plain_tokens or max(
            abs(a - b) for a, b in zip(response.choices[0].logprobs.token_logprobs, plain_logprobs)) > 1e-3
    auth = {"Authorization": f"Bearer {KEY}"}
    plain = complete(api, LONG)
    for field, status, named in (
            ({"steer": [{"mode": "sae_clamp", "sae": "nobody", "feature": 1}]}, 404, "streamscope.steer[0].sae"),
            ({"steer": [{"mode": "sae_clamp", "sae": "relu", "feature": 96}]}, 400, "streamscope.steer[0].feature"),
            ({"steer": [{"mode": "sae_clamp", "feature": 1, "value": "layer_output", "layer": 1}]}, 400,
             "streamscope.steer[0].sae"),
            ({"steer": [{"sae": "relu", "feature": 1, "value": "layer_output", "layer": 0}]}, 400,
             "its SAE's own site"),
            ({"steer": [{"sae": "relu", "feature": 1, "vector": [0.0] * HIDDEN}]}, 400, "streamscope.steer[0].vector"),
            ({"harvest": {"sae": "relu", "top_k": 0}}, 400, "streamscope.harvest.top_k"),
            ({"harvest": {"sae": "relu", "values": "layer_output"}}, 400, "leave values and layers out"),
            ({"harvest": {"top_k": 3}}, 400, "streamscope.harvest.top_k")):
        body = {"model": api.models.list().data[0].id, "prompt": LONG, "max_tokens": STEPS, "streamscope": field}
        refused = httpx.post(server + "/v1/completions", json=body, headers=auth)
        assert refused.status_code == status and named in refused.json()["error"]["message"], (field, refused.text)
        assert complete(api, LONG)[2] == plain[2]
    for data, kind, named in ((sae_bytes(tiny_sae(width=32)), "application/octet-stream", "32 wide"),
                              (sae_bytes(tiny_sae(layer=7)), "application/octet-stream", "block 7"),
                              (pickle.dumps(relu), "application/octet-stream", "never pickles"),
                              (sae_bytes(relu), "application/json", "Content-Type")):
        refused = httpx.put(server + "/v1/streamscope/saes/bad", content=data, headers={**auth, "Content-Type": kind})
        assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text
    client.delete_sae("topk")
    gone = httpx.post(server + "/v1/completions", headers=auth, json={
        "model": api.models.list().data[0].id, "prompt": LONG, "max_tokens": 2,
        "streamscope": {"harvest": {"sae": "topk"}}})
    assert gone.status_code == 404 and "no stored SAE" in gone.json()["error"]["message"]
    client.delete_sae("relu")
    assert client.saes() == [] and complete(api, LONG)[2] == plain[2]


def test_unsteered_completion_equals_plain_vllm(api, model, client):
    """The untapped server runs vLLM's own worker and runner (no nnsight controller on any module), and an
    unsteered request equals plain vLLM's."""
    from vllm import SamplingParams

    assert client.info()["worker"] == "vllm.v1.worker.cpu_worker.CPUWorker"  # vLLM's own, with streamscope's extension
    assert client.info()["graph_mode"] == "NONE"  # an eager engine

    for prompt in PROMPTS:
        response = api.completions.create(model=api.models.list().data[0].id, prompt=prompt, max_tokens=STEPS,
                                          temperature=0, logprobs=1, extra_body={"return_token_ids": True})
        plain = model.vllm_entrypoint.generate([prompt], SamplingParams(max_tokens=STEPS, temperature=0, logprobs=1),
                                               use_tqdm=False)[0].outputs[0]
        expected = [entry[token].logprob for entry, token in zip(plain.logprobs, plain.token_ids)]
        same_run(ids(api, response), response.choices[0].logprobs.token_logprobs, list(plain.token_ids), expected,
                 f"plain {prompt[:20]!r}")


def test_client_generate_returns_the_engines_generation(client, model):
    steers = [Steer("layer_output", 1, vector(8), scale=3.0, prompts=[0, 2])]
    remote = client.generate(PROMPTS[:3], max_tokens=STEPS, steer=steers,
                             harvest={"values": ["layer_output", "final_norm_output"], "layers": [0, 2]})
    local = model.generate(PROMPTS[:3], max_tokens=STEPS, steer=steers,
                           harvest={"values": ["layer_output", "final_norm_output"], "layers": [0, 2]}, progress=False)
    assert type(remote) is type(local) and type(remote.harvest) is type(local.harvest)
    assert remote.tokens == local.tokens and remote.texts == local.texts
    assert remote.harvest.layers == local.harvest.layers and remote.harvest.positions == local.harvest.positions
    for value in ("layer_output", "final_norm_output"):
        for got, want in zip(remote.harvest[value], local.harvest[value]):
            assert got.shape == want.shape and (got - want).abs().max() <= TOLERANCE * want.abs().max()


@pytest.mark.parametrize("positions", ["last", "all", [0, -2], slice(1, None, 2)])
def test_harvest_over_http_equals_in_process_bit_for_bit(server, model, positions):
    client = streamscope.Client(server, api_key=KEY, concurrency=1)  # one prompt a step, as model.harvest below
    values = ["layer_output", "layer_mid", "mlp_output", "token_embeddings"]
    for prompt in PROMPTS[:3]:
        remote = client.harvest([prompt], values, layers=[0, 2], positions=positions)
        local = model.harvest([prompt], values, layers=[0, 2], positions=positions, progress=False)
        assert remote.layers == local.layers and remote.positions == local.positions
        for value in values:
            assert torch.equal(remote[value][0], local[value][0]), f"{value} at {positions} of {prompt!r}"


def test_harvests_are_written_by_the_writers_process_not_in_the_engines(server, client):
    """The rows' storing and the files are the harvest writer's process's (`streamscope.serve.writer`), a child of
    the engine's, so that Python work never holds the engine's interpreter lock (the harvests above came from it)."""
    import psutil

    client.harvest([PROMPTS[0]], ["layer_output"], layers=[0])
    port = server.rsplit(":", 1)[1]
    writers = [process for process in psutil.process_iter(["cmdline"])
               if any(part.endswith("streamscope/serve/writer.py") for part in process.info["cmdline"] or ())]
    ours = [(process, front) for process in writers for front in process.parents()
            if "--port" in front.cmdline() and port in front.cmdline()]
    assert len(ours) == 1, f"writer processes {[process.info['cmdline'] for process in writers]}"
    writer, front = ours[0]
    assert writer.parent().pid != front.pid  # the engine's process started it, not the server's front end


def test_harvest_to_shards(client, model, tmp_path):
    folder = client.harvest(PROMPTS[:3], "layer_output", layers=[1], positions="all", out=tmp_path / "h",
                            shard_size=2)
    loaded = streamscope.load_harvest(folder)
    local = model.harvest(PROMPTS[:3], "layer_output", layers=[1], positions="all", progress=False)
    assert loaded.positions == local.positions
    for got, want in zip(loaded["layer_output"], local["layer_output"]):
        assert (got - want).abs().max() <= TOLERANCE * want.abs().max()


def test_32_concurrent_mixed_requests_each_equal_their_solo_run(api):
    name = api.models.list().data[0].id
    requests = []
    for index in range(32):
        prompt = PROMPTS[index % len(PROMPTS)]
        kind = index % 4
        field = None
        if kind == 1:
            field = {"steer": [steer_json(Steer("layer_output", index % 3, vector(100 + index), scale=3.0))]}
        elif kind == 2:
            field = {"harvest": {"values": ["layer_output"], "layers": [index % 3], "positions": [0, -1]}}
        elif kind == 3:
            field = {"steer": [steer_json(Steer("mlp_output", 1, vector(200 + index), positions="last"))],
                     "harvest": {"values": ["layer_mid"], "layers": [2], "positions": "last"}}
        requests.append((prompt, field))

    def run(request):
        prompt, field = request
        extra = {"return_token_ids": True, **({"streamscope": field} if field else {})}
        response = api.completions.create(model=name, prompt=prompt, max_tokens=STEPS, temperature=0, logprobs=1,
                                          extra_body=extra)
        harvest = None
        if field and "harvest" in field:
            harvest_id = response.model_extra["streamscope"]["harvest"]
            from streamscope.serve.storage import harvest_tensors

            data = httpx.get(f"{api.base_url}streamscope/harvests/{harvest_id}",
                             headers={"Authorization": f"Bearer {KEY}"}).content
            harvest = harvest_tensors(data)[0]
        return ids(api, response), response.choices[0].logprobs.token_logprobs, harvest

    solo = [run(request) for request in requests]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(run, requests))
    for index, ((tokens, logprobs, harvest), (solo_tokens, solo_logprobs, solo_harvest)) in \
            enumerate(zip(together, solo)):
        same_run(tokens, logprobs, solo_tokens, solo_logprobs, f"request {index}")
        if solo_harvest is not None:
            for value, tensor in solo_harvest.items():
                assert (harvest[value] - tensor).abs().max() <= TOLERANCE * tensor.abs().max(), f"request {index}"


def test_requests_steered_by_one_stored_vector_share_it_and_each_equals_its_solo_run(api, client, model):
    """Concurrent requests steered by one stored vector at two scales, some at every position and some at the last,
    between plain ones: the worker keeps one tensor per (vector, scale) for all of them, and each request's run
    equals its solo run, and the in-process engine's."""
    shared = vector(40)
    client.store_vector("shared", shared)
    try:
        fields = []
        for index in range(16):
            kind = index % 4
            scale = 2.0 if kind in (1, 3) else -3.0
            fields.append(None if kind == 0 else
                          {"steer": [{"value": "layer_output", "layer": 1, "vector": "shared", "scale": scale,
                                      **({"positions": "last"} if kind == 3 else {})}]})

        def run(index):
            extra = {"return_token_ids": True, **({"streamscope": fields[index]} if fields[index] else {})}
            response = api.completions.create(model=api.models.list().data[0].id, prompt=PROMPTS[index % len(PROMPTS)],
                                              max_tokens=STEPS, temperature=0, logprobs=1, extra_body=extra)
            return ids(api, response), response.choices[0].logprobs.token_logprobs

        solo = [run(index) for index in range(16)]
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(run, range(16)))
        for index, ((tokens, logprobs), (solo_tokens, solo_logprobs)) in enumerate(zip(together, solo)):
            same_run(tokens, logprobs, solo_tokens, solo_logprobs, f"request {index}")
        for index, scale in ((1, 2.0), (2, -3.0)):  # the two scales of one vector, each its own
            expected_tokens, expected_logprobs = in_process(model, PROMPTS[index % len(PROMPTS)],
                                                            [Steer("layer_output", 1, shared, scale=scale)])
            same_run(*solo[index], expected_tokens, expected_logprobs, f"request {index} against the in-process engine")
    finally:
        client.delete_vector("shared")


def test_requests_all_steered_alike_are_edited_as_one_and_each_equals_its_solo_run(api, client, model):
    """Concurrent requests that all make the same two steers (a stored vector added at every position, and another
    set at every position of a later block), with no plain request among them: the worker edits each step's rows
    as one block per steer (`ServeState.uniform_step`), and each request's run equals its solo run and the
    in-process engine's."""
    added, setting = vector(41), vector(42) * 0.5
    client.store_vector("alike-add", added)
    client.store_vector("alike-set", setting)
    field = {"steer": [{"value": "layer_output", "layer": 0, "vector": "alike-add", "scale": 2.5},
                       {"value": "layer_mid", "layer": 2, "vector": "alike-set", "mode": "set"}]}
    steers = [Steer("layer_output", 0, added, scale=2.5), Steer("layer_mid", 2, setting, mode="set")]
    try:
        def run(index):
            response = api.completions.create(model=api.models.list().data[0].id, prompt=PROMPTS[index % len(PROMPTS)],
                                              max_tokens=STEPS, temperature=0, logprobs=1,
                                              extra_body={"return_token_ids": True, "streamscope": field})
            return ids(api, response), response.choices[0].logprobs.token_logprobs

        solo = [run(index) for index in range(len(PROMPTS))]
        with ThreadPoolExecutor(12) as pool:
            together = list(pool.map(run, range(12)))
        for index, (tokens, logprobs) in enumerate(together):
            same_run(tokens, logprobs, *solo[index % len(PROMPTS)], f"request {index}")
        for index, prompt in enumerate(PROMPTS):
            same_run(*solo[index], *in_process(model, prompt, steers), f"{prompt!r} against the in-process engine")
    finally:
        client.delete_vector("alike-add")
        client.delete_vector("alike-set")


def _prefix_hits(server) -> float:
    response = httpx.get(server + "/metrics")
    assert response.status_code == 200, f"vLLM's /metrics broke: {response.text[:300]}"
    text = response.text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits") and not line.startswith("#"))


def _hits_after(url: str, before: float, wait: float = 15.0) -> float:
    """vLLM's prefix-cache hits once they pass `before` (its metrics are published a moment after a reply), or as
    they stand after `wait` seconds."""
    deadline = time.monotonic() + wait
    while _prefix_hits(url) <= before and time.monotonic() < deadline:
        time.sleep(0.5)
    return _prefix_hits(url)


def test_prefix_caching_stays_correct_both_ways(api, server, model):
    """With prefix caching on: a steer never reuses plain blocks, a plain request never reuses steered ones,
    and a harvest after a cached run of its prompt still reads every position."""
    steers = [Steer("layer_output", 1, vector(9), scale=4.0)]
    field = {"steer": [steer_json(item) for item in steers]}
    plain_before = complete(api, LONG)
    hits = _prefix_hits(server)
    assert complete(api, LONG)[2] == plain_before[2]
    cached = _hits_after(server, hits) > hits
    expected_tokens, expected = in_process(model, LONG, steers)
    for _ in range(2):  # after the plain run, then after its own cached run
        response = api.completions.create(model=api.models.list().data[0].id, prompt=LONG, max_tokens=STEPS,
                                          temperature=0, logprobs=1,
                                          extra_body={"streamscope": field, "return_token_ids": True})
        same_run(ids(api, response), response.choices[0].logprobs.token_logprobs, expected_tokens, expected,
                 "steered after cached runs")
    assert complete(api, LONG)[2] == plain_before[2], "a plain request reused steered blocks"
    client = streamscope.Client(server, api_key=KEY)
    remote = client.harvest([LONG], "layer_output", layers=[0, 2], positions="all")
    local = model.harvest([LONG], "layer_output", layers=[0, 2], positions="all", progress=False)
    assert remote.positions == local.positions
    assert (remote["layer_output"][0] - local["layer_output"][0]).abs().max() \
        <= TOLERANCE * local["layer_output"][0].abs().max()
    # without a hit the checks above prove nothing: the server runs with prefix caching on, vLLM's serving default
    assert cached, "vLLM's /metrics reported no prefix-cache hit for a repeated 300-token prompt"


def test_a_last_position_harvest_reads_the_prefix_cache_where_the_server_allows_it(path, model, tmp_path):
    """``--harvest-prefix-cache``: a harvest of the last position, after a plain run of its prompt, reads the
    prompt's prefix from vLLM's cache (the server's prefix-cache hits rise) and equals the in-process harvest within
    the CPU tolerance (the last token runs over cached keys and values, not the whole prompt in one batch); a
    harvest of every position on the same server still runs its whole prompt (no hit) and equals it too."""
    values = ["layer_output", "layer_mid"]
    with running(path, tmp_path / "server.log", "--harvest-prefix-cache") as url:
        api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        client = streamscope.Client(url, api_key=KEY)
        complete(api, LONG)  # the prompt's blocks, cached by a plain request
        hits = _hits_after(url, -1.0, wait=2.0)
        remote = client.harvest([LONG], values, layers=None, positions="last")
        after = _hits_after(url, hits)
        assert after > hits, "the last-position harvest ran its whole prompt: no prefix-cache hit"
        local = model.harvest([LONG], values, layers=None, positions="last", progress=False)
        assert remote.positions == local.positions
        for name in values:
            error = (remote[name][0] - local[name][0]).abs().max()
            assert error <= TOLERANCE * local[name][0].abs().max(), (name, float(error))
        every = client.harvest([LONG], "layer_output", layers=[0, 2], positions="all")
        assert _hits_after(url, after, wait=3.0) == after, "a harvest of every position read the cache"
        expected = model.harvest([LONG], "layer_output", layers=[0, 2], positions="all", progress=False)
        assert (every["layer_output"][0] - expected["layer_output"][0]).abs().max() \
            <= TOLERANCE * expected["layer_output"][0].abs().max()


def test_stored_vectors_and_the_default_steer(client, api, model, server):
    auth = {"Authorization": f"Bearer {KEY}"}
    v = vector(10)
    client.store_vector("happy", v)
    from safetensors.torch import save

    httpx.put(server + "/v1/streamscope/vectors/json-one", json={"vector": vector(11).tolist()}, headers=auth)
    assert {item["name"] for item in client.vectors()} == {"happy", "json-one"}
    by_name = complete(api, PROMPTS[0], {"steer": [{"value": "layer_output", "layer": 1, "vector": "happy",
                                                    "scale": 4.0}]})
    inline = complete(api, PROMPTS[0], {"steer": [steer_json(Steer("layer_output", 1, v, scale=4.0))]})
    assert by_name[2] == inline[2]
    response = httpx.put(server + "/v1/streamscope/vectors/st", content=save({"vector": v}),
                         headers={**auth, "Content-Type": "application/octet-stream"})
    assert response.status_code == 200
    client.delete_vector("st")
    client.delete_vector("json-one")
    # The default steer: every request steered, unless it opts out.
    plain = complete(api, PROMPTS[0])
    response = httpx.put(server + "/v1/streamscope/default-steer", headers=auth,
                         json={"steer": [{"value": "layer_output", "layer": 1, "vector": "happy", "scale": 4.0}]})
    assert response.status_code == 200
    try:
        defaulted = complete(api, PROMPTS[0])
        assert defaulted[2] == inline[2]
        assert complete(api, PROMPTS[0], {"default_steer": False})[2] == plain[2]
    finally:
        httpx.delete(server + "/v1/streamscope/default-steer", headers=auth)
    assert complete(api, PROMPTS[0])[2] == plain[2]
    client.delete_vector("happy")


def test_harvest_downloads_once_unless_kept(api, server):
    auth = {"Authorization": f"Bearer {KEY}"}
    response, _, _ = complete(api, PROMPTS[1], {"harvest": {"values": "layer_output", "layers": 0, "keep": True}})
    harvest_id = response.model_extra["streamscope"]["harvest"]
    url = f"{server}/v1/streamscope/harvests/{harvest_id}"
    first = httpx.get(url, params={"keep": "true"}, headers=auth)
    assert first.status_code == 200
    assert httpx.get(url, headers=auth).content == first.content
    gone = httpx.get(url, headers=auth)
    assert gone.status_code == 404 and "downloaded already" in gone.json()["error"]["message"]


def test_the_api_key_guards_the_new_routes(server):
    for method, route in (("GET", "info"), ("GET", "vectors"), ("GET", "harvests/x"), ("PUT", "default-steer")):
        assert httpx.request(method, f"{server}/v1/streamscope/{route}").status_code == 401
    assert httpx.get(f"{server}/v1/streamscope/info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_request_schema_is_served_from_its_declaration(server):
    """``GET /v1/streamscope/schema``: the JSON schema of the ``streamscope`` field, from `streamscope.bulk.schema`
    (the declaration the server checks requests against), behind the API key as every route."""
    from streamscope.bulk.operations import MODES
    from streamscope.bulk.schema import request_schema

    served = httpx.get(f"{server}/v1/streamscope/schema", headers={"Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200 and served.json() == request_schema()
    assert served.json()["$defs"]["SteerJSON"]["properties"]["mode"]["enum"] == list(MODES)
    assert httpx.get(f"{server}/v1/streamscope/schema").status_code == 401


BAD = [
    # (streamscope field, status, what the message must name)
    ({"steer": [{"value": "layer_outptu", "layer": 1, "vector": [0.0] * HIDDEN}]}, 400, "streamscope.steer[0].value"),
    ({"steer": [{"value": "layer_output", "layer": 7, "vector": [0.0] * HIDDEN}]}, 400, "out of range"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [0.0] * 3}]}, 400, "hidden size is 64"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [float("nan")] * HIDDEN}]}, 400, "NaN or inf"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": "nobody"}]}, 404, "no stored vector"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [0.0] * HIDDEN, "positions": [999]}]}, 400,
     "out of range for prompt"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [0.0] * HIDDEN, "positions": "first"}]}, 400,
     "not a positions rule"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [0.0] * HIDDEN, "mode": "multiply"}]}, 400,
     "mode"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [0.0] * HIDDEN, "prompts": [0]}]}, 400, "'prompts'"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [0.0] * HIDDEN}] * 5}, 413,
     "--max-steers-per-request"),
    ({"harvest": {"values": "layer_output", "layers": None, "positions": "all"}}, 413, "--max-harvest-bytes"),
    ({"harvest": {"values": "layer_output", "layers": [9]}}, 400, "streamscope.harvest.layers"),
    ({"harvest": {"values": ["mlp.neurons_x"]}}, 400, "streamscope.harvest.values"),
    ({"harvest": {"values": ["self_attn.head_results"]}}, 400, "is not served by the server"),
    ({"steer": [{"value": "self_attn.head_results", "layer": 1, "vector": [0.0] * HIDDEN}]}, 400,
     "streamscope.steer[0].value"),
    ({"harvest": {"values": "layer_output", "code": "import os"}}, 400, "unknown field"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [0.0] * HIDDEN, "scale": 1e39}]}, 400, "scale"),
    ("__import__('os')", 400, "expected a JSON object"),
    # issue 21's fields
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [1.0] * HIDDEN, "mode": "clamp", "projection": "x"}]},
     400, "streamscope.steer[0].projection"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [1.0] * HIDDEN, "norm_match": "yes"}]}, 400,
     "streamscope.steer[0].norm_match"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [1.0] * HIDDEN, "from_step": -1}]}, 400,
     "streamscope.steer[0].from_step"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [0.0] * HIDDEN, "mode": "ablate"}]}, 400,
     "non-zero vector"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [1.0] * HIDDEN, "origin": {"hidden_size": 4096}}]},
     400, "streamscope.steer[0].origin"),
    ({"steer": [{"value": "layer_output", "layer": 1, "vector": [1.0] * HIDDEN, "origin": "llama"}]}, 400,
     "streamscope.steer[0].origin"),
    ({"harvest": {"values": "layer_output", "positions": "none"}}, 400, "streamscope.harvest.positions"),
]


def test_every_bad_request_is_refused_and_the_server_serves_on(api, server):
    plain = complete(api, LONG)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for field, status, named in BAD:
        # Sent as raw JSON: the openai client refuses to encode NaN, which a careless client may well send.
        body = {"model": api.models.list().data[0].id, "prompt": LONG, "max_tokens": STEPS, "streamscope": field}
        refused = httpx.post(server + "/v1/completions", content=json.dumps(body), headers=auth)
        assert "error" in refused.json(), f"{field} was served: {refused.text[:200]}"
        message = refused.json()["error"]["message"]
        assert refused.status_code == status, (field, message)
        assert named in message, (named, message)
        assert complete(api, LONG)[2] == plain[2], f"the server answered differently after refusing {field}"
    # The worker's own key cannot be sent past the check: a forged plan (here, a harvest written outside the folder).
    forged = {"model": api.models.list().data[0].id, "prompt": "Hello", "max_tokens": 2,
              "vllm_xargs": {"streamscope": json.dumps({"steer": [], "harvest": {
                  "id": "../../escape", "values": ["layer_output"], "layers": [0], "positions": "last"}})}}
    refused_forgery = httpx.post(server + "/v1/completions", json=forged, headers=auth)
    assert refused_forgery.status_code == 400 and "vllm_xargs" in refused_forgery.json()["error"]["message"]
    assert complete(api, LONG)[2] == plain[2]
    auth = {"Authorization": f"Bearer {KEY}"}
    # Pickles are never read: not as a vector, not as a request body.
    payload = pickle.dumps({"vector": torch.zeros(HIDDEN)})
    refused_upload = httpx.put(server + "/v1/streamscope/vectors/evil", content=payload,
                               headers={**auth, "Content-Type": "application/octet-stream"})
    assert refused_upload.status_code == 400 and "never pickles" in refused_upload.json()["error"]["message"]
    refused_body = httpx.post(server + "/v1/completions", content=payload,
                              headers={**auth, "Content-Type": "application/json"})
    assert refused_body.status_code == 400
    for content, kind, status, named in (
            (json.dumps({"vector": [1.0] * 3}), "application/json", 400, "hidden size"),
            (b"x", "text/plain", 400, "Content-Type"),
            (json.dumps({"vector": [1.0] * HIDDEN}), "application/json", 400, "name")):
        name = "bad name!" if named == "name" else "v"
        response = httpx.put(f"{server}/v1/streamscope/vectors/{name}", content=content,
                             headers={**auth, "Content-Type": kind})
        assert response.status_code == status and named in response.json()["error"]["message"], response.text
    for index in range(3):
        httpx.put(f"{server}/v1/streamscope/vectors/full{index}", json={"vector": [1.0] * HIDDEN}, headers=auth)
    over = httpx.put(f"{server}/v1/streamscope/vectors/one-more", json={"vector": [1.0] * HIDDEN}, headers=auth)
    assert over.status_code == 413 and "--max-stored-vectors" in over.json()["error"]["message"]
    for index in range(3):
        httpx.delete(f"{server}/v1/streamscope/vectors/full{index}", headers=auth)
    missing = httpx.get(f"{server}/v1/streamscope/harvests/0123", headers=auth)
    assert missing.status_code == 404 and "no harvest" in missing.json()["error"]["message"]
    assert complete(api, LONG)[2] == plain[2]


def test_a_tapped_server_serves_its_taps_and_refuses_the_rest(path, model, tmp_path):
    """``--taps``: the engine starts with only those values served (on this CPU it runs eagerly, as a tapped
    in-process engine does); a steer at a tap equals the in-process steer, and any other value gets 400 naming the
    tap to add. The same server starts with ``--vectors`` and ``--default-steer``. Started after the module's
    server has answered, for this test alone."""
    from safetensors.torch import save_file

    (tmp_path / "vectors").mkdir()
    save_file({"vector": vector(14)}, str(tmp_path / "vectors" / "happy.safetensors"))
    (tmp_path / "default.json").write_text(json.dumps([{"value": "layer_output", "layer": 2, "vector": "happy",
                                                        "scale": 2.0}]))
    with running(path, tmp_path / "tapped.log", "--taps", "layers.*.layer_output", "--vectors",
                 str(tmp_path / "vectors"), "--default-steer", str(tmp_path / "default.json")) as url:
        api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        info = streamscope.Client(url, api_key=KEY).info()
        assert info["taps"] == ["layers.*.layer_output"] and info["vectors"] == ["happy"] and info["default_steer"]
        assert info["worker"] == "streamscope.vllm.worker.NNsightCPUWorker"  # nnsight's runner, for the taps
        assert info["graph_mode"] == "NONE"  # the worker's answer: a CPU engine records no CUDA graphs
        # Started with --default-steer: a request without the field is steered by it.
        response = api.completions.create(model=api.models.list().data[0].id, prompt=PROMPTS[1], max_tokens=STEPS,
                                          temperature=0, logprobs=1, extra_body={"return_token_ids": True})
        expected_tokens, expected = in_process(model, PROMPTS[1], [Steer("layer_output", 2, vector(14), scale=2.0)])
        same_run(ids(api, response), response.choices[0].logprobs.token_logprobs, expected_tokens, expected,
                 "the default steer")
        steers = [Steer("layer_output", 1, vector(13), scale=4.0)]
        field = {"steer": [steer_json(item) for item in steers], "default_steer": False}
        response = api.completions.create(model=api.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=STEPS,
                                          temperature=0, logprobs=1,
                                          extra_body={"streamscope": field, "return_token_ids": True})
        expected_tokens, expected = in_process(model, PROMPTS[0], steers)
        same_run(ids(api, response), response.choices[0].logprobs.token_logprobs, expected_tokens, expected,
                 "tapped server")
        with pytest.raises(openai.BadRequestError, match=r"--taps \.\.\. layers\.1\.layer_mid"):
            complete(api, PROMPTS[0], {"steer": [steer_json(Steer("layer_mid", 1, vector(13)))]})
        with pytest.raises(openai.BadRequestError, match=r"layers\.0\.mlp\.mlp_output"):
            complete(api, PROMPTS[0], {"harvest": {"values": "mlp_output", "layers": [0]}})


def test_the_readme_serving_blocks_run_against_the_server(server):
    """Every Python block of the README and the docs marked `<!-- readme-test: server -->` (tests/doc_blocks.py),
    run with `url` and `api_key` naming this server: the README's Client and docs/tutorials/serving.md's four."""
    from doc_blocks import server_blocks

    blocks = server_blocks()
    assert [block.page.name for block in blocks] == ["README.md"] + ["serving.md"] * 4, [b.name for b in blocks]
    for block in blocks:
        exec(compile(block.code, block.name, "exec"), {"url": server, "api_key": KEY})


def test_harvests_expire_and_the_total_is_bounded(tmp_path):
    """The harvest ledger alone (the server's, in this process): a harvest past --harvest-ttl is gone (404), and
    one that would pass --max-stored-harvest-bytes is refused with 413 until earlier ones are downloaded."""
    import asyncio

    from streamscope.serve.protocol import Limits, RequestError
    from streamscope.serve.storage import Harvests

    harvests = Harvests(tmp_path, Limits(max_stored_harvest_bytes=1000, harvest_ttl=0.2))
    first = harvests.reserve(600)
    with pytest.raises(RequestError, match="--max-stored-harvest-bytes") as refused:
        harvests.reserve(600)
    assert refused.value.status == 413
    harvests.path(first).write_bytes(b"written by the worker")
    assert asyncio.run(harvests.take(first, keep=False)) == b"written by the worker"
    assert not harvests.path(first).exists()
    late = harvests.reserve(600)  # the download freed its bytes
    harvests.path(late).write_bytes(b"never fetched")
    time.sleep(0.3)
    with pytest.raises(RequestError, match="expired") as gone:
        asyncio.run(harvests.take(late, keep=False))
    assert gone.value.status == 404 and not harvests.path(late).exists()



def test_chat_completions_are_steered_and_harvested_alike(api, server):
    name = api.models.list().data[0].id
    steer = [steer_json(Steer("layer_output", 1, vector(12), scale=4.0, positions="last"))]
    field = {"steer": steer, "harvest": {"values": "layer_mid", "layers": [1], "positions": "all"}}
    chat = api.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=STEPS,
                                       temperature=0, logprobs=True,
                                       extra_body={"streamscope": field})
    completion, _, logprobs = complete(api, PROMPTS[1], field)
    assert [item.logprob for item in chat.choices[0].logprobs.content] == pytest.approx(logprobs, abs=TOLERANCE)
    client = streamscope.Client(server, api_key=KEY)
    from_chat = client.download(chat.model_extra["streamscope"]["harvest"])
    from_completion = client.download(completion.model_extra["streamscope"]["harvest"])
    assert from_chat["positions"] == from_completion["positions"]
    assert (from_chat["tensors"]["layer_mid"] - from_completion["tensors"]["layer_mid"]).abs().max() <= \
        TOLERANCE * from_completion["tensors"]["layer_mid"].abs().max()


def test_a_streamed_completion_names_its_harvest_in_a_header(api, server):
    body = {"model": api.models.list().data[0].id, "prompt": PROMPTS[2], "max_tokens": STEPS, "temperature": 0,
            "stream": True, "streamscope": {"harvest": {"values": "layer_output", "layers": [0], "positions": "all"}}}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=auth) as response:
        assert response.status_code == 200
        harvest_id = response.headers["x-streamscope-harvest"]
        text = "".join(response.iter_text())
    assert "[DONE]" in text
    downloaded = streamscope.Client(server, api_key=KEY).download(harvest_id)
    assert downloaded["tensors"]["layer_output"].shape[1] == len(downloaded["positions"]) > 1
