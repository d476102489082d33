"""``streamscope serve --graph-ops``: the server's steers and harvests through the graph ops, held to the hook path.

For each family (Llama: a fused block, the stream ``hidden + residual``;
GPT-2: a whole stream) the module starts two servers of one checkpoint: one
with ``--graph-ops`` (the worker inserts the ops at load, and its applier
hands each steer and harvest they serve to the graph plan) and one without
(every steer and harvest on hooks). Over HTTP, with the openai client and
`streamscope.Client`:

* a steer of every mode (add, set, ablate, clamp, norm-matched) at
  ``layer_output`` and at a sublayer output, read back as a harvest of every
  block's ``layer_output`` at every prompt position: the graph server equals
  the hook server bit for bit for add and set (docs/graph-ops.md), else
  within ``CPU_FLOAT32``, and both equal transformers' float32 forward edited
  by plain torch hooks (tests/oracle.py) within the suite's vLLM tolerance;
* a harvest of every block's last position and one of 2 blocks at every
  position: the graph server's bytes equal the hook server's, and the oracle's
  values within the tolerance;
* concurrent requests with different steers each equal their solo run, and
  an unsteered batchmate its unsteered run bit for bit;
* steered completions without a harvest, run twice so that the second reads
  its prompt's prefix from vLLM's prefix cache (the server's default), equal
  the hook server's tokens and log-probs;
* an SAE clamp and a conditional steer on the same graph server fall back
  to the hooks and equal the hook server.

Counts of what the ops served (``/v1/streamscope/info``'s ``graph_ops``)
prove the ops ran where they should and did not where they should not. The
refusals of the command line and of a compiled server's front end are checked
without a server, and the worker's where its hooks do not fire on an
in-process engine started as the server starts its own, stepped by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer
from vllm import LLM

import attention_oracle
import oracle
import precision
import streamscope
from access import relative_error
from serve_process import KEY, running
from steer_checks import plain_operation
from streamscope.serve.protocol import XARG, Limits, RequestError, vector_bytes
from streamscope.serve.server import Front, engine_settings, graph_options
from streamscope.serve.storage import harvest_tensors
from streamscope.serve.worker import GRAPH_WORKERS, ServeState
from streamscope.sae import SAE
from streamscope.vllm.graph_backend import RUNNER_ATTRIBUTE, GraphOptions, engine_config, graph_ops_of
from streamscope.vllm.model import StandardizedVLLM, beside_engine

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="not yet run on a GPU: its servers start on the CPU build "
                                "(eager); the compiled GPU server is docs/graph-ops.md's item 5, to run on the H200")

#: A fused block and a whole stream.
FAMILIES = ("llama", "gpt2")
PROMPTS = ["Once upon a time there was", "Rome is in Italy, Berlin is in Germany", "def add(a, b):"]
#: The vLLM engine against transformers' float32 forward (the suite's tolerance for the CPU build).
RELATIVE = precision.CPU_FLOAT32
#: Each mode's settings; the values a steer is put at: the stream boundary and a sublayer output.
SETTINGS = {"add": {"scale": 2.0}, "set": {"scale": 1.5}, "ablate": {"scale": 1.0}, "clamp": {"projection": 3.0}}
MODES = [("add", False), ("set", False), ("ablate", False), ("clamp", False), ("add", True), ("clamp", True)]
SITES = [("layer_output", 1), ("attention_output", 0)]
EVERY_BLOCK = {"values": "layer_output", "layers": None, "positions": "all"}


class Servers:
    """A family's checkpoint served twice, with and without the graph ops, beside its oracle and tokenizer."""

    def __init__(self, family: str, path: Any, graphed: str, hooked: str) -> None:
        self.family, self.path = family, path
        self.graphed = streamscope.Client(graphed, api_key=KEY, concurrency=1)
        self.hooked = streamscope.Client(hooked, api_key=KEY, concurrency=1)
        self.urls = {"graphed": graphed, "hooked": hooked}
        self.hidden = self.graphed.info()["hidden_size"]
        self.layers = self.graphed.info()["layers"]
        with beside_engine():
            self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def served(self) -> tuple[int, int]:
        """(steers, harvests) the graph server's ops have served so far."""
        found = self.graphed.info()["graph_ops"]["served"]
        return found["steers"], found["harvests"]

    def api(self, which: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls[which] + "/v1", api_key=KEY, max_retries=0)

    def vector(self, seed: int) -> torch.Tensor:
        return torch.randn(self.hidden, generator=torch.Generator().manual_seed(seed))

    def oracle_stream(self, prompt: str, steers: list, value: str = "layer_output") -> list[torch.Tensor]:
        """Transformers' float32 `value` at every block and prompt position, ``[positions, hidden]`` each, with
        `steers` applied by plain hooks at their positions (prompt positions only: one forward)."""
        ids = torch.tensor([self.tokenizer(prompt).input_ids])
        length = ids.shape[1]
        with ExitStack() as stack, torch.no_grad():
            for steer in steers:
                positions = edited(steer, length)
                module, where, factor = oracle.site(self.reference, self.family, steer.value.split(".")[-1],
                                                    steer.layer % self.layers)
                assert factor is None

                def edit(tensor: torch.Tensor, steer: Any = steer, positions: list[int] = positions) -> None:
                    stream = tensor.reshape(1, length, tensor.shape[-1])[0]
                    stream[positions] = plain_operation(stream[positions], steer)
                stack.enter_context(oracle.hooked(module, where, edit))
            found = oracle.values(self.reference, self.family, ids)[value]
        return [tensor.reshape(length, -1) for tensor in found]


