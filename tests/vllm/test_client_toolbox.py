"""The toolbox over HTTP: a `streamscope.Client` is a model for the lens, the cache, directions, SAE features, the
plots and the views, each equal to the in-process vLLM engine on the same checkpoint, which is itself held to
transformers' float32 forward (the oracle: `test_workflows.py`, `test_families.py`); the lens here also to the
oracle directly.

One server per family for the module (`serve_process.running`): Llama (a pre-norm RMS model), Gemma 2 (a
sandwich-normed block, its final norm's ``1 + w`` weight, a final logit soft cap) and GPT-J (a parallel block, a
layer norm with a bias, a head with a bias): the head route must apply each engine's own. Each family's server is stopped before the next starts. The wire format is also spoken without
streamscope's client: the ``openai`` client's harvest and the head route over plain HTTP make the same lens.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

import attention_oracle
import oracle
import precision
from access import relative_error
from serve_process import KEY, running
import streamscope
from streamscope.errors import Unavailable
from streamscope.vllm.model import beside_engine

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="a server subprocess would ask for vLLM's default 90% of "
                                "the GPU beside the GPU suite's in-process engines; the toolbox's calls are the same "
                                "Python on both builds, and a GPU server is measured by benchmarks/serve_load.py and "
                                "benchmarks/patch_sweep.py")

#: CPU float32: the server's engine and the in-process one run the same kernels; a harvest (the bulk path) and a
#: trace read the same tensors. What differs is float rounding, the suite's figure.
TOLERANCE = precision.CPU_FLOAT32
PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
POSITIVE = ["I love this, it is wonderful", "What a great and happy day", "This is excellent news for us",
            "She smiled, delighted and glad", "A joyful, lovely afternoon", "We are thrilled and grateful"]
NEGATIVE = ["I hate this, it is awful", "What a terrible and sad day", "This is dreadful news for us",
            "She frowned, upset and angry", "A miserable, gloomy afternoon", "We are furious and bitter"]
FAMILIES = ["llama", "gemma2", "gptj"]
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
#: A second stream each lens reads: between the sublayers, or entering the block where a parallel one has none.
SECOND = {"gptj": "layer_input"}


class Setup:
    """A family's server, its Client and openai client, and the in-process engine and oracle of the checkpoint."""

    def __init__(self, family: str, path, url: str) -> None:
        self.family, self.path, self.url = family, path, url
        self.client = streamscope.Client(url, api_key=KEY)
        self.api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        self.model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
        with beside_engine():
            self.reference = AutoModelForCausalLM.from_pretrained(
                path, **attention_oracle.load_kwargs(family, attention_oracle.exact_implementation(family))).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, checkpoints, tmp_path_factory):
    path = checkpoints(request.param)
    # A server that lets a request run past the dose limit (warn), so both clamp and warn reach a client; a chat
    # template for the tiny tokenizers' chat requests.
    with running(path, tmp_path_factory.mktemp("serve") / "server.log", "--steer-dose-action", "warn",
                 "--chat-template", CHAT_TEMPLATE) as url:
        found = Setup(request.param, path, url)
        yield found
        found.model.close()


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert relative_error(got, want) <= TOLERANCE, (what, relative_error(got, want))


# ---------------------------------------------------------------- the lens


