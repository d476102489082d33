"""Every family on transformers against the oracle: transformers' own forward read with torch hooks.

For each family's tiny checkpoint: `test_value` is the value x family matrix
(tests/matrix.py): every value a support table can list, on every block that
serves it, equals the oracle's tensor (the stream, the attention kernels'
tensors and eager weights, the routers' outputs), and every block that does
not serve it raises Unavailable with support()'s reason. Then: the stream
identity holds, reads change nothing, edits match the oracle's hooked edits,
skip matches an identity block.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import matrix
import oracle
from access import relative_error, set_value, value_of
import streamscope
from streamscope.testing import FAMILIES

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
RELATIVE = 1e-5  # float32 on CPU: the same ops in the same order agree to rounding
PATTERN = 1e-5  # absolute, on attention weights in [0, 1]


class Family:
    def __init__(self, name: str, path, case_id: str = ""):
        self.name, self.case_id = name, case_id or name
        self.model = streamscope.load(path)
        self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.input_ids = self.tokenizer(PROMPT, return_tensors="pt").input_ids
        self.expected = oracle.values(self.reference, name, self.input_ids)
        self.order = [entry for entry in self.expected["order"]]
        # Where transformers' sdpa forward differs from its eager one (Gemma 2's drops the attention soft cap),
        # the weights it computes are those of the eager forward without what sdpa drops.
        sdpa = self.model.config._attn_implementation == "sdpa"
        overrides = {"attn_logit_softcapping": None} if sdpa and name in attention_oracle.SDPA_DIFFERS else None
        self.oracle = matrix.Reference(path, name, self.input_ids, eager_overrides=overrides,
                                       implementation=self.model.config._attn_implementation)
        self.tolerances = matrix.Tolerances(RELATIVE, PATTERN)
        self.saved = matrix.read(self.model, matrix.plan(self.model, self.oracle, prompt_logits_after="logits"),
                                 PROMPT)

    def read_all(self):
        """Every value the oracle computed, read through streamscope in the order the model computes them."""
        seen = set()
        saved = {}
        with self.model.trace(PROMPT):
            for name, block in self.order:
                if (name, block) in seen:
                    continue
                seen.add((name, block))
                saved[(name, block)] = value_of(self.model, name, block).save()
        return saved


#: Layouts of a family that its tiny checkpoint does not have: {case: (family, checkpoint overrides)}.
VARIANTS = {"opt-post-ln": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),  # OPT-350m's
            "stablelm-parallel": ("stablelm", {"qk_layernorm": True, "use_parallel_residual": True}),  # 2 12B's
            "falcon-sequential-bias": ("falcon", {"new_decoder_architecture": False, "parallel_attn": False,
                                                  "bias": True}),
            "falcon-rw": ("falcon", {"new_decoder_architecture": False, "parallel_attn": False, "bias": True,
                                     "alibi": True, "multi_query": False, "num_kv_heads": 2}),
            "gpt2-scaled-by-block": ("gpt2", {"scale_attn_by_inverse_layer_idx": True}),
            "gpt2-upcast": ("gpt2", {"reorder_and_upcast_attn": True}),
            "qwen2-some-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                                             "max_window_layers": 1}),
            # soft caps the tiny model's attention logits and logits reach (the config's 50 and 30 they do not)
            "gemma2-capped": ("gemma2", {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0})}


@pytest.fixture(scope="module", params=[*FAMILIES, *VARIANTS])
def family(request, checkpoints):
    name, overrides = VARIANTS.get(request.param, (request.param, {}))
    return Family(name, checkpoints(name, **overrides), case_id=request.param)


@pytest.mark.parametrize("value", matrix.VALUES)
def test_value(family, value):
    """One cell of the matrix: `value` on this family, every block that serves it against the oracle, every
    block that does not raising Unavailable with the reason support() gives."""
    where = matrix.rows(family.model.support(), value)
    if not where:
        pytest.skip(f"{family.name} has no {value} on any block")
    for block, reason in where.items():
        if reason is None:
            assert (value, block) in family.saved, f"{value} on block {block} is served, but the oracle has none"
            error = matrix.check(value, family.saved[(value, block)], family.oracle, block, family.tolerances)
            matrix.record("transformers", family.case_id, value, error, family.tolerances.of(value))
    for reason, block in {reason: block for block, reason in where.items() if reason is not None}.items():
        with pytest.raises(streamscope.Unavailable) as raised:
            with family.model.trace(PROMPT):
                matrix.reach(family.model, value, block).save()
        assert raised.value.reason == reason, (value, block)


def test_an_edit_of_head_results_matches_the_oracle_scaling_that_heads_result(family):
    if not any(reason is None for reason in matrix.rows(family.model.support(), "self_attn.head_results").values()):
        pytest.skip(f"{family.name}: every block refuses head_results (test_value holds each refusal to its "
                    "reason), so there is no edit to check")
    matrix.head_results_edit_error(family.model, family.oracle, PROMPT, RELATIVE)


def test_a_harvest_of_head_results_equals_the_oracle(family):
    if not matrix.rows(family.model.support(), "self_attn.head_results"):
        pytest.skip(f"{family.name} has no attention block, so no self_attn.head_results row to harvest")
    error = matrix.head_results_harvest_error(family.model, family.oracle, PROMPT, RELATIVE)
    matrix.record("transformers", family.case_id, "head_results harvest", error, RELATIVE)


def test_every_row_of_the_support_table_is_a_value_the_matrix_checks(family):
    support = family.model.support()
    listed = set(support.root.rows).union(*(table.rows for table in support.blocks))
    assert listed <= set(matrix.VALUES), listed - set(matrix.VALUES)


def test_support_marks_served_exactly_what_the_oracle_computes(family):
    support = family.model.support()
    for block in range(family.model.num_layers):
        rows = support[block].rows
        for name in oracle.BOUNDARIES:
            served = family.expected.get(name) is not None and family.expected[name][block] is not None
            assert (rows[name] is None) == served, (name, block, rows[name])
    normed = ["final_norm_output"] if family.expected.get("final_norm_output") is not None else []  # (OPT-350m)
    assert support.root.served() == ["token_embeddings", *normed, "logits", "prompt_logits"]
    assert "model.layers[0" in str(support)


def test_the_stream_identity_holds_on_every_block(family):
    saved = family.read_all()
    for block in range(family.model.num_layers):
        contributions = [saved.get((name, block)) for name in oracle.CONTRIBUTIONS]
        if all(c is not None for c in contributions):
            total = saved[("layer_input", block)] + contributions[0] + contributions[1]
            assert relative_error(total, saved[("layer_output", block)]) <= RELATIVE, block
        if block + 1 < family.model.num_layers:
            assert torch.equal(saved[("layer_output", block)], saved[("layer_input", block + 1)])


def test_reading_every_value_changes_nothing(family):
    with family.model.trace(PROMPT):
        plain = family.model.logits.save()
    saved = family.read_all()
    assert torch.equal(saved[("logits", None)], plain)
    assert relative_error(plain, family.expected["logits"]) <= RELATIVE


def _edit_sites(family):
    block = min(1, family.model.num_layers - 1)
    sites = [(name, None) for name in ("token_embeddings", "final_norm_output") if family.expected.get(name) is not None]
    for name in (*oracle.BOUNDARIES, *oracle.CONTRIBUTIONS, *oracle.NEURONS):
        if family.expected.get(name) is not None and family.expected[name][block] is not None:
            sites.append((name, block))
    return sites


def _width(family, name: str, block) -> int:
    """The last dimension of the oracle's `name`: hidden_size, but for OPT-350m's narrower token embeddings and
    the MLP's neurons (intermediate_size)."""
    expected = family.expected[name] if block is None else family.expected[name][block]
    return expected.shape[-1]