def edited(steer: streamscope.Steer, length: int) -> list[int]:
    rule = steer.positions
    if rule == "all":
        return list(range(length))
    if rule == "all_but_first":
        return list(range(1, length))
    if rule == "last":
        return [length - 1]
    return sorted({index % length for index in rule})


@pytest.fixture(scope="module", params=FAMILIES)
def servers(request: Any, checkpoints: Any, tmp_path_factory: Any) -> Any:
    path = checkpoints(request.param)
    folder = tmp_path_factory.mktemp(f"serve-graph-{request.param}")
    with running(path, folder / "graphed.log", "--graph-ops") as graphed, \
            running(path, folder / "hooked.log") as hooked:
        yield Servers(request.param, path, graphed, hooked)


def equal(got: torch.Tensor, want: torch.Tensor, bits: bool) -> bool:
    return torch.equal(got, want) if bits else relative_error(got, want) <= precision.CPU_FLOAT32


def steer_of(servers: Servers, mode: str, norm_match: bool, value: str, layer: int, seed: int,
             **more: Any) -> streamscope.Steer:
    return streamscope.Steer(value, layer, servers.vector(seed), mode=mode, norm_match=norm_match,
                             **{**SETTINGS[mode], **more})


def steered_stream(client: streamscope.Client, prompts: list[str], steers: list) -> Any:
    """Each prompt's ``layer_output`` at every block and prompt position under `steers` (one forward, one token)."""
    return client.generate(prompts, 1, steer=steers, harvest=EVERY_BLOCK)


def test_the_info_route_says_the_ops_are_on_and_where(servers: Servers) -> None:
    info, plain = servers.graphed.info(), servers.hooked.info()
    names = {f"layers.{layer}.{value}" for layer in range(servers.layers)
             for value in GraphOptions().values}
    ops = info["graph_ops"]
    assert set(ops["edit_sites"]) == names == set(ops["harvest_sites"]) and ops["skipped"] == {}
    assert ops["options"] == GraphOptions().config() and ops["rounds"] == 2 and ops["slots"] == 256
    assert ops["hooks_fire"] is True and info["graph_mode"] == "NONE"  # the CPU engine stays eager
    assert info["worker"] == GRAPH_WORKERS["cpu"] and plain["graph_ops"] is None
    assert ops["live"] == 0  # no slot held once its requests left
    # on by default, and refused with the reason where the engine captures no CUDA graph (this CPU's)
    assert ops["idle_graphs"] == {"state": "not kept: this engine captures no CUDA graph (the ops skip an idle step "
                                           "in Python)", "captured": 0}
    assert ops["lean_graphs"] == ops["idle_graphs"]  # on by default (layer_output), refused for the same reason
    assert set(ops["steps"]) == {"marked", "idle"}


