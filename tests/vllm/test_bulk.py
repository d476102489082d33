"""The bulk path on vLLM: harvests and steered generation applied in the worker by token span.

One engine per family (fused Llama, whole-stream GPT-2, parallel GPT-J), held
to the oracle (transformers' forward read with torch hooks) and to traces of
the same prompts on the same engine, which the bulk path must equal bit for
bit: the same batch runs the same kernels, and the bulk path reads and writes
through the same value descriptors.
"""

from __future__ import annotations

import pytest
import torch

import bulk_checks
from access import relative_error
import bulk_engines
from bulk_checks import BULK_FAMILIES, PROMPTS, RELATIVE, ROUNDING
import precision
import streamscope

STEPS = 4
GREEDY = {"temperature": 0.0, "max_tokens": 1}


engine = bulk_engines.fixture("vllm", BULK_FAMILIES)


def test_a_harvest_equals_the_transformers_values(engine):
    bulk_checks.check_harvest_equals_the_oracle(engine.model, engine.reference, engine.tokenizer, engine.family)


@pytest.mark.parametrize("positions", ["all", "last", [0, -2]])
def test_a_harvest_equals_the_trace_of_the_same_prompts_bit_for_bit(engine, positions):
    # "all" reads each prompt's rows as one slice; "last" and [0, -2], the harvests a server sees most, read rows
    # scattered over the step's batch (`Summed.stream_rows`).
    model = engine.model
    names = ["layer_input", "attention_output", "mlp_output", "layer_output"]
    harvest = model.harvest(PROMPTS, names, positions=positions, progress=False)
    picked = slice(None) if positions == "all" else [-1] if positions == "last" else positions
    with model.trace(**GREEDY) as tracer:
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                reads = []
                for layer in model.layers:
                    reads += [layer.layer_input, layer.self_attn.attention_output, layer.mlp.mlp_output,
                              layer.layer_output]
                traced = torch.stack(reads).save()
    for index in range(len(PROMPTS)):
        for block in range(model.num_layers):
            for slot, name in enumerate(names):
                expected = traced[index][block * len(names) + slot, 0].cpu()[picked]
                assert torch.equal(harvest[name][index][block], expected), (index, block, name)


def test_head_results_on_the_bulk_path_equal_the_trace(engine):
    bulk_checks.check_head_results_on_the_bulk_path(engine.model)


def test_positions_select_the_same_rows(engine):
    bulk_checks.check_positions(engine.model)


def test_shards_on_disk_equal_the_harvest_in_memory(engine, tmp_path):
    bulk_checks.check_shards(engine.model, tmp_path / "harvest")


def test_shards_are_bounded_in_bytes_by_default(engine, tmp_path, monkeypatch):
    bulk_checks.check_shards_bounded_in_bytes(engine.model, tmp_path / "harvest", monkeypatch)


def test_a_failed_harvest_to_a_folder_leaves_no_index(engine, tmp_path, monkeypatch):
    from streamscope.vllm import bulk as engine_bulk

    bulk_checks.check_a_failed_harvest_leaves_no_index(engine.model, tmp_path / "harvest", monkeypatch,
                                                       engine_bulk)


