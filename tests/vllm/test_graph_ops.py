"""The graph ops inside vLLM's CPU engine (eager): a steer and a harvest through them equal today's bulk path.

`streamscope.vllm.graph_wiring` puts the ops at every block's stream
boundaries of a plain vLLM engine (vLLM's own runner and forwards, as the
server runs); a `GraphPlan` is filled from each step's spans, read off the
runner as the server's worker reads them. Each steer, at one site, is held to
`model.harvest(..., steer=[...])` of the bulk path on a streamscope engine of
the same checkpoint, every block's layer_output harvested through the harvest
op, within `CPU_FLOAT32`; the prompt batched beside it without a steer is the
same bits as in a batch where nobody steers. Families: Llama (a fused block,
the stream in two halves) and GPT-2 (the stream whole).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import precision
import streamscope
from streamscope import nnsight_seam as seam
from streamscope import vllm_seam
from streamscope.bulk.apply import Span
from streamscope.bulk import spec
from streamscope.bulk.spec import Steer
from streamscope.vllm.bulk import worker_tree
from streamscope.vllm.graph_plan import GraphPlan, PlannedSteer
from streamscope.vllm.row_rules import RowRule
from streamscope.vllm.graph_ops import cache_salt, ops_source
from streamscope.vllm.families import envoys_for, family_for
from streamscope.vllm.graph_wiring import (StreamAt, graph_sites, insert_ops, site_name, stretches_of, unserved,
                                           wiring_source)
from streamscope.values import ComputedValue, StreamValue

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="the ops are inserted by these tests' own hooks into an "
                                "eager engine, which is the CPU build's; on a GPU the ops are checked captured in "
                                "CUDA graphs and compiled by scripts/graph_ops_gpu_check.py, and are not yet "
                                "wired into the graphed engine (issue 39, docs/graph-ops.md)")

PROMPTS = ["Rome is in Italy, Berlin is in Germany", "def add(a, b): return a + b"]
KEY = "streamscope_graph_key"
#: (value, block, mode, norm_match, positions): every mode, every value an op sits at, plain and norm-matched.
CASES = [("layer_output", 0, "add", False, "all"), ("layer_mid", 1, "set", True, "all"),
         ("layer_input", 1, "ablate", False, "all_but_first"), ("mlp_input", 0, "clamp", False, "all"),
         ("self_attn.attention_output", 0, "ablate", True, "last"), ("mlp.mlp_output", 1, "clamp", True, [1, 3])]
SETTINGS = {"add": {"scale": 0.8}, "set": {"scale": 1.5}, "ablate": {"scale": 1.0}, "clamp": {"projection": 2.0}}


def graph_served(family: str, value: str) -> bool:
    """Whether the graph ops sit at `value` on `family`'s vLLM blocks, read off the family's own module: the kind
    its spec composes for the value's envoy (the block kind with the family's layout, or the sublayer's kind),
    which must declare the value, not list it as unserved, and hold it in a form the ops take (`unserved`)."""
    role, _, name = value.rpartition(".")
    kind = envoys_for(family_for(family).SPEC).get(role or "layers.*")
    descriptor = getattr(kind, name, None)
    if not isinstance(descriptor, StreamValue) or isinstance(descriptor, ComputedValue):
        return False
    return name not in kind.UNSERVED and unserved(SimpleNamespace(descriptor=descriptor)) is None


def pytest_generate_tests(metafunc: Any) -> None:
    """A family's class runs the cases at values its blocks serve to the ops (`graph_served`), and only those: no
    case is skipped when it runs."""
    if "case" in metafunc.fixturenames:
        served = [case for case in CASES if graph_served(metafunc.cls.FAMILY, case[0])]
        metafunc.parametrize("case", served, ids=[f"{case[2]}-{case[0]}" for case in served])



def closed_over(function: Any) -> list[Any]:
    """The values a function's closure holds."""
    return [cell.cell_contents for cell in function.__closure__ or ()]