@pytest.mark.parametrize("site", SITES, ids=[value for value, _ in SITES])
@pytest.mark.parametrize("mode", MODES, ids=[f"{mode}{'-nm' if match else ''}" for mode, match in MODES])
def test_a_steer_equals_the_hook_server_and_the_oracle(servers: Servers, mode: tuple, site: tuple) -> None:
    """One steer over two prompts (the default positions on the first, all on the second), read back at every
    block: the graph server equals the hook server (bits for add and set) and the oracle's edited forward."""
    (name, norm_match), (value, layer) = mode, site
    steers = [steer_of(servers, name, norm_match, value, layer, 3, prompts=[0]),
              steer_of(servers, name, norm_match, value, layer, 4, positions="all", prompts=[1])]
    before = servers.served()
    got = steered_stream(servers.graphed, PROMPTS[:2], steers)
    assert servers.served()[0] == before[0] + 2 and servers.served()[1] >= before[1] + 2  # the ops did both
    want = steered_stream(servers.hooked, PROMPTS[:2], steers)
    assert got.tokens == want.tokens
    bits = name in ("add", "set")
    for index, prompt in enumerate(PROMPTS[:2]):
        expected = servers.oracle_stream(prompt, [steers[index]])
        plain = servers.oracle_stream(prompt, [])
        for block in range(servers.layers):
            row = got.harvest["layer_output"][index][block]  # [positions, hidden]
            assert equal(row, want.harvest["layer_output"][index][block], bits), (mode, site, index, block)
            assert relative_error(row.reshape(expected[block].shape), expected[block]) <= RELATIVE, \
                (mode, site, index, block)
        last = expected[-1]
        assert relative_error(last, plain[-1]) > 10 * RELATIVE  # the steer moved the stream the oracle reads


def test_one_vector_at_sites_of_different_kinds_edits_each_as_its_own(servers: Servers) -> None:
    """One vector clamped at a block's output, another block's attention output and a third block's output: the
    worker makes one operation of it for the three (one slot in the ops), and each site still edits as its own
    kind (a fused block's halves, a sublayer's output), on both servers, as the oracle's forward says. (A scaled
    sublayer output, Granite's, is held to the same on the hook server in test_serve_families.py.)"""
    steers = [steer_of(servers, "clamp", False, value, layer, 7, positions="all")
              for value, layer in (("layer_output", 0), ("attention_output", 1), ("layer_output", 2))]
    got = steered_stream(servers.graphed, PROMPTS[:1], steers)
    want = steered_stream(servers.hooked, PROMPTS[:1], steers)
    expected = servers.oracle_stream(PROMPTS[0], steers)
    assert relative_error(expected[-1], servers.oracle_stream(PROMPTS[0], [])[-1]) > 10 * RELATIVE
    for block in range(servers.layers):
        for found in (got, want):
            row = found.harvest["layer_output"][0][block]
            assert relative_error(row.reshape(expected[block].shape), expected[block]) <= RELATIVE, block


