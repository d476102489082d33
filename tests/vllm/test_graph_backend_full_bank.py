"""The in-process bulk path with the graph ops when their slot bank is full: on an eager engine (the default, the
suite's) a request the bank cannot place runs whole on the hooks, steered as its plain-hook oracle says, beside a
request the ops serve in the same run; never unsteered. (Where vLLM compiles the model, hooks do not fire and such
a request is refused instead: `LeftOnHooks`, tests/test_graph_backend_compiled.py.)

Each bulk family's checkpoint is loaded with a bank of one slot; two steers with distinct vectors, one prompt each,
run in one harvest: one takes the slot, the other falls back. Both equal transformers' float32 forward edited by a
plain hook at the same site, and a count of what the ops served says exactly one went through them.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import oracle
import precision
import streamscope
from access import relative_error
from bulk_checks import BULK_FAMILIES, PROMPTS
from steer_checks import plain_operation
from streamscope.vllm.graph_backend import graph_ops_of
from streamscope.vllm.model import beside_engine

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="a full slot bank falling back to the hooks of an eager "
                                "engine; on a GPU the bulk engine with graph ops compiles, and a full bank is "
                                "refused there (tests/vllm/test_graph_compiled_load.py runs on both)")

LAYER = 0


class Loaded:
    def __init__(self, family: str, path: Any) -> None:
        self.family = family
        self.model = streamscope.load(path, engine="vllm", graph_ops={"slots": 1}, **precision.engine_kwargs())
        runner = self.model.vllm_entrypoint.llm_engine.model_executor.driver_worker.worker.model_runner
        self.ops = graph_ops_of(runner)
        with beside_engine():
            self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def oracle_stream(self, prompt: str, steer: streamscope.Steer) -> list[torch.Tensor]:
        """Transformers' float32 ``layer_output`` of every block, ``[positions, hidden]``, `steer` added at every
        position by a plain hook."""
        ids = torch.tensor([self.tokenizer(prompt).input_ids])
        length = ids.shape[1]
        module, where, factor = oracle.site(self.reference, self.family, "layer_output", LAYER)
        assert factor is None

        def edit(tensor: torch.Tensor) -> None:
            stream = tensor.reshape(1, length, tensor.shape[-1])[0]
            stream[:] = plain_operation(stream, steer)
        with ExitStack() as stack, torch.no_grad():
            stack.enter_context(oracle.hooked(module, where, edit))
            found = oracle.values(self.reference, self.family, ids)["layer_output"]
        return [tensor.reshape(length, -1) for tensor in found]


@pytest.fixture(scope="module", params=list(BULK_FAMILIES))
def loaded(request: Any, checkpoints: Any) -> Any:
    found = Loaded(request.param, checkpoints(request.param))
    yield found
    found.model.close()


def test_a_request_the_full_bank_cannot_place_runs_on_the_hooks_steered(loaded: Loaded) -> None:
    hidden = loaded.model.hidden_size
    steers = [streamscope.Steer("layer_output", LAYER, torch.randn(hidden, generator=torch.Generator().manual_seed(seed)),
                                scale=2.0, positions="all", prompts=[index])
              for index, seed in enumerate((5, 6))]
    before = loaded.ops.served["steers"]
    got = loaded.model.harvest(PROMPTS[:2], "layer_output", positions="all", steer=steers, progress=False)
    assert loaded.ops.served["steers"] == before + 1  # one request on the ops, the other on the hooks
    assert loaded.ops.plan.bank.live == 0  # the slot given back
    for index, steer in enumerate(steers):
        expected = loaded.oracle_stream(PROMPTS[index], steer)
        rows = got["layer_output"][index]  # [blocks, positions, hidden]
        for block, want in enumerate(expected):
            assert relative_error(rows[block].reshape(want.shape), want) <= precision.CPU_FLOAT32, (index, block)
        ids = torch.tensor([loaded.tokenizer(PROMPTS[index]).input_ids])
        with torch.no_grad():
            plain = oracle.values(loaded.reference, loaded.family, ids)["layer_output"][-1].reshape(expected[-1].shape)
        assert relative_error(expected[-1], plain) > 10 * precision.CPU_FLOAT32  # the steer moved the stream
