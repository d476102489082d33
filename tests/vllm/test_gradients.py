"""Gradients on vLLM (issue 38, item 12): the engine runs under inference mode and keeps no autograd graph, so a
trace that reads or sets ``.grad`` or opens ``loss.backward()`` is refused before the engine runs, with the fix
(``engine="transformers"``), and the engine serves the next trace.

One engine shared by the module; the oracle is transformers' own float32 forward of the checkpoint (`oracle.py`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import oracle
import precision
from access import relative_error
import streamscope
from streamscope.vllm.model import beside_engine

PROMPT = "The Eiffel Tower is in Paris"
GREEDY = {"temperature": 0.0, "max_tokens": 1}
TOLERANCE = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE] if precision.ON_GPU else precision.CPU_FLOAT32


class Engine:
    def __init__(self, path):
        self.model = streamscope.load(str(path), engine="vllm", **precision.engine_kwargs())
        with beside_engine():
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
        self.expected = oracle.values(reference, "llama", ids)

    def requests_made(self) -> int:
        """How many requests the engine has been given so far (vLLM's own request counter)."""
        return self.model.vllm_entrypoint.request_counter.counter


@pytest.fixture(scope="module")
def engine(checkpoints):
    engine = Engine(checkpoints("llama"))
    yield engine
    engine.model.close()


def serves_the_next_trace(engine: Engine) -> None:
    with engine.model.trace(PROMPT, **GREEDY):
        output = engine.model.layers[1].layer_output.save()
    assert relative_error(output[0], engine.expected["layer_output"][1][0]) <= TOLERANCE


def read_grad(model):
    with model.trace(PROMPT, **GREEDY):
        value = model.layers[1].layer_output
        gradient = value.grad.save()  # noqa: F841


def backward_block(model):
    with model.trace(PROMPT, **GREEDY):
        value = model.layers[1].layer_output
        loss = model.logits.sum()
        with loss.backward():
            gradient = value.grad.save()  # noqa: F841


def assign_grad(model):
    with model.trace(PROMPT, **GREEDY):
        value = model.layers[1].layer_output
        value.grad = torch.zeros_like(value)


def grad_in_an_invoke(model):
    with model.trace(**GREEDY) as tracer:
        with tracer.invoke(PROMPT):
            model.layers[0].layer_output.save()
        with tracer.invoke(PROMPT):
            gradients = [model.layers[block].layer_output.grad for block in range(2)]  # noqa: F841


@pytest.mark.parametrize("trace, used", [(read_grad, ".grad"), (backward_block, ".backward"),
                                         (assign_grad, ".grad"), (grad_in_an_invoke, ".grad")])
def test_a_gradient_is_refused_before_the_engine_runs_naming_the_fix(engine, trace, used):
    before = engine.requests_made()
    with pytest.raises(ValueError, match="inference") as refused:
        trace(engine.model)
    message = str(refused.value)
    assert used in message and 'engine="transformers"' in message and "vLLM" in message
    assert engine.requests_made() == before  # no request reached the engine
    serves_the_next_trace(engine)


def test_a_trace_without_gradients_still_runs_and_matches_the_oracle(engine):
    # An attribute that only contains "grad" (requires_grad) asks for no gradient: the trace runs.
    with engine.model.trace(PROMPT, **GREEDY):
        output = engine.model.layers[1].layer_output
        if not output.requires_grad:
            saved = output.save()
    assert relative_error(saved[0], engine.expected["layer_output"][1][0]) <= TOLERANCE