def test_harvests_equal_the_hook_server_bit_for_bit_and_the_oracle(servers: Servers) -> None:
    """Every block's last position, 2 blocks' stream and sublayer output at every position, and every value the
    ops read at every block's last position (the whole of the ops' buffers crosses to the host)."""
    every = ["layer_input", "layer_mid", "mlp_input", "layer_output", "attention_output", "mlp_output"]
    cases = [(["layer_output"], None, "last"), (["layer_output", "mlp_output"], [0, servers.layers - 1], "all"),
             (every, None, "last")]
    for values, layers, positions in cases:
        before = servers.served()[1]
        got = servers.graphed.harvest(PROMPTS, values, layers=layers, positions=positions)
        assert servers.served()[1] == before + len(PROMPTS), (values, positions)
        want = servers.hooked.harvest(PROMPTS, values, layers=layers, positions=positions)
        assert got.layers == want.layers and got.positions == want.positions
        for value in values:
            for index, prompt in enumerate(PROMPTS):
                assert torch.equal(got[value][index], want[value][index]), (value, positions, index)
                ids = torch.tensor([servers.tokenizer(prompt).input_ids])
                found = oracle.values(servers.reference, servers.family, ids)[value]
                chosen = [ids.shape[1] - 1] if positions == "last" else list(range(ids.shape[1]))
                blocks = range(servers.layers) if layers is None else layers
                expected = torch.stack([found[block].reshape(ids.shape[1], -1)[chosen] for block in blocks])
                assert relative_error(got[value][index].reshape(expected.shape), expected) <= RELATIVE, \
                    (value, positions, index)


def _run(api: openai.OpenAI, prompt: str, field: dict[str, Any]) -> tuple[list[int], Any]:
    """A completion of 3 tokens with `field`: its tokens, and its harvest's tensors (None without one)."""
    model = api.models.list().data[0].id
    response = api.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"streamscope": field, "return_token_ids": True})
    tokens = list(response.choices[0].model_extra.get("token_ids") or [])
    if "harvest" not in field:
        return tokens, None
    harvest = response.model_extra["streamscope"]["harvest"]
    data = httpx.get(f"{api.base_url}streamscope/harvests/{harvest}", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=60).content
    return tokens, harvest_tensors(data)[0]


def test_concurrent_requests_each_equal_their_solo_run(servers: Servers) -> None:
    """Requests with different steers (each harvesting its stream) at once; an unsteered batchmate's harvest is
    its unsteered run's bits."""
    api = servers.api("graphed")
    harvest = {"values": ["layer_output"], "layers": None, "positions": "all"}
    fields = []
    for number, (mode, norm_match) in enumerate(MODES):
        value, layer = SITES[number % 2]
        item = {"value": value, "layer": layer, "mode": mode, "norm_match": norm_match,
                "vector": servers.vector(20 + number).tolist(), **SETTINGS[mode]}
        fields.append((mode, {"steer": [item], "harvest": harvest}))
    fields.append(("none", {"harvest": harvest}))
    prompts = [PROMPTS[number % len(PROMPTS)] for number in range(len(fields))]
    solo = [_run(api, prompt, field) for prompt, (_, field) in zip(prompts, fields)]
    before = servers.served()
    with ThreadPoolExecutor(len(fields)) as pool:
        together = list(pool.map(lambda pair: _run(api, *pair), zip(prompts, [field for _, field in fields])))
    assert servers.served()[0] == before[0] + len(MODES) and servers.served()[1] == before[1] + len(fields)
    for number, ((mode, _), (tokens, rows), (solo_tokens, solo_rows)) in enumerate(zip(fields, together, solo)):
        assert tokens == solo_tokens, number
        for value in solo_rows:
            assert equal(rows[value], solo_rows[value], mode in ("add", "set", "none")), (number, value)