def test_the_lens_over_http_equals_in_process_and_the_oracle(setup):
    client, model = setup.client, setup.model
    assert client.engine.runs_traces is False and len(client.layers) == model.num_layers
    remote = streamscope.lens(client, PROMPTS[0], keep_logits=True)
    local = streamscope.lens(model, PROMPTS[0], keep_logits=True)
    assert remote.tokens == local.tokens and remote.layers == local.layers
    close(remote.logits, local.logits, "lens logits")
    # The oracle: transformers' blocks' outputs through its own final norm, head and soft cap.
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    expected = oracle.values(setup.reference, setup.family, ids)
    norm = oracle.site(setup.reference, setup.family, "final_norm_output")[0]
    cap = getattr(setup.reference.config, "final_logit_softcapping", None)
    for block in range(model.num_layers):
        with torch.no_grad():
            logits = setup.reference.get_output_embeddings()(norm(expected["layer_output"][block]))[0]
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        assert relative_error(remote.logits[block], logits) <= TOLERANCE, block
    # Top k computed in the server's worker (only k per row travel), several prompts, chosen blocks and a value.
    second = SECOND.get(setup.family, "layer_mid")
    remote_top = streamscope.lens(client, PROMPTS, top_k=4, layers=[0, -1], value=second)
    local_top = streamscope.lens(model, PROMPTS, top_k=4, layers=[0, -1], value=second)
    for got, want in zip(remote_top, local_top):
        assert got.logits is None and got.layers == want.layers == [0, model.num_layers - 1]
        assert torch.equal(got.top_ids, want.top_ids)
        close(got.top_probs, want.top_probs, "top probabilities")
        assert got.table() == want.table()


def test_the_lens_from_the_openai_client_and_plain_http_equals_in_process(setup):
    """The wire format without streamscope's client: a harvest through the openai client, its download and the
    head route over plain HTTP."""
    from streamscope.serve.head import pack, unpack
    from streamscope.serve.storage import harvest_tensors

    layers = list(range(setup.model.num_layers))
    response = setup.api.completions.create(
        model=setup.api.models.list().data[0].id, prompt=PROMPTS[1], max_tokens=1, temperature=0,
        extra_body={"streamscope": {"harvest": {"values": ["layer_output"], "layers": layers, "positions": "all"}}})
    auth = {"Authorization": f"Bearer {KEY}"}
    harvest_id = response.model_extra["streamscope"]["harvest"]
    downloaded = httpx.get(f"{setup.url}/v1/streamscope/harvests/{harvest_id}", headers=auth, timeout=60)
    rows = harvest_tensors(downloaded.content)[0]["layer_output"]  # [blocks, seq, hidden]
    answer = httpx.post(f"{setup.url}/v1/streamscope/head", params={"top_k": 3}, headers=auth, timeout=60,
                        content=pack({"rows": rows.reshape(-1, rows.shape[-1])}))
    assert answer.status_code == 200, answer.text
    top = unpack(answer.content)[0]
    local = streamscope.lens(setup.model, PROMPTS[1], top_k=3)
    assert torch.equal(top["ids"].reshape(local.top_ids.shape), local.top_ids)
    close(top["probs"].reshape(local.top_probs.shape), local.top_probs, "top probabilities over plain HTTP")


def test_bad_head_requests_are_refused_and_the_server_serves_on(setup):
    from streamscope.serve.head import pack

    auth = {"Authorization": f"Bearer {KEY}"}
    hidden, vocab = setup.client.hidden_size, setup.client.vocab_size
    for params, content, named in (
            ({"top_k": 0}, pack({"rows": torch.zeros(1, hidden)}), "top_k"),
            ({"top_k": vocab + 1}, pack({"rows": torch.zeros(1, hidden)}), "top_k"),
            ({}, pack({"rows": torch.zeros(2, hidden + 1)}), f"[n, {hidden}]"),
            ({}, b"not safetensors", "safetensors"),
    ):
        answer = httpx.post(f"{setup.url}/v1/streamscope/head", params=params, content=content, headers=auth,
                            timeout=60)
        assert answer.status_code == 400 and named in answer.json()["error"]["message"], answer.text
    assert httpx.post(f"{setup.url}/v1/streamscope/head", content=pack({"rows": torch.zeros(1, hidden)}),
                      timeout=60).status_code == 401  # the API key guards it as every /v1 route
    with pytest.raises(openai.BadRequestError, match="ids"):
        setup.client.engine.unembedding_rows(torch.tensor([vocab]))
    close(streamscope.lens(setup.client, PROMPTS[1]).top_probs, streamscope.lens(setup.model, PROMPTS[1]).top_probs,
          "after the refusals")