def test_adding_a_vector_anywhere_matches_the_oracle(family):
    for name, block in _edit_sites(family):
        vector = torch.linspace(-1.0, 1.0, _width(family, name, block))
        with family.model.trace(PROMPT):
            value_of(family.model, name, block)[:, -1] += vector
            logits = family.model.logits.save()
        expected_vector = torch.zeros(family.input_ids.shape[1], vector.shape[0])
        expected_vector[-1] = vector
        expected = oracle.logits_with_addition(family.reference, family.name, family.input_ids, name, block,
                                               expected_vector)
        assert not torch.allclose(expected, family.expected["logits"]), (name, block)
        assert relative_error(logits, expected) <= RELATIVE, (name, block, relative_error(logits, expected))


#: Prompts of other lengths for batched invokes (transformers pads them into one batch).
INVOKE_PROMPTS = [PROMPT, "Rome is in Italy", "Attention heads move information between positions"]


#: Values held as flattened tokens, [batch * seq, hidden] (OPT's around its MLP, Llama 4's MoE output), which
#: nnsight cannot narrow to an invoke's rows (it narrows by the leading dim, the batch): streamscope views them
#: as the stream, [batch, seq, hidden], and narrows that, so each invoke reads and edits its own rows.
FLATTENED = {("opt", "layer_mid"), ("opt", "mlp_norm_output"), ("opt", "mlp_input"), ("opt", "mlp_output"),
             ("llama4_text", "mlp_output")}