def prefix_hits(url: str) -> float:
    """vLLM's prefix-cache hits so far, from the server's ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits"))


def _hits_after(url: str, before: float, wait: float = 15.0) -> float:
    """The hits once past `before` (vLLM publishes its metrics a moment after a reply), or after `wait` seconds."""
    deadline = time.monotonic() + wait
    while prefix_hits(url) <= before and time.monotonic() < deadline:
        time.sleep(0.5)
    return prefix_hits(url)


def test_steered_completions_over_a_cached_prefix_equal_the_hook_server(servers: Servers) -> None:
    """Steers without a harvest share vLLM's prefix cache (the server's default): the second run of a prompt reads
    its prefix from the cache and runs only its tail, whose rows the plan marks by position. Tokens and log-probs
    equal the hook server's, bit for bit for add and set, and the ops served every one."""
    long = " ".join([PROMPTS[1]] * 24)  # whole KV blocks to share
    for number, (mode, norm_match) in enumerate(MODES[:4]):
        value, layer = SITES[number % 2]
        item = {"value": value, "layer": layer, "mode": mode, "norm_match": norm_match,
                "vector": servers.vector(50 + number).tolist(), **SETTINGS[mode]}
        runs = {}
        before, hits = servers.served()[0], prefix_hits(servers.urls["graphed"])
        for which in ("graphed", "hooked"):
            api = servers.api(which)
            model = api.models.list().data[0].id
            runs[which] = [api.completions.create(model=model, prompt=long, max_tokens=4, temperature=0, logprobs=1,
                                                  extra_body={"streamscope": {"steer": [item]}}).choices[0]
                           for _ in range(2)]
        assert servers.served()[0] == before + 2, mode
        assert _hits_after(servers.urls["graphed"], hits) > hits, "no prefix-cache hit: the case proves nothing"
        for got, want in zip(runs["graphed"], runs["hooked"]):
            assert got.text == want.text, mode
            logprobs = torch.tensor(got.logprobs.token_logprobs)
            expected = torch.tensor(want.logprobs.token_logprobs)
            assert equal(logprobs, expected, mode in ("add", "set")), (mode, logprobs, expected)


def test_an_sae_clamp_and_a_conditional_steer_fall_back_to_the_hooks(servers: Servers) -> None:
    """Both run on the hooks of the graph server (its ops serve no steer of theirs), a steer of another request
    beside them on the ops; each equals the hook server."""
    generator, features = torch.Generator().manual_seed(30), 96
    sae = SAE(torch.randn(servers.hidden, features, generator=generator) / servers.hidden ** 0.5,
              torch.randn(features, generator=generator) * 0.1,
              torch.randn(features, servers.hidden, generator=generator) / features ** 0.5,
              torch.randn(servers.hidden, generator=generator) * 0.1, "layer_output", 1, "relu")
    servers.graphed.store_sae("graph-relu", sae)
    servers.hooked.store_sae("graph-relu", sae)
    condition = streamscope.Condition("layer_output", 0, servers.vector(40), 0.0)
    steers = [sae.clamp(3, 12.0, positions="all", prompts=[0]),
              streamscope.Steer("layer_output", 1, servers.vector(41), scale=4.0, condition=condition, prompts=[1]),
              steer_of(servers, "ablate", False, "layer_output", 1, 42, prompts=[2])]
    try:
        before = servers.served()
        got = steered_stream(servers.graphed, PROMPTS, steers)
        assert servers.served()[0] == before[0] + 1  # the ablation alone; the clamp and the condition on hooks
        want = steered_stream(servers.hooked, PROMPTS, steers)
        plain = steered_stream(servers.hooked, PROMPTS, [])
        assert got.tokens == want.tokens
        for index in range(len(PROMPTS)):
            rows, other = got.harvest["layer_output"][index], want.harvest["layer_output"][index]
            assert equal(rows, other, False), index
            assert not torch.equal(rows, plain.harvest["layer_output"][index]), index  # each steer acted
    finally:
        servers.graphed.delete_sae("graph-relu")
        servers.hooked.delete_sae("graph-relu")


# ---------------------------------------------------------------- refusals, without a server


def _arguments(**given: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"graph_ops": "true", "additional_config": None, "enforce_eager": False,
                                 "worker_cls": None, "worker_extension_cls": None, **given})