def steered_trace(model, prompt, steers, steps, harvest_block=None):
    """The reference: a trace that adds (or sets) each steer's vector at every step, reading the logits."""
    deltas = [(steer.layer, steer.value, steer.delta(torch.float32, "cpu"), steer.mode) for steer in steers]
    with model.trace(prompt, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        logits = list().save()
        harvested = list().save()
        for step in tracer.iter[:steps]:
            for layer, value, delta, mode in deltas:
                envoy = model.layers[layer].mlp if value == "mlp_output" else model.layers[layer]
                name = "mlp_output" if value == "mlp_output" else value
                current = getattr(envoy, name)
                change = delta.to(device=current.device, dtype=current.dtype)  # the bulk path's own rounding
                if mode == "add":
                    current[:, :] += change
                else:
                    current[:, :] = change
                if harvest_block is not None and layer == harvest_block and value == "layer_output":
                    harvested.append(current.clone())
            logits.append(model.logits[0].clone())
    return torch.stack(list(logits)).cpu(), list(harvested)


def test_a_steered_generation_equals_a_trace_that_adds_the_vector_at_every_step(engine):
    model = engine.model
    torch.manual_seed(0)
    steer = streamscope.Steer("layer_output", 1, torch.randn(model.hidden_size), scale=2.0, positions="all")
    result = model.generate(PROMPTS[1:2], max_tokens=STEPS, steer=[steer], return_logits=True, ignore_eos=True,
                            progress=False)
    expected, _ = steered_trace(model, PROMPTS[1], [steer], STEPS)
    assert result.logits[0].shape == (STEPS, model.vocab_size)
    assert torch.equal(result.logits[0], expected)
    plain = model.generate(PROMPTS[1:2], max_tokens=STEPS, return_logits=True, ignore_eos=True, progress=False,
                           harvest={"values": "layer_output", "layers": [0]})
    assert (plain.logits[0] - result.logits[0]).abs().max() > 1e-3  # the steer did something


def test_other_requests_in_the_batch_are_untouched(engine):
    model = engine.model
    torch.manual_seed(1)
    steer = streamscope.Steer("layer_output", 0, torch.randn(model.hidden_size), scale=3.0, prompts=[2])
    options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False}
    steered = model.generate(PROMPTS, steer=[steer], **options)
    plain = model.generate(PROMPTS, harvest={"values": "layer_output", "layers": [0]}, **options)
    for index in range(len(PROMPTS)):
        same = torch.equal(steered.logits[index], plain.logits[index])
        assert same == (index != 2), index
    solo = model.generate(PROMPTS[2:3], steer=[streamscope.Steer("layer_output", 0, steer.vector, scale=3.0)],
                          **options)
    assert (solo.logits[0] - steered.logits[2]).abs().max() <= RELATIVE * solo.logits[0].abs().max()


def test_several_steers_and_a_harvest_in_one_run(engine):
    model = engine.model
    torch.manual_seed(2)
    steers = [
        streamscope.Steer("layer_output", 0, torch.randn(model.hidden_size), scale=1.5, positions="all"),
        streamscope.Steer("mlp_output", 1, torch.randn(model.hidden_size), mode="set", positions="all"),
        streamscope.Steer("layer_output", 1, torch.randn(model.hidden_size), scale=-0.5, positions="all"),
    ]
    result = model.generate(PROMPTS[:1], max_tokens=STEPS, steer=steers, return_logits=True, ignore_eos=True,
                            harvest={"values": "layer_output", "layers": [1], "positions": "all"}, progress=False)
    expected, harvested = steered_trace(model, PROMPTS[0], steers, STEPS, harvest_block=1)
    assert torch.equal(result.logits[0], expected)
    # The harvest reads the prompt after the steers at its site: the stream the model carries on, whose
    # fused halves hold the edit as hidden + residual, so it matches the trace's edited copy to rounding.
    assert relative_error(result.harvest["layer_output"][0][0], harvested[0][0].cpu()) <= ROUNDING


def test_bad_specs_fail_before_the_engine_runs_and_it_serves_on(engine):
    bulk_checks.check_bad_specs_fail_before_running(engine.model, engine.family)


#: A clean and corrupted prompt of the same length, patched in another process and in this one.
PATCH_PAIR = ("Paris is in Italy", "Rome is in Italy")

MULTIPROCESS_SCRIPT = f"PATCH_PAIR = {PATCH_PAIR!r}\n" + '''
import json, sys
import torch
import streamscope

if __name__ == "__main__":
    path, prompts, vector = sys.argv[1], json.loads(sys.argv[2]), torch.tensor(json.loads(sys.argv[3]))
    model = streamscope.load(path, engine="vllm", **json.loads(sys.argv[4]))
    harvest = model.harvest(prompts, "layer_output", positions="all", progress=False)
    steer = streamscope.Steer("layer_output", 1, vector, prompts=[0])
    result = model.generate(prompts, max_tokens=3, steer=[steer], return_logits=True, ignore_eos=True,
                            progress=False)
    # Patches: one request each with its own set steer, their vectors carried stacked (more than PACKED_STEERS).
    patched = streamscope.patch(model, *PATCH_PAIR, answer=3, wrong=4, progress=False)
    print("RESULT " + json.dumps({"harvest": [t.tolist() for t in harvest["layer_output"]],
                                  "logits": [t.tolist() for t in result.logits],
                                  "patch": patched.effects.tolist()}))
    model.close()
'''