# ---------------------------------------------------------------- the cache


def test_the_cache_over_http_equals_in_process(setup):
    client, model = setup.client, setup.model
    from streamscope.bulk.spec import value_names
    from streamscope.workflows.cache import DEFAULT_VALUES, ROOT

    remote = client.cache(PROMPTS)
    # The default's values a harvest carries, read in process; the rest are in `unavailable` with the reason.
    carried = [name for name in DEFAULT_VALUES if name in value_names()]
    local = model.cache(PROMPTS, values=[*ROOT, *carried])
    assert torch.equal(remote.tokens, local.tokens) and torch.equal(remote.mask, local.mask)
    assert list(remote.stored) == list(local.stored)
    for key, reason in remote.unavailable.items():
        if "over HTTP" in reason:
            assert key.split(".", 2)[-1] not in value_names(), key
        else:
            assert local.unavailable[key] == reason, key
    for key, value in remote.stored.items():
        close(value, local.stored[key], key)
    close(remote.logits, local.logits, "logits")
    assert list(remote.keys()) == [key for key in local.keys() if key in remote]
    # TransformerLens's methods from the values, the final norm's parameters and the head's, read off the server.
    parts, labels = remote.decompose_resid(return_labels=True)
    local_parts, local_labels = local.decompose_resid(return_labels=True)
    assert labels == local_labels
    close(parts, local_parts, "decompose_resid")
    close(remote.accumulated_resid(apply_ln=True), local.accumulated_resid(apply_ln=True), "accumulated_resid")
    close(remote.logit_attrs(parts, tokens=7), local.logit_attrs(local_parts, tokens=7), "logit_attrs")
    close(remote["ln_final.hook_scale"], local["ln_final.hook_scale"], "ln_final.hook_scale")
    # Chosen values and blocks, TransformerLens's run options, padded on the right.
    chosen = client.cache(PROMPTS, values=["layer_mid", "mlp_output"], layers=[1], padding_side="right",
                          logits=False, pos_slice=(0, 3))
    expected = model.cache(PROMPTS, values=["layer_mid", "mlp_output"], layers=[1], padding_side="right",
                           logits=False, pos_slice=(0, 3))
    assert list(chosen.stored) == list(expected.stored) and chosen.logits is None
    for key in expected.stored:
        close(chosen.stored[key], expected.stored[key], key)


def test_run_with_cache_and_norms_over_http_equal_in_process(setup):
    """TransformerLens's run_with_cache (the logits and loss from the cache's logits: the engine's head over HTTP)
    and the stream norms a dose is measured against, from a Client as from the in-process engine."""
    from streamscope.workflows.cache import ALL

    options = {"values": ["layer_output"], "return_type": "both"}
    (logits, loss), cache = setup.client.run_with_cache(PROMPTS, **options)
    (local_logits, local_loss), local_cache = setup.model.run_with_cache(PROMPTS, **options)
    close(logits, local_logits, "run_with_cache logits")
    close(loss, local_loss, "run_with_cache loss")
    assert list(cache.stored) == list(local_cache.stored)
    close(setup.client.norms(PROMPTS), setup.model.norms(PROMPTS), "norms")
    # "all": every value the blocks serve that a harvest carries; attention internals listed with the reason.
    everything = setup.client.cache(PROMPTS[1], values=ALL, logits=False)
    assert "layers.0.layer_output" in everything.stored
    assert "over HTTP" in everything.unavailable["layers.0.self_attn.pattern"]
    with pytest.raises(Unavailable, match="over HTTP"):
        everything["pattern", 0]