def _batched_and_solo(family, name, block, width=None):
    model = family.model
    vectors = [torch.linspace(-1.0, 1.0, width or model.hidden_size) * scale for scale in (1.0, -2.0, 0.5)]
    solo = []
    for prompt, vector in zip(INVOKE_PROMPTS, vectors):
        with model.trace(prompt):
            value_of(model, name, block)[:, -1] += vector
            solo.append(model.logits[0, -1].save())
    batched = []
    with model.trace() as tracer:
        for prompt, vector in zip(INVOKE_PROMPTS, vectors):
            with tracer.invoke(prompt):
                value_of(model, name, block)[:, -1] += vector
                batched.append(model.logits[0, -1].save())
    return [relative_error(together, alone) for together, alone in zip(batched, solo)]


def test_every_invoke_of_a_batch_takes_its_own_edit_as_its_solo_run_does(family):
    """Each invoke adds a vector at the same value: each must equal its own solo run. nnsight splices an edited
    invoke's rows into a new batch tensor, which a block's own alias of the old one (the residual Llama keeps
    across its attention add, read as layer_mid) would not see: the second invoke's edit went missing. A value
    held as flattened tokens (`FLATTENED`) reached every invoke whole, so each edit landed in every invoke."""
    for name, block in _edit_sites(family):
        errors = _batched_and_solo(family, name, block, _width(family, name, block))
        assert max(errors) <= RELATIVE, (name, block, errors)


@pytest.fixture(scope="module")
def flattened_family(checkpoints):
    """A family of `FLATTENED` by name: its model alone (no oracle), loaded once per module."""
    loaded: dict = {}

    def family(name: str):
        if name not in loaded:
            loaded[name] = types.SimpleNamespace(name=name, model=streamscope.load(checkpoints(name)))
        return loaded[name]

    return family


@pytest.mark.parametrize("case", sorted(FLATTENED))
def test_a_flattened_value_edited_in_batched_invokes(case, flattened_family):
    name, value = case
    family = flattened_family(name)
    errors = _batched_and_solo(family, value, min(1, family.model.num_layers - 1))
    assert max(errors) <= RELATIVE, errors


@pytest.mark.parametrize("case", sorted(FLATTENED))
def test_a_flattened_value_read_in_batched_invokes_is_each_invokes_own(case, flattened_family):
    """Each invoke of a batched trace reads its own rows of a flattened value, [1, seq, hidden] with seq the
    batch's padded length, and its tokens there (the last ones: transformers pads on the left) are its solo
    run's."""
    name, value = case
    model = flattened_family(name).model
    block = min(1, model.num_layers - 1)
    solo = []
    for prompt in INVOKE_PROMPTS:
        with model.trace(prompt):
            solo.append(value_of(model, value, block).save())
    batched = []
    with model.trace() as tracer:
        for prompt in INVOKE_PROMPTS:
            with tracer.invoke(prompt):
                batched.append(value_of(model, value, block).save())
    width = max(alone.shape[1] for alone in solo)
    for alone, together in zip(solo, batched):
        assert together.shape == (1, width, model.hidden_size), together.shape
        assert relative_error(together[:, -alone.shape[1]:], alone) <= RELATIVE


#: Invokes of a batched generate: one prompt, then two (an invoke of several prompts owns several rows).
GENERATE_INVOKES = [["Rome is in Italy"], [PROMPT, "Attention heads move information between positions"]]


