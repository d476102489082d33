"""The vLLM engine itself, on one family (Llama): decode steps, every prompt position's logits,
errors, and the engine running in its own processes. Where and in which dtype: tests/precision.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import matrix
import oracle
import precision
from access import relative_error
import streamscope

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"


@pytest.fixture(scope="module")
def llama(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(precision.DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    yield model, reference, tokenizer, path
    model.close()


@pytest.fixture(scope="module")
def tolerance(llama):
    """CPU float32: the stated number; else measured on this checkpoint and prompt (tests/precision.py)."""
    if not precision.measured():
        return precision.CPU_FLOAT32
    path, ids = llama[3], llama[2](PROMPT, return_tensors="pt").input_ids
    exact = matrix.Reference(path, "llama", ids, device=precision.DEVICE)
    low = matrix.Reference(path, "llama", ids, dtype=precision.low_precision_dtype(), device=precision.DEVICE,
                           context=precision.low_precision)
    return matrix.Tolerances.measured(low, exact, precision.MEASURED_FACTOR).relative


def test_prompt_logits_give_every_position_as_transformers_does(llama, tolerance):
    model, reference, tokenizer, _ = llama
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        every = model.prompt_logits.save()
        sampled = model.logits.save()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(precision.DEVICE)
    expected = oracle.values(reference, "llama", ids)["logits"]
    assert every.shape == expected.shape
    assert relative_error(every, expected) <= tolerance
    # the sampled row's logits come from vLLM's own path: on CPU float32 the same numbers
    assert relative_error(sampled, every[:, -1]) <= (1e-6 if not precision.measured() else tolerance)


def test_prompt_logits_are_read_only_and_say_so(llama):
    model = llama[0]
    with pytest.raises(ValueError, match="computed for the read"):
        with model.trace(PROMPT, temperature=0.0, max_tokens=1):
            model.prompt_logits[:, -1] = 0.0
            model.logits.save()


def test_decode_steps_serve_one_token_each_equal_to_the_full_sequence(llama, tolerance):
    model, reference, tokenizer, _ = llama
    steps = 3
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps) as tracer:
        outputs = list().save()
        for step in tracer.iter[:steps]:
            outputs.append(model.layers[1].layer_output[:, -1:].clone())
        result = tracer.result.save()
    generated = list(result.outputs[0].token_ids)
    assert len(outputs) == steps
    assert [tuple(o.shape) for o in outputs[1:]] == [(1, 1, model.hidden_size)] * (steps - 1)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(precision.DEVICE)
    full = torch.cat([ids, torch.tensor([generated[:-1]], device=ids.device)], dim=1)
    expected = oracle.values(reference, "llama", full)["layer_output"][1]
    prompt_length = ids.shape[1]
    for step, value in enumerate(outputs):
        position = prompt_length - 1 + step
        assert relative_error(value[0, -1], expected[0, position]) <= tolerance, step


def test_a_model_type_without_a_vllm_family_says_how_to_go_on(tmp_path, checkpoints):
    from streamscope.vllm.families import family_for

    with pytest.raises(NotImplementedError, match="engine='transformers'"):
        family_for("not_a_family")


@pytest.mark.parametrize("family, options", [
    ("stablelm", {"qk_layernorm": True}), ("stablelm", {"use_parallel_residual": True}),
    ("stablelm", {"qk_layernorm": True, "use_parallel_residual": True}),  # StableLM 2 12B's
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}), ("gpt2", {"reorder_and_upcast_attn": True}),
    ("gptj", {"tie_word_embeddings": True}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("llama4_text", {"attention_chunk_size": 8})],  # chunks of part of a KV block: 16 tokens at least on any backend
    ids=["stablelm-qk-norm", "stablelm-parallel", "stablelm-both", "gpt2-scaled-by-block", "gpt2-upcast",
         "gptj-tied", "qwen2-some-sliding", "llama4-chunks-under-a-block"])
def test_a_layout_vllms_block_lacks_is_refused_before_the_engine_starts(checkpoints, family, options):
    """Options vLLM's model class for the family does not implement: refused with the option and the fix before
    anything starts, and the checkpoint serves on transformers (its values: the transformers matrix)."""
    path = checkpoints(family, **options)
    with pytest.raises(streamscope.UnsupportedCheckpoint, match="engine='transformers'") as refused:
        streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    assert all(option in str(refused.value) for option in options)
    model = streamscope.load(path)
    with model.trace(PROMPT):
        logits = model.logits.save()
    assert logits.shape[-1] == model.vocab_size


@pytest.mark.skipif(precision.ON_GPU, reason="the refusal is of vLLM's CPU build only: the CUDA build has Mamba's "
                                             "kernels, and its engine runs there (test_families.py on the GPU suite)")
def test_a_family_whose_kernels_the_cpu_build_lacks_is_refused_before_the_engine_starts(checkpoints):
    """Mamba on vLLM's CPU build: the engine would start and fail at its first forward (a server, at its first
    request, with a dead engine). Refused at load and by `streamscope serve` before vLLM starts, with the reason
    and the fix; the checkpoint serves on transformers."""
    path = checkpoints("mamba")
    with pytest.raises(streamscope.UnsupportedCheckpoint, match="engine='transformers'") as refused:
        streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    assert "selective-scan" in str(refused.value)
    served = subprocess.run([sys.executable, "-m", "streamscope", "serve", str(path), "--port", "0"],
                            capture_output=True, text=True, timeout=300)
    assert served.returncode == 2, served.stderr[-2000:]
    assert "streamscope serve:" in served.stderr and "selective-scan" in served.stderr
    assert "engine='transformers'" in served.stderr
    model = streamscope.load(path)
    with model.trace(PROMPT):
        logits = model.logits.save()
    assert logits.shape[-1] == model.vocab_size


#: Llama 4 in a process of its own: its mixture of experts needs vLLM's expert-parallel group, which an in-process
#: engine of a dense model (this module's Llama) left out of the process's parallel state.
CHUNKED = textwrap.dedent('''
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import streamscope

    if __name__ == "__main__":
        path, prompt, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        model = streamscope.load(path, engine="vllm", **settings)
        with model.trace(prompt, temperature=0.0, max_tokens=1):
            logits = model.prompt_logits.save()
        block = model.vllm_entrypoint.llm_engine.vllm_config.cache_config.block_size
        print("RESULT " + json.dumps({"block_size": block, "logits": logits.tolist()}))
        model.close()
''')


def test_llama4_chunks_of_a_quarter_of_the_cpus_block_run_on_blocks_of_the_chunk(checkpoints, tmp_path):
    """Llama 4 attends within chunks (`attention_chunk_size`), which vLLM cuts into whole KV blocks: the engine's
    block divides the chunk (on the CPU, whose default block is 128 tokens, a chunk of 32 gets blocks of 32; on a
    GPU vLLM's block of 16 divides it), and a prompt of several chunks gives the oracle's logits at every position."""
    routing = precision.every_expert("llama4_text") if precision.measured() else {}
    path = checkpoints("llama4_text", attention_chunk_size=32, **routing)
    prompt = "Once upon a time there was a small village by the sea where fishermen sang every morning. " + PROMPT * 3
    ids = AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] > 2 * 32, "the prompt spans too few chunks to test them"
    script = tmp_path / "chunked.py"
    script.write_text(CHUNKED)
    run = subprocess.run([sys.executable, str(script), str(path), prompt, json.dumps(precision.engine_kwargs())],
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert 32 % result["block_size"] == 0
    if not precision.ON_GPU:
        assert result["block_size"] == 32  # streamscope's choice (`blocks_within_chunks`): vLLM's 128 does not divide

    def logits(dtype: torch.dtype, context=contextlib.nullcontext) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(precision.DEVICE).eval()
        with context(), torch.no_grad():
            return model(ids.to(precision.DEVICE)).logits.float()

    expected = logits(torch.float32)
    tolerance = precision.CPU_FLOAT32 if not precision.measured() else precision.from_distance(
        relative_error(logits(precision.low_precision_dtype(), precision.low_precision), expected))
    got = torch.tensor(result["logits"]).reshape(expected.shape).to(expected.device)
    assert relative_error(got, expected) <= tolerance


SCRIPT = textwrap.dedent('''
    import json, os, sys, torch
    import streamscope

    if __name__ == "__main__":
        path, prompt, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        model = streamscope.load(path, engine="vllm", **settings)
        with model.trace(prompt, temperature=0.0, max_tokens=1):
            mid = model.layers[1].layer_mid.save()
            output = model.layers[1].layer_output.save()
            logits = model.logits.save()
        with model.trace(prompt, temperature=0.0, max_tokens=1):
            model.layers[1].layer_mid[:, -1] += 1.0
            edited = model.logits.save()
        print("RESULT " + json.dumps({"pid": os.getpid(), "mid": mid.tolist(), "output": output.tolist(),
                                      "logits": logits.tolist(), "edited": edited.tolist()}))
        model.close()
''')


def test_the_engine_in_its_own_processes_serves_the_same_values(tmp_path, llama):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: the worker is another process that runs the client's envoys."""
    model, reference, tokenizer, path = llama
    script = tmp_path / "multiprocess.py"
    script.write_text(SCRIPT)
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    settings = json.dumps(precision.engine_kwargs())
    run = subprocess.run([sys.executable, str(script), str(path), PROMPT, settings], env=environment,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        mid = model.layers[1].layer_mid.save()
        output = model.layers[1].layer_output.save()
        logits = model.logits.save()
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        model.layers[1].layer_mid[:, -1] += 1.0
        edited = model.logits.save()
    assert torch.equal(torch.tensor(result["mid"]), mid.float().cpu())
    assert torch.equal(torch.tensor(result["output"]), output.float().cpu())
    assert torch.equal(torch.tensor(result["logits"]), logits.float().cpu())
    assert torch.equal(torch.tensor(result["edited"]), edited.float().cpu())
    assert not torch.equal(edited, logits)