def test_the_bulk_path_runs_with_the_engine_in_another_process(engine, tmp_path):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 (the GPU default): the requests reach the worker by RPC (a harvest, a steered
    generation, and a patch call, whose many set steers travel with their vectors stacked)."""
    if engine.family != "llama":
        pytest.skip("one family is enough for the transport; the values are the in-process tests'")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model = engine.model
    vector = torch.linspace(-1, 1, model.hidden_size)
    script = tmp_path / "bulk_multiprocess.py"
    script.write_text(MULTIPROCESS_SCRIPT)
    root = str(Path(streamscope.__file__).parents[1])
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                   "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    prompts = PROMPTS[:3]
    run = subprocess.run([sys.executable, str(script), str(engine.path),
                          json.dumps(prompts), json.dumps(vector.tolist()), json.dumps(precision.engine_kwargs())],
                         env=environment, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    remote = json.loads(lines[-1][len("RESULT "):])
    harvest = model.harvest(prompts, "layer_output", positions="all", progress=False)
    result = model.generate(prompts, max_tokens=3, steer=[streamscope.Steer("layer_output", 1, vector, prompts=[0])],
                            return_logits=True, ignore_eos=True, progress=False)
    patched = streamscope.patch(model, *PATCH_PAIR, answer=3, wrong=4, progress=False)
    assert patched.effects.numel() >= 8  # enough patches that the plan carries their vectors stacked
    for index in range(len(prompts) + 1):
        if index == len(prompts):
            pairs = ((torch.tensor(remote["patch"]), patched.effects),)
        else:
            pairs = ((torch.tensor(remote["harvest"][index]), harvest["layer_output"][index]),
                     (torch.tensor(remote["logits"][index]), result.logits[index]))
        for theirs, mine in pairs:
            if precision.ON_GPU:
                # Another engine, in another process, scheduling on its own: a step may batch the requests
                # otherwise, and a GPU's kernels then tile their sums otherwise (README, "Batched requests").
                assert relative_error(theirs, mine) <= RELATIVE, index
            else:
                assert torch.equal(theirs, mine), index


def test_a_run_with_nothing_to_apply_reads_no_spans_and_one_recording_logits_does(engine, monkeypatch):
    """A plain `generate` (no steer, no harvest, no logits) has nothing to do at any step: the worker reads none of
    the scheduler's spans (256 requests' worth each step: with the plan's walk over them, 0.44 ms of host time a
    step on the H200's host); asked for logits, or given a steer, it reads them."""
    import streamscope.vllm.bulk as bulk
    from streamscope import vllm_seam

    if not bulk._in_process():
        # (the CPU suite's engines run in this process; the GPU suite's run in their own, where a patch here
        # would count nothing and the test could not fail)
        pytest.skip("counts the worker's reads of the spans by a patch in this process; the engine runs in another")
    calls = []
    spans = vllm_seam.scheduled_spans
    monkeypatch.setattr(vllm_seam, "scheduled_spans", lambda *args: calls.append(1) or spans(*args))
    model = engine.model
    plain = model.generate(PROMPTS, max_tokens=3, progress=False)
    assert not calls
    recorded = model.generate(PROMPTS, max_tokens=3, return_logits=True, progress=False)
    assert calls and recorded.tokens == plain.tokens and len(recorded.logits) == len(PROMPTS)
    before = len(calls)
    model.generate(PROMPTS, max_tokens=3, progress=False,
                   steer=[streamscope.Steer("layer_output", 0, torch.ones(model.hidden_size))])
    assert len(calls) > before  # a run with work reads them