class GraphEngine:
    """A plain vLLM engine with the ops at every site, its plan filled from each step's spans."""

    def __init__(self, path: str, family: str) -> None:
        from vllm import LLM

        self.llm = LLM(path, enforce_eager=True, dtype="float32", enable_prefix_caching=False,
                       enable_chunked_prefill=False, max_model_len=256, max_num_batched_tokens=256)
        self.runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        root = seam.uninstrumented(self.runner.get_model(), lambda module: worker_tree(module, family))
        self.sites, self.skipped = graph_sites(root)
        self.blocks = len(root.layers)
        self.outputs = [site_name("layer_output", layer) for layer in range(self.blocks)]
        parameter = next(self.runner.get_model().parameters())
        self.plan = GraphPlan(list(self.sites), 1, self.runner.max_num_tokens,
                              self.runner.model_config.get_hidden_size(), parameter.dtype, parameter.device,
                              slots=8, harvest_sites=self.outputs)
        self.chains = stretches_of(family_for(family))
        self.inserted = insert_ops(self.plan, self.sites, self.chains)
        self.keys: dict[str, Any] = {}
        self.pending: Any = None
        vllm_seam.after_schedule(self.runner, self.observe)

    def observe(self, scheduler_output: Any) -> None:
        self.settle()  # the last step has run: its harvest rows are in the buffers until this step's replay
        for data in scheduler_output.scheduled_new_reqs:
            key = (getattr(data.sampling_params, "extra_args", None) or {}).get(KEY)
            if key is not None:
                self.keys[data.req_id] = key
        counts, spans, start = scheduler_output.num_scheduled_tokens, [], 0
        for request_id in self.runner.input_batch.req_ids:
            count = counts.get(request_id)
            if count is None:
                continue
            spans.append(Span(self.keys.get(request_id), start, count,
                              self.runner.requests[request_id].num_computed_tokens))
            start += count
        self.pending = self.plan.step(spans)

    def settle(self) -> None:
        if self.pending is not None:
            self.plan.settle(self.plan.copy_out(self.pending))
            self.pending = None

    def harvest(self, token_ids: list[list[int]], steers: dict[int, list[PlannedSteer]]) -> list[torch.Tensor]:
        """Each prompt's layer_output at every block and position, ``[blocks, positions, hidden]``, with `steers`
        (by prompt) through the ops; one token is generated, so the prompts' prefill is the step harvested."""
        from vllm import SamplingParams

        for number, ids in enumerate(token_ids):
            self.plan.enter(number, steers.get(number, ()), harvest_positions=range(len(ids)))
        try:
            self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids],
                              [SamplingParams(max_tokens=1, temperature=0, extra_args={KEY: number})
                               for number in range(len(token_ids))], use_tqdm=False)
            self.settle()
            taken = [self.plan.take(number) for number in range(len(token_ids))]
        finally:
            for number in range(len(token_ids)):
                self.plan.leave(number)
        assert all(tensor is not None for tensor in taken)
        return [tensor for tensor in taken if tensor is not None]


@pytest.fixture(scope="class")
def engines(request: Any, checkpoints: Any) -> Any:
    """A family's streamscope engine and its plain engine with the ops, shared by the family's class."""
    family = request.cls.FAMILY
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = checkpoints(family)
    model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    graph = GraphEngine(str(path), family)
    yield family, model, graph
    graph.inserted.remove()
    model.close()
    del graph


def vector(width: int, seed: int) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed))


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= precision.CPU_FLOAT32 * float(want.abs().max())


