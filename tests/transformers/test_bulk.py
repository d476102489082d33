"""The bulk path on transformers: padded batches with one hook per module, no trace.

Against the oracle (transformers' forward read with torch hooks) in padded
batches, and against traces: a harvest of one prompt per batch is the trace's
read of that prompt bit for bit (the same forward); a steered generation is
a trace of ``generate`` that adds the same vector at every step.
"""

from __future__ import annotations

import pytest
import torch

import bulk_checks
from access import relative_error
import bulk_engines
from bulk_checks import BULK_FAMILIES, PROMPTS
import streamscope

STEPS = 4


engine = bulk_engines.fixture("transformers", BULK_FAMILIES)


def test_a_padded_harvest_equals_the_transformers_values(engine):
    bulk_checks.check_harvest_equals_the_oracle(engine.model, engine.reference, engine.tokenizer, engine.family,
                                                batch_size=3)


def test_a_harvest_equals_the_trace_of_the_same_prompt_bit_for_bit(engine):
    model = engine.model
    names = ["layer_input", "attention_output", "mlp_output", "layer_output"]
    harvest = model.harvest(PROMPTS, names, positions="all", batch_size=1, progress=False)
    for index, prompt in enumerate(PROMPTS):
        with model.trace(prompt):
            reads = []
            for layer in model.layers:
                reads += [layer.layer_input, layer.self_attn.attention_output, layer.mlp.mlp_output,
                          layer.layer_output]
            traced = torch.stack(reads).save()
        for block in range(model.num_layers):
            for slot, name in enumerate(names):
                expected = traced[block * len(names) + slot, 0]
                assert torch.equal(harvest[name][index][block], expected), (index, block, name)


def test_positions_select_the_same_rows(engine):
    bulk_checks.check_positions(engine.model, batch_size=2)


def test_shards_on_disk_equal_the_harvest_in_memory(engine, tmp_path):
    bulk_checks.check_shards(engine.model, tmp_path / "harvest", batch_size=2)


def test_shards_are_bounded_in_bytes_by_default(engine, tmp_path, monkeypatch):
    bulk_checks.check_shards_bounded_in_bytes(engine.model, tmp_path / "harvest", monkeypatch, slack_prompts=2, batch_size=2)


def test_a_failed_harvest_to_a_folder_leaves_no_index(engine, tmp_path, monkeypatch):
    from streamscope.transformers import bulk as engine_bulk

    bulk_checks.check_a_failed_harvest_leaves_no_index(engine.model, tmp_path / "harvest", monkeypatch,
                                                       engine_bulk, batch_size=2)


def steered_trace(model, prompt, steers, steps):
    """The reference: a trace of generate that adds (or sets) each steer's vector at every step."""
    deltas = [(steer.layer, steer.value, steer.delta(torch.float32, "cpu"), steer.mode) for steer in steers]
    with model.generate(prompt, max_new_tokens=steps, do_sample=False, min_new_tokens=steps) as tracer:
        logits = list().save()
        for step in tracer.iter[:steps]:
            for layer, value, delta, mode in deltas:
                envoy = model.layers[layer].mlp if value == "mlp_output" else model.layers[layer]
                current = getattr(envoy, value)
                if mode == "add":
                    current[:, :] += delta
                else:
                    current[:, :] = delta
            logits.append(model.logits[0, -1].clone())
    return torch.stack(list(logits))


def test_a_steered_generation_equals_a_trace_that_adds_the_vector_at_every_step(engine):
    model = engine.model
    torch.manual_seed(0)
    steers = [  # in the order the model computes them, as the trace must read them
        streamscope.Steer("mlp_output", 0, torch.randn(model.hidden_size), mode="set", positions="all"),
        streamscope.Steer("layer_output", 1, torch.randn(model.hidden_size), scale=2.0, positions="all"),
    ]
    for used in (steers[1:], steers):
        result = model.generate(PROMPTS[1:2], max_tokens=STEPS, steer=used, return_logits=True, ignore_eos=True,
                                batch_size=1, progress=False)
        expected = steered_trace(model, PROMPTS[1], used, STEPS)
        assert result.logits[0].shape == (STEPS, model.vocab_size)
        assert relative_error(result.logits[0], expected) <= 1e-6


