"""Engines of one process: closing one gives its memory back and leaves the others serving; a closed engine
says so; the process starts the next engine, of any family, afterwards."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import precision
import streamscope
from access import relative_error

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
GREEDY = {"temperature": 0.0, "max_tokens": 1}


def _read(model):
    with model.trace(PROMPT, **GREEDY):
        output = model.layers[0].layer_output.save()
        logits = model.logits.save()
    return output, logits


def _held(model):
    """Whether the engine still holds its memory, asked again after close: where the engine runs in this process,
    whether its model's weights are alive; on a GPU, whether the GPU memory it took is still taken."""
    core = model.vllm_entrypoint.llm_engine.engine_core
    if hasattr(core, "engine_core"):  # in this process
        runner = core.engine_core.model_executor.driver_worker.worker.model_runner
        weight = weakref.ref(next(runner.model.parameters()))
        return lambda: weight() is not None
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    return lambda: free is not None and torch.cuda.mem_get_info()[0] < free + (1 << 30)


def test_closing_one_engine_leaves_the_other_serving_and_frees_its_weights(checkpoints):
    first = streamscope.load(checkpoints("llama"), engine="vllm", **precision.engine_kwargs())
    second = streamscope.load(checkpoints("gpt2"), engine="vllm", **precision.engine_kwargs())
    before = _read(second)
    held = _held(first)
    first.close()
    gc.collect()
    assert not held(), "the closed engine's memory is still held"
    after = _read(second)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    with pytest.raises(RuntimeError, match=r"closed.*streamscope\.load"):
        with first.trace(PROMPT, **GREEDY):
            first.logits.save()
    first.close()  # a second close does nothing
    second.close()


def test_the_process_starts_engines_of_other_families_after_closing(checkpoints):
    for family in ("llama", "mixtral", "gemma2"):  # the mixture of experts needs process state of its own kind
        model = streamscope.load(checkpoints(family), engine="vllm", **precision.engine_kwargs())
        output, logits = _read(model)
        assert output.shape[-1] == model.hidden_size and torch.isfinite(logits).all()
        model.close()


def test_a_start_that_fails_half_way_leaves_the_process_able_to_start_the_next(checkpoints, monkeypatch):
    # A KV cache larger than the machine fails the start after vLLM has brought up its parallel state, built
    # for this dense model: the mixture of experts started next needs an expert-parallel group it lacks.
    if torch.cuda.is_available():
        too_large = {"kv_cache_memory_bytes": 1024}  # 1 KiB: no room for one request
    else:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "100000")
        too_large = {}
    with pytest.raises(ValueError, match="memory"):
        streamscope.load(checkpoints("llama"), engine="vllm", **{**precision.engine_kwargs(), **too_large})
    monkeypatch.undo()
    model = streamscope.load(checkpoints("mixtral"), engine="vllm", **precision.engine_kwargs())
    output, logits = _read(model)
    assert torch.isfinite(logits).all()
    model.close()


def test_the_transformers_engine_loads_a_family_after_its_vllm_engine_closed(checkpoints):
    """vLLM's Transformers backend (GPT-NeoX on the CPU build) decorates transformers' own classes for good; once
    the process's last engine has closed, streamscope's transformers engine still builds and runs the family,
    and computes what the vLLM engine did."""
    path = checkpoints("gpt_neox")
    engine = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    _, served = _read(engine)
    engine.close()
    model = streamscope.load(path, device_map=precision.DEVICE)
    with model.trace(PROMPT):
        logits = model.logits.save()
    tolerance = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE] if precision.measured() else precision.CPU_FLOAT32
    error = relative_error(served.reshape(-1), logits[0, -1])
    assert error <= tolerance, error
