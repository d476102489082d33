"""`streamscope serve` started with an alias: the name it serves under, and what `/info` says it serves (issue 38,
items 8 and 14).

One server subprocess for the module, started as ``streamscope serve smollm2`` with the alias pointed at a local
fixture (a ``STREAMSCOPE_CACHE`` folder holding a tiny Llama where `streamscope.models.smollm2()` keeps its
conversion; no network here). It must answer to ``smollm2`` (not the folder's absolute path) and say so at
startup; ``/v1/streamscope/info`` must list the values this Llama's blocks hold, the oracle's account of the
checkpoint (`streamscope.testing.oracle`, read with torch hooks on transformers' own modules), and not
``linear_attn.attention_output``, which a Llama has no module for.
"""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

import oracle
import precision
from serve_process import KEY, running
from streamscope.serve.server import served_name

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="a server subprocess would ask for vLLM's default 90% of the GPU beside the GPU suite's "
                                "engines; the name and /info are device-independent Python, checked here")

HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def alias_folder(checkpoints, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return shutil.copytree(checkpoints("llama"), cache / "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def server(alias_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STREAMSCOPE_CACHE", str(alias_folder.parent))
        with running("smollm2", log) as url:
            yield url, log


def test_the_server_answers_to_the_alias_and_says_so_at_startup(server, alias_folder):
    url, log = server
    models = httpx.get(url + "/v1/models", headers=HEADERS, timeout=30).json()
    assert [entry["id"] for entry in models["data"]] == ["smollm2"]
    assert f"serving {alias_folder} as 'smollm2'" in log.read_text()
    # The machine's path is no name of the model: refused by vLLM, and the engine serves the next request.
    refused = httpx.post(url + "/v1/completions", headers=HEADERS, timeout=60,
                         json={"model": str(alias_folder), "prompt": "Hello", "max_tokens": 2})
    assert refused.status_code == 404, refused.text
    served = httpx.post(url + "/v1/completions", headers=HEADERS, timeout=60,
                        json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert served.status_code == 200, served.text
    assert served.json()["model"] == "smollm2"


def oracle_names(folder) -> set[str]:
    """The bulk names of the values the oracle finds on the checkpoint's transformers modules: a block's parts under
    the short name and under the submodule of transformers' block that computes them."""
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    found = oracle.values(reference, "llama", torch.tensor([[1, 2, 3]]))
    block = reference.model.layers[0]
    attention = next(name for name in ("self_attn", "linear_attn") if hasattr(block, name))
    names: set[str] = set()
    for name in found:
        if name in ("order", "logits"):
            continue
        if name == "attention_output":
            names |= {name, f"{attention}.{name}"}
        elif name == "mlp_output":
            names |= {name, f"mlp.{name}"}
        elif name in ("neurons", "neurons_pre"):
            names.add(f"mlp.{name}")
        else:
            names.add(name)
    return names


def test_info_lists_what_the_llamas_blocks_serve(server, alias_folder):
    url, _ = server
    info = httpx.get(url + "/v1/streamscope/info", headers=HEADERS, timeout=30).json()
    assert set(info["values"]) == oracle_names(alias_folder)
    assert "linear_attn.attention_output" not in info["values"]
    assert "linear_attn" in info["unavailable"]["linear_attn.attention_output"]
    # Each listed value is one a request may harvest: the server takes every one of them.
    for value in info["values"]:
        response = httpx.post(url + "/v1/completions", headers=HEADERS, timeout=60, json={
            "model": "smollm2", "prompt": "Hello", "max_tokens": 1, "temperature": 0,
            "streamscope": {"harvest": {"values": [value], "layers": [0], "positions": "last"}}})
        assert response.status_code == 200, (value, response.text)


def test_the_served_name_is_never_a_path(tmp_path):
    folder = tmp_path / "my-checkpoint"
    folder.mkdir()
    gguf = tmp_path / "tiny-llama.Q4_1.gguf"
    gguf.write_bytes(b"")
    assert served_name(str(folder)) == "my-checkpoint"
    assert served_name(str(folder) + "/") == "my-checkpoint"
    assert served_name(str(gguf)) == "tiny-llama.Q4_1"
    assert served_name("SMOLLM2") == "smollm2"
    assert served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