def test_other_requests_in_the_batch_are_untouched(engine):
    model = engine.model
    torch.manual_seed(1)
    steer = streamscope.Steer("layer_output", 0, torch.randn(model.hidden_size), scale=3.0, prompts=[2])
    options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False,
               "batch_size": len(PROMPTS)}
    steered = model.generate(PROMPTS, steer=[steer], **options)
    plain = model.generate(PROMPTS, harvest={"values": "layer_output", "layers": [0]}, **options)
    for index in range(len(PROMPTS)):
        assert torch.equal(steered.logits[index], plain.logits[index]) == (index != 2), index
    solo = model.generate(PROMPTS[2:3], steer=[streamscope.Steer("layer_output", 0, steer.vector, scale=3.0)],
                          **{**options, "batch_size": 1})
    assert relative_error(steered.logits[2], solo.logits[0]) <= 1e-5


def test_a_generation_harvest_reads_the_prompt(engine):
    model = engine.model
    result = model.generate(PROMPTS, max_tokens=2, harvest={"values": ["layer_output"], "positions": "all"},
                            ignore_eos=True, progress=False, batch_size=2)
    alone = model.harvest(PROMPTS, "layer_output", positions="all", batch_size=1, progress=False)
    for index in range(len(PROMPTS)):
        assert relative_error(result.harvest["layer_output"][index], alone["layer_output"][index]) <= 1e-5
    assert all(len(tokens) == 2 for tokens in result.tokens) and len(result.texts) == len(PROMPTS)


def test_bad_specs_fail_before_the_model_runs(engine):
    bulk_checks.check_bad_specs_fail_before_running(engine.model, engine.family)


def test_generate_as_a_with_block_is_nnsight_generate_and_called_a_generation(engine):
    model = engine.model
    with model.generate(PROMPTS[0], max_new_tokens=2, do_sample=False) as tracer:
        output = tracer.result.save()
    assert output.shape[-1] >= 2
    plain = model.generate(PROMPTS[0], max_new_tokens=2, do_sample=False, progress=False)
    assert isinstance(plain, streamscope.Generation)
    length = len(model.tokenizer(PROMPTS[0])["input_ids"])
    assert plain.tokens[0] == output[0, length:].tolist()


def test_a_steer_at_chosen_prompt_positions_edits_those_rows_only(engine):
    # Rows that are not one block (the first and last position): an index, not a slice.
    model = engine.model
    torch.manual_seed(3)
    steer = streamscope.Steer("layer_output", 0, torch.randn(model.hidden_size), scale=2.0, positions=[0, -1],
                              generated=False)
    result = model.generate(PROMPTS[1:2], max_tokens=1, steer=[steer], return_logits=True, batch_size=1,
                            progress=False)
    length = len(engine.tokenizer(PROMPTS[1]).input_ids)
    with model.trace(PROMPTS[1]):
        model.layers[0].layer_output[:, [0, length - 1]] += steer.delta(torch.float32, "cpu")
        logits = model.logits[0, -1].save()
    assert relative_error(result.logits[0][0], logits) <= 1e-6


def test_a_harvest_refuses_a_prompt_whose_first_tokens_ran_unseen():
    # What a prefix-cache hit looks like to the hooks: the request's first step starts past position 0.
    from streamscope.bulk.apply import Applier, Span

    applier = Applier([], {0: [0, 1, 2, 3]}, [], "cpu")
    applier.step([Span(0, start=0, count=4, first=0)])  # the whole prompt in one step: fine
    with pytest.raises(RuntimeError, match="enable_prefix_caching=False"):
        applier.step([Span(0, start=0, count=2, first=2)])


def test_head_results_on_the_bulk_path_equal_the_trace(engine):
    bulk_checks.check_head_results_on_the_bulk_path(engine.model, batch_size=2)