def test_what_http_does_not_carry_is_refused_with_the_reason(setup):
    client = setup.client
    with pytest.raises(ValueError, match="attention internals .* not served over HTTP"):
        client.cache(PROMPTS[0], values=["pattern"])
    with pytest.raises(ValueError, match="attention internals .* not served over HTTP"):
        client.cache(PROMPTS[0], values=["head_outputs", "layer_output"])
    cache = client.cache(PROMPTS[0], values=["layer_output", "attention_output"], logits=False)
    with pytest.raises(Unavailable, match="projection weights"):
        cache.output_weights(1)
    with pytest.raises(NotImplementedError, match="no trace body"):
        client.engine.run([PROMPTS[0]], lambda: [], [(1,)])
    with pytest.raises(NotImplementedError, match="gradients"):
        client.engine.run_each(PROMPTS[0], [])
    with pytest.raises(ValueError, match="max_tokens=1"):
        client.generate(PROMPTS, max_tokens=3, return_logits=True)


# ---------------------------------------------------------------- directions, SAE features


@pytest.mark.filterwarnings("ignore::streamscope.directions.UnreliableFitWarning")  # a dozen prompts: said, not tested
@pytest.mark.parametrize("method", ["mean_difference", "pca", "probe"])
def test_directions_from_a_clients_harvests_equal_in_process(setup, method):
    """The layer sweep's fits from harvests over HTTP equal in-process bit for bit (the harvests are); with the
    steering measure (one-token logits under a steer, through the engine's head) within float rounding."""
    options = {"method": method, "positions": "last", "progress": False, "seed": 3, "held_out": 0.5,
               "steering": method == "mean_difference"}
    remote = streamscope.directions.find(setup.client, POSITIVE, NEGATIVE, layers=[0, 1], **options)
    local = streamscope.directions.find(setup.model, POSITIVE, NEGATIVE, layers=[0, 1], **options)
    assert remote.layers == local.layers
    for got, want in zip(remote, local):
        assert torch.equal(got.vector, want.vector), got.layer
        assert got.model == want.model and got.bias == want.bias
        assert set(got.scores) == set(want.scores)
        for score, value in want.scores.items():
            assert abs(got.scores[score] - value) <= TOLERANCE * max(1.0, abs(value)), score
        got.check(setup.model)  # a direction made over HTTP names the served model


def test_one_token_logits_under_a_steer_equal_in_process(setup):
    vector = torch.randn(setup.client.hidden_size, generator=torch.Generator().manual_seed(5))
    steer = [streamscope.Steer("layer_output", 1, vector, scale=2.0, positions=slice(1, None), generated=False)]
    remote = setup.client.generate(PROMPTS, max_tokens=1, steer=steer, return_logits=True)
    local = setup.model.generate(PROMPTS, max_tokens=1, steer=steer, return_logits=True, progress=False)
    assert remote.tokens == local.tokens
    for got, want in zip(remote.logits, local.logits):
        close(got, want.float(), "one-token logits")


def test_sae_features_over_the_servers_stored_sae_equal_in_process(setup):
    import sae_checks
    from streamscope.sae import from_sae_lens

    sae = from_sae_lens(sae_checks.sae_lens_sae(setup.client.hidden_size, 4 * setup.client.hidden_size))
    setup.client.store_sae("toolbox", sae)
    for top_k in (None, 4):
        remote = setup.client.harvest(PROMPTS, sae=sae, positions="all", top_k=top_k)
        local = setup.model.harvest(PROMPTS, sae=sae, positions="all", top_k=top_k, progress=False)
        assert sorted(remote.values) == sorted(local.values)
        for name in local.values:
            for got, want in zip(remote[name], local[name]):
                if name == "sae_indices":
                    assert torch.equal(got, want)
                else:
                    close(got, want, name)
    # A feature's direction made against the client names the served model, as one made in process.
    assert sae.feature(3, setup.client).model == sae.feature(3, setup.model).model
    setup.client.delete_sae("toolbox")


# ---------------------------------------------------------------- plots and views