def test_a_steer_at_chosen_prompt_positions_edits_those_rows_only(engine):
    # Rows that are not one block (the first and last position of each prompt): an index, not a slice.
    model = engine.model
    torch.manual_seed(3)
    steer = streamscope.Steer("layer_output", 0, torch.randn(model.hidden_size), scale=2.0, positions=[0, -1],
                              generated=False)
    prompts = PROMPTS[:3]
    result = model.generate(prompts, max_tokens=1, steer=[steer], return_logits=True, progress=False)
    delta = steer.delta(torch.float32, "cpu")
    lengths = [len(engine.tokenizer(prompt).input_ids) for prompt in prompts]
    with model.trace(**GREEDY) as tracer:
        for prompt, length in zip(prompts, lengths):
            with tracer.invoke(prompt):
                stream = model.layers[0].layer_output
                stream[:, [0, length - 1]] += delta.to(device=stream.device, dtype=stream.dtype)
                logits = model.logits.save()
    for index in range(len(prompts)):
        assert torch.equal(result.logits[index][0], logits[index][0].cpu()), index


def test_generate_as_a_with_block_is_nnsight_generate_and_called_a_generation(engine):
    model = engine.model
    with model.generate(PROMPTS[0], temperature=0.0, max_tokens=2):
        traced = model.layers[0].layer_output.save()
    assert traced.shape[0] == 1 and traced.shape[-1] == model.hidden_size
    outputs = model.generate(PROMPTS[:2], temperature=0.0, max_tokens=2, ignore_eos=True, progress=False)
    assert isinstance(outputs, streamscope.Generation)
    assert len(outputs.tokens) == 2 and all(len(tokens) == 2 for tokens in outputs.tokens)


def test_a_neuron_patch_under_tensor_parallelism_is_not_a_bulk_set():
    """Each rank holds a share of the MLP's neurons, so `streamscope.patch` keeps a neuron patch on the trace route
    there (`settable` says why) rather than a bulk set the ranks' shards could not take."""
    from streamscope.vllm.bulk import settable

    class TwoRanks:
        tensor_parallel_size = 2

    for value in ("mlp.neurons", "mlp.neurons_pre"):
        reason = settable(TwoRanks(), value, 0)
        assert reason is not None and "tensor parallelism" in reason and value in reason


def test_prefix_caching_never_serves_a_steered_or_harvested_request_from_another_requests_blocks(engine):
    """With prefix caching on, a steered request of a prompt whose blocks an unsteered run cached equals the same
    steer on an engine without the cache, and a harvest of it reads every position: each such request runs under a
    cache salt of its own (`vllm.bulk._salted`), so no KV block computed under another steer (or none) is reused."""
    model = engine.model
    long = " ".join(PROMPTS * 4)  # several whole KV blocks, so the unsteered run's blocks are cached and reusable
    assert len(model.tokenizer(long)["input_ids"]) >= 48
    steer = streamscope.Steer("layer_output", 1, torch.linspace(-1, 1, model.hidden_size))
    sampling = {"max_tokens": 3, "return_logits": True, "ignore_eos": True, "progress": False}
    exact = model.generate([long], steer=[steer], **sampling).logits[0]
    exact_harvest = model.harvest([long], "layer_output", positions="all", progress=False)["layer_output"][0]
    cached = streamscope.load(engine.path, engine="vllm", enable_prefix_caching=True, **precision.engine_kwargs())
    try:
        plain = cached.generate([long], **sampling).logits[0]  # fills the cache with unsteered blocks
        steered = cached.generate([long], steer=[steer], **sampling).logits[0]
        harvest = cached.harvest([long], "layer_output", positions="all", progress=False)["layer_output"][0]
        again = cached.generate([long], **sampling).logits[0]  # and the steered run left nothing for plain ones
    finally:
        cached.close()
    # the steer moves the logits by more than twice the tolerance, so a steered request served from the plain
    # run's blocks (its logits near `plain`) fails the next line; a relative error of unrelated logits is about 1,
    # so a larger factor could not be met where the tolerance is bfloat16's (0.05)
    assert relative_error(plain, exact) > 2 * RELATIVE
    assert relative_error(steered, exact) <= RELATIVE
    assert relative_error(harvest, exact_harvest) <= RELATIVE
    assert relative_error(again, plain) <= RELATIVE