def test_the_command_line_refuses_what_it_cannot_serve_naming_the_fix() -> None:
    with pytest.raises(SystemExit, match="--graph-ops with --taps is not served yet.*drop --taps, or --graph-ops"):
        engine_settings(_arguments(), [], True, ["model.layers.0"], GraphOptions())
    with pytest.raises(SystemExit, match=r"unknown option\(s\) \['bogus'\].*JSON object of GraphOptions' fields"):
        graph_options(_arguments(graph_ops='{"bogus": 1}'))
    with pytest.raises(SystemExit, match="rounds=0"):
        graph_options(_arguments(graph_ops='{"rounds": 0}'))
    args = _arguments(graph_ops='{"rounds": 3}')
    options = graph_options(args)
    assert options == GraphOptions(rounds=3)
    # on a CPU: the CPU worker that inserts the ops, the options and salt in additional_config, eager (hooks fire)
    assert engine_settings(args, [], True, [], options) is True and args.enforce_eager is True
    assert args.worker_cls == GRAPH_WORKERS["cpu"] and args.additional_config["streamscope_graph"]["rounds"] == 3
    # on a GPU: vLLM's defaults (compile, its CUDA graph mode), so hooks do not fire; --enforce-eager keeps them
    gpu = _arguments()
    assert engine_settings(gpu, [], False, [], GraphOptions()) is False and gpu.enforce_eager is False
    assert gpu.worker_cls == GRAPH_WORKERS["gpu"] and getattr(gpu, "compilation_config", None) is None
    assert engine_settings(_arguments(enforce_eager=True), [], False, [], GraphOptions()) is True


def test_a_gpu_server_runs_the_graph_ops_unless_told_otherwise() -> None:
    """Without --graph-ops a GPU server gets the default ops (vLLM's compile and graphs kept); a CPU server, a
    tapped one, an eager one and ``--graph-ops off`` serve every value on hooks."""
    unset = {"graph_ops": None}
    assert graph_options(_arguments(**unset), on_cpu=False) == GraphOptions()
    assert graph_options(_arguments(**unset), on_cpu=True) is None
    assert graph_options(_arguments(**unset), on_cpu=False, tapped=True) is None
    assert graph_options(_arguments(**unset, enforce_eager=True), on_cpu=False) is None
    assert graph_options(_arguments(graph_ops="off"), on_cpu=False) is None
    assert graph_options(_arguments(graph_ops="off"), on_cpu=True) is None
    assert graph_options(_arguments(graph_ops='{"rounds": 3}'), on_cpu=True) == GraphOptions(rounds=3)
    gpu = _arguments(**unset)  # what the default gives the engine: vLLM's own compile and graphs, the ops' worker
    assert engine_settings(gpu, [], False, [], graph_options(gpu, on_cpu=False)) is False
    assert gpu.enforce_eager is False and gpu.worker_cls == GRAPH_WORKERS["gpu"]
    off = _arguments(graph_ops="off")
    assert engine_settings(off, [], False, [], graph_options(off, on_cpu=False)) is True and off.enforce_eager


def test_a_compiled_server_refuses_requests_its_ops_cannot_serve(checkpoints: Any, tmp_path: Any) -> None:
    """Where hooks do not fire (``--graph-ops`` on a GPU), the front end refuses a steer or harvest the ops do not
    serve, naming the field and the fix; what they serve passes."""
    model = StandardizedVLLM(str(checkpoints("llama")), dispatch=False, dtype="float32")
    front = Front(model, Limits(), tmp_path)
    front.graph_ops, front.hooks_fire = GraphOptions(rounds=1), False
    add = {"value": "layer_output", "layer": 1, "mode": "add"}
    front.graph_refusal([add, {**add, "value": "attention_output", "layer": -1}],
                        {"values": ["layer_output"], "layers": [0, 1]})
    refused = [([{**add, "condition": {"value": "layer_output"}}], None, r"steer\[0\]: a conditional or SAE steer"),
               ([{"mode": "sae_clamp", "value": "layer_output", "layer": 1}], None, "conditional or SAE"),
               ([{**add, "value": "attention_norm_output"}], None, r"no graph op edits 'attention_norm_output' at block 1"),
               ([{**add, "value": "final_norm_output", "layer": None}], None, "no graph op edits 'final_norm_output'"),
               ([add, add], None, r"steer\[1\]: 2 steers at layers.1.layer_output; the graph ops take 1"),
               ([], {"values": ["final_norm_output"], "layers": [0]}, "harvest: an SAE harvest, or a value without"),
               ([], {"sae": "relu", "values": None}, "harvest: an SAE harvest")]
    for steers, harvest, message in refused:
        with pytest.raises(RequestError, match=message) as error:
            front.graph_refusal(steers, harvest)
        assert "--enforce-eager" in str(error.value) and error.value.status == 400
    front.hooks_fire = True  # an eager engine: the hooks serve the rest
    front.graph_refusal(*refused[0][:2])