@pytest.mark.parametrize("name", ["opt", "llama4_text"])
def test_a_flattened_value_edited_at_every_step_of_a_batched_generate(name, flattened_family):
    """Each invoke of a batched generate edits mlp_output (flattened tokens on these families) at every step:
    the prompt, then steps of one position a prompt, where nnsight narrows the flattened tokens itself. Each
    invoke's logits at each step must be its solo generate's, and each read is [prompts, positions, hidden]."""
    model = flattened_family(name).model
    block, steps = min(1, model.num_layers - 1), 3
    vectors = [torch.linspace(-1.0, 1.0, model.hidden_size) * scale for scale in (3.0, -4.0)]
    options = {"max_new_tokens": steps, "min_new_tokens": steps, "do_sample": False}
    solo = []
    for prompts, vector in zip(GENERATE_INVOKES, vectors):
        with model.generate(prompts, **options) as tracer:
            logits = list().save()
            for _ in tracer.iter[:steps]:
                model.layers[block].mlp.mlp_output[:, -1] += vector
                logits.append(model.logits[:, -1])
        solo.append(logits)
    batched: list[list] = [[] for _ in GENERATE_INVOKES]
    shapes: list[list] = [[] for _ in GENERATE_INVOKES]
    with model.generate(**options) as tracer:
        for prompts, vector, logits, shape in zip(GENERATE_INVOKES, vectors, batched, shapes):
            with tracer.invoke(prompts):
                for _ in tracer.iter[:steps]:
                    output = model.layers[block].mlp.mlp_output
                    shape.append(tuple(output.shape))
                    output[:, -1] += vector
                    logits.append(model.logits[:, -1].save())
    for prompts, alone, together, shape in zip(GENERATE_INVOKES, solo, batched, shapes):
        assert [s[0] for s in shape] == [len(prompts)] * steps and [s[1] for s in shape[1:]] == [1] * (steps - 1)
        assert len(together) == len(alone) == steps
        for step, (mine, theirs) in enumerate(zip(together, alone)):
            assert relative_error(mine, theirs) <= RELATIVE, (step, relative_error(mine, theirs))


def test_in_place_edit_assignment_and_read_twice_edit_once_agree(family):
    block = min(1, family.model.num_layers - 1)
    for name, block in [("layer_input", block), ("layer_output", block), ("mlp_output", block),
                        ("neurons_pre", block)]:
        if family.expected.get(name) is None or family.expected[name][block] is None:
            continue
        vector = torch.linspace(-1.0, 1.0, _width(family, name, block))
        with family.model.trace(PROMPT):
            value_of(family.model, name, block)[:, -1] += vector
            in_place = family.model.logits.save()
        with family.model.trace(PROMPT):
            edited = value_of(family.model, name, block).clone()
            edited[:, -1] += vector
            set_value(family.model, name, block, edited)
            assigned = family.model.logits.save()
        with family.model.trace(PROMPT):
            _first = value_of(family.model, name, block)  # a read the edit below must not undo
            second = value_of(family.model, name, block)
            second[:, -1] += vector
            twice = family.model.logits.save()
        assert torch.equal(in_place, assigned), name
        assert torch.equal(in_place, twice), name


def test_skip_gives_the_logits_of_an_identity_block(family):
    block = min(1, family.model.num_layers - 1)
    with family.model.trace(PROMPT):
        layer = family.model.layers[block]
        layer.skip(layer.layer_input)
        logits = family.model.logits.save()
    expected = oracle.logits_with_identity_block(family.reference, family.name, family.input_ids, block)
    assert relative_error(logits, expected) <= RELATIVE


def test_a_wrong_shape_write_is_refused_with_the_value_both_shapes_and_the_block(family):
    block = min(1, family.model.num_layers - 1)
    tokens = family.input_ids.shape[1]
    wrong = torch.zeros(1, tokens + 2, family.model.hidden_size)
    with pytest.raises(ValueError) as raised:
        with family.model.trace(PROMPT):
            family.model.layers[block].layer_output = wrong
    message = str(raised.value)
    assert f"model.layers[{block}].layer_output" in message
    assert str((1, tokens + 2, family.model.hidden_size)) in message
    assert str((1, tokens, family.model.hidden_size)) in message
    with family.model.trace(PROMPT):
        after = family.model.logits.save()
    assert relative_error(after, family.expected["logits"]) <= RELATIVE
    with pytest.raises(ValueError, match="skip takes"):
        with family.model.trace(PROMPT):
            family.model.layers[block].skip(wrong)