def test_a_clients_lens_and_cache_plot_and_view_as_in_process(setup, tmp_path):
    from PIL import Image

    remote = streamscope.lens(setup.client, PROMPTS[1], top_k=5)
    local = streamscope.lens(setup.model, PROMPTS[1], top_k=5)
    sizes = []
    for name, result in (("remote", remote), ("local", local)):
        path = result.plot(tmp_path / f"{name}.png")
        with Image.open(path) as image:
            sizes.append(image.size)
    assert sizes[0] == sizes[1]
    pages = [result.view(tmp_path / f"{name}.html").html for name, result in (("remote", remote), ("local", local))]
    for token in local.tokens:
        assert pages[0].count(token) == pages[1].count(token)
    assert remote._repr_html_() == local._repr_html_()
    remote_cache = setup.client.cache(PROMPTS[1], values=["layer_output"], logits=False)
    local_cache = setup.model.cache(PROMPTS[1], values=["layer_output"], logits=False)
    assert remote_cache._repr_html_() == local_cache._repr_html_()


# ---------------------------------------------------------------- the dose guard's warnings, a carried norm


def dose_messages(caught) -> list[str]:
    return [str(item.message) for item in caught if item.category is streamscope.DoseWarning]


@pytest.mark.parametrize("action", ["clamp", "warn"])
def test_a_clamped_or_warned_dose_reaches_the_client_as_in_process(setup, action):
    """The server's check clamps (or lets run) a dose past the limit and says so in the response; the Client warns
    a `DoseWarning` naming the dose and the limit, as the in-process engine does, and the generation is the
    in-process one: at the clamped scale (the same number, from each engine's own calibration norm), or as given."""
    import re

    from streamscope.bulk.spec import stream_norms

    block = 1
    norm = stream_norms(setup.model, [("layer_output", block)])[("layer_output", block)]
    vector = torch.randn(setup.client.hidden_size, generator=torch.Generator().manual_seed(6))
    dose = 300
    steer = streamscope.Steer("layer_output", block, vector, scale=dose * norm / float(vector.norm()), on_dose=action)
    run = {"max_tokens": 4, "ignore_eos": True}
    with pytest.warns(streamscope.DoseWarning) as caught:
        remote = setup.client.generate(PROMPTS, steer=[steer], **run)
    with pytest.warns(streamscope.DoseWarning) as in_process:
        local = setup.model.generate(PROMPTS, steer=[steer], progress=False, **run)
    said, expected = dose_messages(caught), dose_messages(in_process)
    assert len(said) == 1 == len(expected), (said, expected)
    assert f"dose {dose} = " in said[0] and "the limit is max_dose=100" in said[0], said
    assert "measured by the server's engine on streamscope's calibration text" in said[0]
    ending = "clamped to the limit" if action == "clamp" else "it runs as given"
    assert ending in said[0] and ending in expected[0]
    if action == "clamp":
        numbers = [float(re.search(r"-> ([0-9.e+-]+) ", message).group(1)) for message in (said[0], expected[0])]
        assert abs(numbers[0] - numbers[1]) <= TOLERANCE * numbers[1], numbers
    assert remote.tokens == local.tokens


