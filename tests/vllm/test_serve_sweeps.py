"""The server's sweeps over HTTP (issue 42): a patching grid in one request equals in-process `streamscope.patch`,
with its noise floor; running moments equal in-process `model.statistics` bit for bit, and directions fit from
them equal the oracle's; reduced harvests over HTTP.

One server subprocess (tiny Llama, float32, its own engine process: tests/serve_process.py) and an in-process
engine of the same checkpoint; the oracle is transformers' float32 forward read with torch hooks.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import precision
import reduction_checks
from access import relative_error
from direction_checks import NEGATIVE, POSITIVE
from serve_process import KEY, running
import streamscope
from streamscope.directions import from_moments
from streamscope.serve.sweeps import RemotePatching, token_logprob
from streamscope.vllm.model import beside_engine

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="a server subprocess would ask for vLLM's default 90% of "
                                "the GPU beside the GPU suite's in-process engines; the sweep on a GPU server is "
                                "benchmarks/patch_sweep.py, which also checks its effects against in process")

#: The server batches a sweep's requests into its steps as it likes; in-process runs batch otherwise: float32 on the
#: CPU, the same ops in another batch (tests/precision.py's CPU_FLOAT32).
TOLERANCE = precision.CPU_FLOAT32
CLEAN, CORRUPTED = "The Eiffel Tower is in the city of", "The Louvre is in the city of"


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def server(path, tmp_path_factory):
    with running(path, tmp_path_factory.mktemp("serve") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def model(path, server):
    engine = streamscope.load(path, engine="vllm")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return streamscope.Client(server, api_key=KEY)


def close(remote: float, local: float) -> bool:
    return abs(remote - local) <= TOLERANCE * max(1.0, abs(local))


def _same_patching(remote, local) -> None:
    assert isinstance(remote, RemotePatching)
    assert remote.layers == local.layers and remote.columns == local.columns and remote.labels == local.labels
    assert close(remote.clean, local.clean) and close(remote.corrupted, local.corrupted)
    scale = max(1.0, float(local.effects.abs().max()))
    assert float((remote.effects - local.effects).abs().max()) <= TOLERANCE * scale


def test_a_patch_sweep_on_the_server_equals_in_process_patch(client, model):
    tokenizer = model.tokenizer
    answer, wrong = tokenizer(" Paris", add_special_tokens=False)["input_ids"][0], \
        tokenizer(" Rome", add_special_tokens=False)["input_ids"][0]
    for value in ("layer_output", "attention_output", "mlp_output"):
        remote = streamscope.patch(client, CLEAN, CORRUPTED, answer=answer, wrong=wrong, value=value)
        local = streamscope.patch(model, CLEAN, CORRUPTED, answer=answer, wrong=wrong, value=value, progress=False)
        _same_patching(remote, local)
        assert remote.effects.shape == (model.num_layers, len(tokenizer(CORRUPTED)["input_ids"]))
        # the noise floor: the unpatched corrupted request's spread over its repeats (the CPU engine: rounding)
        assert len(remote.corrupted_runs) == 3 and len(remote.clean_runs) == 3
        assert 0 <= remote.noise <= TOLERANCE * max(1.0, abs(local.corrupted))
        assert all(close(run, local.corrupted) for run in remote.corrupted_runs)
    # a chosen grid, a log-probability, more repeats
    metric = token_logprob(answer)
    remote = client.patch_sweep(CLEAN, CORRUPTED, metric, layers=[0, 2], positions=[-1, 1], repeats=5)
    local = streamscope.patch(model, CLEAN, CORRUPTED, metric, layers=[0, 2], positions=[-1, 1], progress=False)
    _same_patching(remote, local)
    assert len(remote.corrupted_runs) == 5


def test_bad_sweeps_are_refused_with_the_fix_and_the_server_serves_on(client, server, model):
    with pytest.raises(TypeError, match="a Python function cannot cross"):
        streamscope.patch(client, CLEAN, CORRUPTED, lambda logits: logits[0])
    with pytest.raises(openai.BadRequestError, match="same number of tokens"):
        client.patch_sweep(CLEAN, "Rome", answer=1, wrong=2)
    with pytest.raises(openai.BadRequestError, match="patched one head at a time"):
        client.patch_sweep(CLEAN, CORRUPTED, answer=1, wrong=2, value="head_outputs")
    with pytest.raises(openai.BadRequestError, match="repeats"):
        client.patch_sweep(CLEAN, CORRUPTED, answer=1, wrong=2, repeats=0)
    with pytest.raises(openai.BadRequestError, match="names a position twice"):
        client.patch_sweep(CLEAN, CORRUPTED, answer=1, wrong=2, positions=[1, 1])
    bad = httpx.post(server + "/v1/streamscope/patch", headers={"Authorization": f"Bearer {KEY}"},
                     json={"clean": CLEAN, "corrupted": CORRUPTED, "metric": {"logit": 10**9}})
    assert bad.status_code == 400 and "token id" in bad.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="labels has 1 entries"):
        client.statistics(["a", "b"], ["x"])
    with pytest.raises(openai.BadRequestError, match="reduce"):
        client.statistics(["a", "b"], ["x", "y"], reduce="max")
    # the server serves on: a sweep after the refusals
    remote = client.patch_sweep(CLEAN, CORRUPTED, answer=1, wrong=2, layers=[0], positions=[-1], repeats=1)
    assert remote.effects.shape == (1, 1)


def test_moments_over_http_equal_in_process_statistics_bit_for_bit(client, model):
    prompts = reduction_checks.PROMPTS
    labels = ["positive"] * 5 + ["negative"] * 5
    pairs = [(index, index + 5) for index in range(5)]
    for reduce, positions in (("mean", "all"), ("last", "last"), ("mean", [0, -1])):
        # one prompt an engine step on both sides: the rows are the same bits, and so are the moments
        remote = client.statistics(prompts, labels, positions=positions, reduce=reduce, second=True, pairs=pairs,
                                   concurrency=1)
        local = model.statistics(prompts, labels, positions=positions, reduce=reduce, second=True, pairs=pairs,
                                 chunk_size=1, progress=False)
        assert remote.labels == local.labels and remote.layers == local.layers and remote.counts == local.counts
        for label in local.labels:
            assert torch.equal(remote.sums[label], local.sums[label]), (reduce, label)
            assert torch.equal(remote.squares[label], local.squares[label]), (reduce, label)
    root = client.statistics(prompts, labels, "final_norm_output", concurrency=1)
    assert root.layers == [None] and not root.squares
    assert torch.equal(root.sums["positive"],
                       model.statistics(prompts, labels, "final_norm_output", chunk_size=1,
                                        progress=False).sums["positive"])


def test_a_direction_from_moments_over_http_equals_the_oracle_and_ships_kilobytes(client, path):
    with beside_engine():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    import direction_checks

    positive = direction_checks.oracle_last_positions(reference, "llama", tokenizer, POSITIVE)
    negative = direction_checks.oracle_last_positions(reference, "llama", tokenizer, NEGATIVE)
    moments = client.statistics(POSITIVE + NEGATIVE, ["happy"] * len(POSITIVE) + ["sad"] * len(NEGATIVE),
                                layers=[1, 2])
    assert moments.nbytes() == 2 * 2 * client.hidden_size * 8  # two labels x two blocks x hidden float64: no rows
    sweep = from_moments(moments, "happy", "sad")
    for block in (1, 2):
        expected = positive[block].mean(0) - negative[block].mean(0)
        assert relative_error(sweep[block].vector, expected) <= reduction_checks.RELATIVE, block


@pytest.mark.parametrize("positions", ["all", [0, -2]])
def test_a_reduced_harvest_over_http_equals_in_process_bit_for_bit(server, model, positions):
    one_at_a_time = streamscope.Client(server, api_key=KEY, concurrency=1)  # one prompt a step, as below
    values = ["layer_output", "final_norm_output"]
    for reduce in ("last", "mean"):
        remote = one_at_a_time.harvest(reduction_checks.PROMPTS[:3], values, layers=[0, 2], positions=positions,
                                       reduce=reduce)
        assert remote.reduce == reduce
        for index, prompt in enumerate(reduction_checks.PROMPTS[:3]):
            local = model.harvest([prompt], values, layers=[0, 2], positions=positions, reduce=reduce, progress=False)
            assert remote.positions[index] == local.positions[0]
            for value in values:
                assert remote[value][index].shape[-2] == 1
                assert torch.equal(remote[value][index], local[value][0]), (value, reduce, prompt)
    with pytest.raises(openai.BadRequestError, match="reduce"):
        one_at_a_time.harvest(["Rome"], "layer_output", reduce="median")