class OnAFamily:
    """The ops on one family's engines: a subclass per family names it (`FAMILY`)."""

    FAMILY = ""

    def test_ops_sit_at_every_boundary(self, engines: Any) -> None:
        family, _, graph = engines
        for layer in range(graph.blocks):
            for value in ("layer_input", "layer_mid", "layer_output", "self_attn.attention_output", "mlp.mlp_output"):
                assert site_name(value, layer) in graph.sites, (family, value, graph.skipped)
        assert graph.inserted.handles
        # The salt the engine's compile cache takes: this set of ops at these sites, with the ops' and hooks' code.
        assert graph.inserted.salt == cache_salt(list(graph.sites), 1, graph.outputs,
                                                 ops_source() + wiring_source() + repr(graph.inserted.chains))

    def test_the_hooks_read_only_plain_values(self, engines: Any) -> None:
        """What the traced hooks read of a site is a `StreamAt` (a tuple of plain values), never the site or its
        descriptor: vLLM 0.22's torch (2.11) compiles the hooks with a dynamo that stops at an instance attribute
        whose value has ``__get__`` (the GPU suite's first compiled run of the ops failed so on every family)."""
        _, _, graph = engines
        model = graph.runner.get_model()
        hooks = [hook for module in model.modules()
                 for hook in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
                 if hook.__qualname__.startswith(("_before.", "_after."))]
        assert len(hooks) == len(graph.inserted.handles)
        kinds = []
        works = []
        for hook in hooks:
            # Nothing in default arguments: torch 2.11 cannot load back from vLLM's AOT cache a graph whose guards
            # read a function's defaults (the GPU server compiled again at every start).
            (run,) = closed_over(hook)
            assert hook.__defaults__ is None and run.__defaults__ is None
            items = next(value for value in closed_over(run) if isinstance(value, list))
            works.append(items)
            for kind, at, carried in items:
                kinds.append(kind)
                assert kind in ("edit", "harvest", "edit_harvest", "stretch") and type(at) is StreamAt
                assert all(part is None or isinstance(part, (bool, tuple)) for part in at), at
                if kind == "edit":
                    assert all(isinstance(tensor, torch.Tensor) for tensor in carried)
                    continue
                if kind != "stretch":  # the whole pool, never a view of part of it, and the site's column
                    *slots, pool, targets = carried
                    assert all(isinstance(tensor, torch.Tensor) for tensor in slots)
                    assert pool is graph.plan.pool and targets.shape == (graph.plan.max_rows,)
                    assert targets.untyped_storage().data_ptr() == graph.plan.index.untyped_storage().data_ptr()
                    continue
                # a chain: the plan's index and harvest pool, then plain lists and a count the graph holds
                index, pool, lanes, rounds, harvest_lanes, fused = carried
                assert index is graph.plan.index and pool is graph.plan.pool and type(rounds) is int
                assert all(type(item) is int for item in lanes + harvest_lanes)
                assert all(type(item) is bool for item in fused)
        plan = graph.inserted.plan
        # One launch a site where a site is alone (its rounds and its harvest in one op), one a chain: every site
        # of the plan in exactly one of them.
        joined = [name for chain in graph.inserted.chains for name in chain]
        assert len(joined) == len(set(joined)) and "harvest" not in kinds
        assert len(kinds) - kinds.count("stretch") + len(joined) == len(plan.sites)
        assert kinds.count("stretch") == len(graph.inserted.chains)
        assert all(carried[0].shape == (plan.max_rows, plan.rounds)
                   for items in works for kind, _, carried in items if kind != "stretch")

    def test_the_chains_are_the_family_s_runs(self, engines: Any) -> None:
        """The sites one launch serves: on a fused block, a block's attention output with its layer_mid, and its MLP
        output, its output and the next block's input (the last block's without); on a whole stream, a block's
        output and the next block's input. So a fused block costs 3 launches (2 where ``mlp_input`` is its own),
        a whole stream's 5."""
        family, _, graph = engines
        chains = graph.inserted.chains
        last = graph.blocks - 1
        if family == "llama":
            want = [[site_name(value, layer) for value in ("self_attn.attention_output", "layer_mid")]
                    for layer in range(graph.blocks)]
            want += [[site_name("mlp.mlp_output", layer), site_name("layer_output", layer)]
                     + ([site_name("layer_input", layer + 1)] if layer < last else []) for layer in range(graph.blocks)]
        else:
            want = [[site_name("layer_output", layer), site_name("layer_input", layer + 1)] for layer in range(last)]
        assert sorted(chains) == sorted(want), (family, chains)

    def test_steer_through_the_ops_equals_the_bulk_path(self, engines: Any, case: tuple) -> None:
        family, model, graph = engines
        value, layer, mode, norm_match, positions = case
        name = site_name(value, layer)
        assert name in graph.sites, (family, value, graph.skipped.get(name))  # the family's kinds said it is served
        steer = Steer(value, layer, vector(model.hidden_size, 5), mode=mode, norm_match=norm_match, positions=positions,
                      max_dose=None, prompts=[0], **SETTINGS[mode])
        bulk = model.harvest(PROMPTS, "layer_output", positions="all", steer=[steer], progress=False)["layer_output"]
        token_ids = spec.token_ids(model, PROMPTS)
        operation = steer.operation(torch.float32, "cpu")
        planned = PlannedSteer([name], operation, RowRule.of_steer(steer, len(token_ids[0]), 0), repr(case))
        steered = graph.harvest(token_ids, {0: [planned]})
        plain = graph.harvest(token_ids, {})
        assert steered[0].shape == bulk[0].shape
        assert close(steered[0], bulk[0]), (family, case)
        assert not close(plain[0], bulk[0])  # the steer changed the run: the comparison above can fail
        # The prompt batched beside the steered one: bit for bit its run in a batch nobody steers.
        assert torch.equal(steered[1], plain[1])
        assert close(plain[1], bulk[1])


class TestLlama(OnAFamily):
    """A fused block: the stream in two halves."""

    FAMILY = "llama"


class TestGpt2(OnAFamily):
    """The stream whole."""

    FAMILY = "gpt2"


def test_the_served_cases_are_read_off_the_families_kinds() -> None:
    # Every case on the two families here; a value a family's block kind scales (Granite's attention output,
    # which the ops leave to the hook path) or does not declare, not.
    assert all(graph_served(family, case[0]) for family in ("llama", "gpt2") for case in CASES)
    assert graph_served("granite", "layer_output") and not graph_served("granite", "self_attn.attention_output")
    assert not graph_served("llama", "self_attn.head_results") and not graph_served("llama", "nonesuch")