def test_the_openai_client_reads_the_dose_warnings_streamed_or_not(setup):
    """Completions and chat completions, streamed and not: the response's x-streamscope-warnings header holds the
    check's messages as a JSON list; a request within the limit carries none."""
    import json

    from streamscope.bulk.spec import stream_norms

    norm = stream_norms(setup.model, [("layer_output", 1)])[("layer_output", 1)]
    vector = torch.randn(setup.client.hidden_size, generator=torch.Generator().manual_seed(7))
    item = {"value": "layer_output", "layer": 1, "vector": vector.tolist(), "on_dose": "clamp",
            "scale": 200 * norm / float(vector.norm())}
    name = setup.client.model
    for stream in (False, True):
        for chat in (False, True):
            request = {"model": name, "max_tokens": 2, "stream": stream, "extra_body": {"streamscope": {"steer": [item]}}}
            if chat:
                raw = setup.api.chat.completions.with_raw_response.create(
                    messages=[{"role": "user", "content": PROMPTS[1]}], **request)
            else:
                raw = setup.api.completions.with_raw_response.create(prompt=PROMPTS[1], **request)
            said = json.loads(raw.headers["x-streamscope-warnings"])
            parsed = raw.parse()
            if stream:
                assert list(parsed), "the stream ran"
            assert len(said) == 1 and "dose 200 = " in said[0] and "clamped to the limit" in said[0], (stream, chat)
    within = setup.api.completions.with_raw_response.create(
        model=name, prompt=PROMPTS[1], max_tokens=2,
        extra_body={"streamscope": {"steer": [{**item, "scale": 1.0}]}})
    assert "x-streamscope-warnings" not in within.headers


@pytest.mark.filterwarnings("ignore::streamscope.directions.UnreliableFitWarning")  # a dozen prompts: said, not tested
def test_a_direction_made_over_http_carries_its_norm_to_the_servers_dose_check(setup):
    """A direction made from a Client records its block's norm over its prompts (the in-process model.norms of
    them); stored with it on the server (listed, downloaded back), a steer by its name is checked against that
    norm, and so is its own steer: clamped to the scale model.norms makes the limit, the generation is the
    in-process one at that scale."""
    import json

    from safetensors.torch import load

    value, block = "mlp_output", 1  # a site no other test here steers: the server has measured no norm there
    direction = streamscope.directions.find(setup.client, POSITIVE, NEGATIVE, value=value, layers=[block],
                                            held_out=0.0, steering=False, progress=False)[block]
    local_norm = float(setup.model.norms(POSITIVE + NEGATIVE, value, layers=[block])[0])
    assert abs(direction.stream_norm - local_norm) <= TOLERANCE * local_norm, (direction.stream_norm, local_norm)
    carried = {"value": value, "layer": block, "norm": direction.stream_norm}
    assert setup.client.store_vector("carried", direction)["stream_norm"] == carried
    assert [entry for entry in setup.client.vectors() if entry["name"] == "carried"][0]["stream_norm"] == carried
    data = setup.client._route("GET", "vectors/carried").content
    size = int.from_bytes(data[:8], "little")
    assert json.loads(json.loads(data[8:8 + size])["__metadata__"]["streamscope.stream_norm"]) == carried
    assert torch.equal(load(data)["vector"], direction.vector)
    length = float(direction.vector.norm())
    given = 1000 * direction.stream_norm / length
    by_name = {"value": value, "layer": block, "vector": "carried", "scale": given, "on_dose": "clamp"}
    raw = setup.api.completions.with_raw_response.create(model=setup.client.model, prompt=PROMPTS[0], max_tokens=1,
                                                         extra_body={"streamscope": {"steer": [by_name]}})
    assert "carried by stored vector 'carried'" in raw.headers["x-streamscope-warnings"]
    assert "dose 1000 = " in raw.headers["x-streamscope-warnings"]
    with pytest.warns(streamscope.DoseWarning, match=r"dose 1000 = .*carried by the steer's vector") as caught:
        remote = setup.client.generate(PROMPTS, max_tokens=4, steer=[direction.steer(scale=given, on_dose="clamp")],
                                       ignore_eos=True)
    assert not [text for text in dose_messages(caught) if "measured by" in text]
    number = given * 100 / (given * length / local_norm)  # the limit's scale, from the in-process model.norms
    by_hand = streamscope.Steer(value, block, direction.vector, scale=number, max_dose=None)
    local = setup.model.generate(PROMPTS, max_tokens=4, steer=[by_hand], ignore_eos=True, progress=False)
    assert remote.tokens == local.tokens
    setup.client.delete_vector("carried")