# ---------------------------------------------------------------- the worker where hooks do not fire, in process


@pytest.fixture(scope="module")
def ops_runner(checkpoints: Any) -> Any:
    """vLLM's runner of an in-process engine started as ``--graph-ops`` starts the server's (its CPU worker
    inserting the ops at load, the options in ``additional_config``), to step by hand."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process
        llm = LLM(str(checkpoints("llama")), enforce_eager=True, dtype="float32", enable_prefix_caching=False,
                  max_model_len=256, worker_cls=GRAPH_WORKERS["cpu"], additional_config=engine_config(True, None))
    yield llm.llm_engine.model_executor.driver_worker.worker.model_runner
    del llm


def _request(request_id: str, plan: dict, length: int = 5) -> SimpleNamespace:
    return SimpleNamespace(req_id=request_id, prompt_token_ids=list(range(length)),
                           sampling_params=SimpleNamespace(extra_args={XARG: json.dumps(plan)}))


def _steer(value: str, layer: int, seed: int) -> dict[str, Any]:
    vector = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    return {"value": value, "layer": layer, "vector": vector_bytes(vector), "scale": 1.0, "positions": "all",
            "mode": "add", "generated": True}


def test_where_hooks_do_not_fire_the_worker_refuses_what_the_ops_cannot_serve(ops_runner: Any) -> None:
    """A worker whose hooks do not fire (a compiled server) enters what its ops serve, a request with nothing on
    the hooks; one with work left there (a value without an op, a third steer at a site of two rounds) is refused
    whole, nothing of it left in the plan or hooked. The steps mark the served request's rows, and its harvest
    through the ops completes once its prompt ran."""
    runner = SimpleNamespace(get_model=ops_runner.get_model, model_config=ops_runner.model_config,
                             execute_model=lambda *args, **kwargs: None, _update_states=lambda output: None,
                             input_batch=SimpleNamespace(req_ids=[]), requests={})
    ops = graph_ops_of(ops_runner)
    assert ops is not None
    runner.__dict__[RUNNER_ATTRIBUTE] = ops
    state = ServeState(runner, "llama", folder=None, writer=False, hooks_fire=False)
    served = _steer("layer_output", 1, 1)
    arriving = [_request("served", {"steer": [served], "harvest": {"values": ["layer_output"], "layers": [0, 1],
                                                                     "positions": "all", "id": "h1"}}),
                _request("no-op", {"steer": [served, _steer("attention_norm_output", 0, 2)]}),
                _request("rounds", {"steer": [_steer("layer_mid", 0, seed) for seed in (3, 4, 5)]})]
    for data in arriving:
        runner.requests[data.req_id] = SimpleNamespace(num_computed_tokens=0)
    runner.input_batch.req_ids = ["served", "no-op", "rounds"]
    runner._update_states(SimpleNamespace(scheduled_new_reqs=arriving, finished_req_ids=set(),
                                          num_scheduled_tokens={"served": 5, "no-op": 5, "rounds": 5},
                                          total_num_scheduled_tokens=15))
    assert set(state.live) == {"served"} == set(state.graph.entered) and not state.hooks
    assert ops.plan.live == 1 and ops.plan.bank.live == 1  # the refused requests' slots given back
    lane = ops.plan.lane_of[("layers.1.layer_output", 0)]
    marks = ops.plan.index[:15, lane]
    assert (marks[:5] >= 0).all() and (marks[5:] == -1).all()  # its rows alone, though it plans no hook work
    live = state.live["served"]
    assert not live.written
    runner.execute_model()  # the step's end: the ops' rows handed over, its every position read
    assert live.written
    state.leave("served")
    assert ops.plan.live == 0 and ops.plan.bank.live == 0
