"""``streamscope serve --pipeline-parallel-size 2`` answers steered and harvesting requests as one stage does.

Two real servers of one tiny 4-block Llama, one after the other (one engine alive at a time): one stage, then
two (blocks 0-1 and 2-3, each stage a process of its own with one thread, as the single stage runs). The same
requests go to both: harvests of every block and the root values (each stage reads its own blocks, the front end
puts the parts together: `streamscope.serve.stages`), completions steered on both stages' blocks in one
request, and a generation steered and harvesting at once. On this CPU the two agree bit for bit (the same
float32 kernels on the same rows; the bulk path's PP test measures the same).
"""

from __future__ import annotations


import openai
import pytest
import torch

import precision
from serve_process import KEY, running
import streamscope
from streamscope import Steer
from streamscope.serve.protocol import rule_json

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="the CPU build's server; a GPU server runs the same code")

PROMPTS = ["Once upon a time", "Rome is in Italy, Berlin is in Germany"]
HIDDEN = 64
VALUES = ["layer_output", "layer_mid", "mlp_output", "token_embeddings", "final_norm_output"]


def steer_json(steer: Steer) -> dict:
    return {"value": steer.value, "layer": steer.layer, "vector": steer.vector.tolist(), "scale": steer.scale,
            "positions": rule_json(steer.positions), "mode": steer.mode, "generated": steer.generated}


def vector(seed: int) -> torch.Tensor:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


#: Steers on both stages' blocks (0 and 1 on the first, 3 on the second) and the root, in one request.
STEERS = [Steer("mlp_output", 0, vector(1), scale=3.0), Steer("layer_output", 1, vector(2), positions="last"),
          Steer("layer_mid", 3, vector(3), scale=2.0), Steer("token_embeddings", None, vector(4), scale=0.5)]


def session(url: str, folder) -> dict:
    """The same requests on either server: its harvests, steered completions and steered generation."""
    api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    client = streamscope.Client(url, api_key=KEY, concurrency=1)
    name = api.models.list().data[0].id
    result: dict = {"harvest": client.harvest(PROMPTS, VALUES, layers=None, positions="all")}
    for label, steers in (("steered", STEERS), ("second stage only", STEERS[2:3]), ("bare", [])):
        runs = []
        for prompt in PROMPTS:
            extra = {"return_token_ids": True}
            if steers:
                extra["streamscope"] = {"steer": [steer_json(item) for item in steers]}
            response = api.completions.create(model=name, prompt=prompt, max_tokens=5, temperature=0, logprobs=1,
                                              extra_body=extra)
            choice = response.choices[0]
            runs.append((choice.model_extra.get("token_ids"), choice.logprobs.token_logprobs))
        result[label] = runs
    result["generation"] = client.generate(PROMPTS, max_tokens=4, steer=STEERS[:3],
                                           harvest={"values": ["layer_output", "final_norm_output"],
                                                    "layers": [0, 3], "positions": "all"})
    result["left"] = sorted(path.name for path in folder.iterdir())
    return result


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    path = checkpoints("llama", num_hidden_layers=4)
    out = {}
    for stages, bind in ((1, "0"), (2, "0|1")):
        folder = tmp_path_factory.mktemp(f"stages{stages}")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)  # one thread a stage, in both runs
            with running(path, folder / "server.log", "--pipeline-parallel-size", str(stages), "--harvest-dir",
                         str(folder / "harvests")) as url:
                out[stages] = session(url, folder / "harvests")
    return out[1], out[2]


def test_a_harvest_over_two_stages_equals_one_stages_bit_for_bit(runs):
    one, two = runs
    assert two["harvest"].layers == one["harvest"].layers == [0, 1, 2, 3]
    assert two["harvest"].positions == one["harvest"].positions
    for value in VALUES:
        for prompt, (got, want) in enumerate(zip(two["harvest"][value], one["harvest"][value])):
            assert torch.equal(got, want), f"{value} of prompt {prompt}: {(got - want).abs().max()} apart"
            assert got.abs().sum() > 0
    assert two["left"] == one["left"] == []  # every part was put together, and the harvest downloaded and deleted


def test_steers_on_both_stages_equal_one_stages(runs):
    one, two = runs
    for label in ("steered", "second stage only", "bare"):
        assert two[label] == one[label], label  # tokens and log-probs, exactly
    for steered, bare in zip(two["steered"], two["bare"]):
        assert steered[1] != bare[1]  # the steers ran
    for steered, bare in zip(two["second stage only"], two["bare"]):
        assert steered[1] != bare[1]  # the second stage's steer ran on the second stage


def test_a_steered_generation_with_a_harvest_equals_one_stages(runs):
    one, two = runs
    assert two["generation"].tokens == one["generation"].tokens
    for value in ("layer_output", "final_norm_output"):
        for got, want in zip(two["generation"].harvest[value], one["generation"].harvest[value]):
            assert torch.equal(got, want), value
