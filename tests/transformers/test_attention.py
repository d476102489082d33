"""Every family's attention internals on transformers against the attention oracle.

queries, keys, values and head_outputs against the tensors transformers hands
its kernel; the recomputed pattern against transformers' eager weights (past a
sliding window of 4 and across Llama 4's chunks of 128, so the prompt is longer
than both); pattern @ values against head_outputs; head and query edits
against the same edits made in transformers' own forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import attention_oracle as oracle
from access import relative_error
import streamscope
from streamscope.testing import FAMILIES

ATTENTION_FAMILIES = [family for family in FAMILIES if family != "mamba"]
PROMPT = ("The Eiffel Tower is in Paris, and the quick brown fox jumps over the lazy dog. "
          "Attention heads move information between positions; the MLP writes features. ") * 4
RELATIVE = 1e-5
INTERNALS = ("queries", "keys", "values", "scores", "pattern", "head_outputs")


def repeat_heads(values: torch.Tensor, heads: int) -> torch.Tensor:
    return values.repeat_interleave(heads // values.shape[1], dim=1)


class Family:
    def __init__(self, name: str, path):
        self.name = name
        self.path = path
        self.model = streamscope.load(path)
        self.sdpa = AutoModelForCausalLM.from_pretrained(path, **oracle.load_kwargs(name, "sdpa")).eval()
        self.eager = AutoModelForCausalLM.from_pretrained(path, **oracle.load_kwargs(name, "eager")).eval()
        self.input_ids = self.model.tokenizer(PROMPT, return_tensors="pt").input_ids
        self.blocks = sorted(oracle.attention_modules(self.sdpa))
        # The forward the engine runs: sdpa, or eager where streamscope loads it so (Gemma 2, whose cap sdpa drops).
        self.reference = self.sdpa if self.model.config._attn_implementation == "sdpa" else self.eager
        self.expected = oracle.kernel_tensors(self.reference, name, self.input_ids)
        self.weights = oracle.eager_weights(self.eager, self.input_ids)

    def read(self, model=None, names=INTERNALS):
        model = model or self.model
        saved = {}
        with model.trace(self.input_ids):
            for block in self.blocks:
                attention = model.layers[block].self_attn
                for name in names:
                    saved[(name, block)] = getattr(attention, name).save()
            logits = model.logits.save()
        return saved, logits


@pytest.fixture(scope="module", params=ATTENTION_FAMILIES)
def family(request, checkpoints):
    return Family(request.param, checkpoints(request.param))


def test_the_prompt_is_longer_than_a_window_and_a_chunk(family):
    assert family.input_ids.shape[1] > 128


def test_support_lists_every_internal_served_on_attention_blocks(family):
    support = family.model.support()
    for block in range(family.model.num_layers):
        rows = support[block].rows
        for name in INTERNALS:
            reason = rows[f"self_attn.{name}"]
            assert (reason is None) == (block in family.blocks), (name, block, reason)
    assert list(support[family.blocks[0]].rows).index("self_attn.queries") < \
        list(support[family.blocks[0]].rows).index("self_attn.attention_output")


def test_queries_keys_values_and_head_outputs_equal_the_kernels_tensors(family):
    saved, logits = family.read(names=("queries", "keys", "values", "head_outputs"))
    for block in family.blocks:
        for name in ("queries", "keys", "values", "head_outputs"):
            value, reference = saved[(name, block)], family.expected[block][name]
            if family.name == "falcon" and name in ("keys", "values"):  # the kernel gets each kv head per query head
                reference = reference[:, ::reference.shape[1] // value.shape[1]]
            assert value.shape == reference.shape, (name, block, value.shape, reference.shape)
            assert relative_error(value, reference) <= RELATIVE, (name, block)
        heads = saved[("queries", block)].shape[1]
        assert saved[("queries", block)].shape[1] == family.model.num_heads
        assert saved[("keys", block)].shape[1] == family.model.num_kv_heads
        assert saved[("head_outputs", block)].shape[2] == heads
    with family.model.trace(family.input_ids):
        plain = family.model.logits.save()
    assert torch.equal(plain, logits)  # reading changes nothing


def test_head_outputs_are_what_the_output_projection_reads_where_nothing_gates_them(family):
    if family.name == "qwen3_next":
        pytest.skip("Qwen3-Next's output gate sits between the kernel and o_proj")
    saved, _ = family.read(names=("head_outputs",))
    inputs = oracle.output_projection_inputs(family.reference, family.input_ids)
    for block in family.blocks:
        value = saved[("head_outputs", block)]
        assert relative_error(value.flatten(2), inputs[block]) <= RELATIVE, block


def test_pattern_equals_the_eager_weights(family):
    if family.name == "gemma2":
        pytest.skip("transformers' sdpa kernel ignores Gemma 2's soft cap: see the eager-model test")
    saved, _ = family.read(names=("scores", "pattern"))
    for block in family.blocks:
        pattern, reference = saved[("pattern", block)], family.weights[block]
        assert pattern.shape == reference.shape
        assert (pattern - reference).abs().max().item() <= 1e-5, block
        assert torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-5)
        masked = reference == 0
        assert masked.any(), block  # causal at least
        assert torch.all(pattern[masked] == 0), block
        assert torch.all(torch.isinf(saved[("scores", block)][masked])), block


def test_the_pattern_reaches_past_a_sliding_window_and_across_chunks_as_the_model_does(family):
    config = family.eager.config
    saved, _ = family.read(names=("pattern",))
    seq = family.input_ids.shape[1]
    for block in family.blocks:
        pattern = saved[("pattern", block)][0, 0]
        kind = (getattr(config, "layer_types", None) or [None] * 99)[block]
        window = getattr(config, "sliding_window", None)
        if kind == "chunked_attention":
            chunk = config.attention_chunk_size
            assert torch.all(pattern[chunk, :chunk] == 0) and pattern[chunk, chunk] > 0
            assert torch.all(pattern[chunk - 1, :chunk] > 0)
        elif window and (kind == "sliding_attention" or (kind is None and family.name in ("mistral",))):
            assert torch.all(pattern[seq - 1, :seq - window] == 0) and torch.all(pattern[seq - 1, seq - window:] > 0)
        else:
            assert torch.all(pattern[seq - 1] > 0), (block, kind)


def test_an_eager_model_serves_its_own_weights_and_recomputed_scores_agree(family):
    if family.name == "falcon":
        pytest.skip("Falcon's eager path has no kernel call")
    model = streamscope.load(family.path, attn_implementation="eager")
    saved, _ = family.read(model=model, names=("scores", "pattern"))
    for block in family.blocks:
        reference = family.weights[block]
        assert relative_error(saved[("pattern", block)], reference) <= 1e-6, block
        recomputed = torch.softmax(saved[("scores", block)], dim=-1)
        assert (recomputed - reference).abs().max().item() <= 1e-5, block


def test_pattern_at_values_reproduces_head_outputs(family):
    saved, _ = family.read()
    for block in family.blocks:
        pattern, values = saved[("pattern", block)], saved[("values", block)]
        mix = (pattern @ repeat_heads(values, pattern.shape[1])).transpose(1, 2)
        assert relative_error(mix, saved[("head_outputs", block)]) <= 1e-5, block


def test_zeroing_a_head_matches_the_oracle(family):
    block, head = family.blocks[-1], 1
    with family.model.trace(family.input_ids):
        family.model.layers[block].self_attn.head_outputs[:, :, head] = 0
        logits = family.model.logits.save()
    head_dim = family.expected[block]["queries"].shape[-1]
    expected = oracle.logits_with_head_zeroed(family.reference, family.input_ids, block, head, head_dim)
    plain = family.reference(family.input_ids).logits
    assert not torch.allclose(expected, plain)
    assert relative_error(logits, expected) <= RELATIVE


def test_editing_a_heads_queries_matches_the_oracle(family):
    block = family.blocks[0]

    def edit(queries):
        queries[:, 0] *= 3.0

    with family.model.trace(family.input_ids):
        edit(family.model.layers[block].self_attn.queries)
        logits = family.model.logits.save()
    expected = oracle.logits_with_query_edit(family.reference, family.name, family.input_ids, block, edit)
    assert not torch.allclose(expected, family.reference(family.input_ids).logits)
    assert relative_error(logits, expected) <= RELATIVE


def test_assigning_keys_reaches_the_model_and_recomputed_values_refuse_writes(family):
    block = family.blocks[0]
    with family.model.trace(family.input_ids):
        attention = family.model.layers[block].self_attn
        keys = attention.keys.clone()
        keys[..., 0] += 1.0
        attention.keys = keys
        edited = family.model.logits.save()
    with family.model.trace(family.input_ids):
        plain = family.model.logits.save()
    assert not torch.equal(edited, plain)
    for name in ("scores", "pattern"):
        with pytest.raises(ValueError, match="cannot be written"):
            with family.model.trace(family.input_ids):
                getattr(family.model.layers[block].self_attn, name)[:] = 0


PRE_ROTARY = ("queries_pre_rotary", "keys_pre_rotary")


def test_pre_rotary_values_are_not_the_rotated_ones_where_the_family_rotates(family):
    """The oracle's pre-rotary tensors (the rotary's arguments) differ from what the kernel receives on some block
    of every family that rotates, so the matrix's check of them can tell the two apart; on a family that rotates
    nothing they are the kernel's own."""
    from streamscope.testing.oracle import PRE_ROTARY as ROTATES

    caught = oracle.pre_rotary_tensors(family.reference, family.name, family.input_ids, family.expected)
    differs = [block for block in family.blocks
               if not torch.equal(caught[block]["queries_pre_rotary"], family.expected[block]["queries"])]
    assert bool(differs) == (family.name in ROTATES), differs


PROJECTED = ("queries_projected", "keys_projected")
#: Each editable tensor before the rotary, and the oracle's logits with the same edit where transformers' own modules
#: hold that tensor: the pre-rotary tensor (after any q/k norm), and the projection (that norm's input, or the
#: pre-rotary tensor where nothing norms).
EDITED_BEFORE_ROTARY = [*((name, oracle.logits_with_pre_rotary_edit) for name in PRE_ROTARY),
                        *((name, oracle.logits_with_projected_edit) for name in PROJECTED)]


@pytest.mark.parametrize("name, edited_logits", EDITED_BEFORE_ROTARY, ids=[name for name, _ in EDITED_BEFORE_ROTARY])
def test_editing_queries_or_keys_before_the_rotary_matches_the_oracle(family, name, edited_logits):
    """An edit of the projections or the pre-rotary queries and keys reaches the model, on every attention block
    (rotating or not): the logits are transformers' with the same edit made where its own modules hold the tensor,
    and differ from the unedited."""
    # one channel of every head (Falcon's kernel gets a copy of each kv head per query head), scaled: a shift of
    # every key alike would move each query's scores by one constant, which the softmax drops
    def edit(tensor):
        tensor[..., 3] *= 3.0

    unedited = family.reference(family.input_ids).logits
    for block in family.blocks:
        with family.model.trace(family.input_ids):
            edit(getattr(family.model.layers[block].self_attn, name))
            logits = family.model.logits.save()
        expected = edited_logits(family.reference, family.name, family.input_ids, block, name, edit)
        assert relative_error(expected, unedited) > 2 * RELATIVE, (block, "an edit dropped would pass")
        assert relative_error(logits, expected) <= RELATIVE, block


def test_projected_values_are_not_the_pre_rotary_ones_exactly_where_a_norm_precedes_the_rotary(family):
    """The oracle's projections (a q/k norm's input) differ from its pre-rotary tensors (that norm's output) on
    every block of a family that norms its queries and keys before rotating, so the matrix's check of them tells
    TransformerLens's hook_q from the normed queries; elsewhere they are the same tensors."""
    pre_rotary = oracle.pre_rotary_tensors(family.reference, family.name, family.input_ids, family.expected)
    projected = oracle.projected_tensors(family.reference, family.name, family.input_ids, pre_rotary)
    modules = oracle.attention_modules(family.reference)
    for block in family.blocks:
        normed = any(child in modules[block]._modules for child in ("q_norm", "q_layernorm"))
        for name in PROJECTED:
            same = torch.equal(projected[block][name], pre_rotary[block][name.replace("projected", "pre_rotary")])
            assert same != normed, (block, name, normed)


def test_transformer_lens_hook_q_and_hook_k_are_the_projections_where_tl_puts_them(family):
    """The cache's attn.hook_q / hook_k are the projections before any q/k norm (TransformerLens's placement), in
    TL's [batch, pos, head, d_head] layout: the oracle's q/k norm input where the family has one."""
    pre_rotary = oracle.pre_rotary_tensors(family.reference, family.name, family.input_ids, family.expected)
    projected = oracle.projected_tensors(family.reference, family.name, family.input_ids, pre_rotary)
    cache = family.model.cache(PROMPT, values=["self_attn.queries_projected", "self_attn.keys_projected"])
    for block in family.blocks:
        for hook, name in (("hook_q", "queries_projected"), ("hook_k", "keys_projected")):
            got = cache[f"blocks.{block}.attn.{hook}"]
            expected = projected[block][name].transpose(1, 2)
            if family.name == "falcon" and hook == "hook_k":  # its rotary gets each kv head per query head
                expected = expected[:, :, ::expected.shape[2] // got.shape[2]]
            assert got.shape == expected.shape, (block, hook, got.shape, expected.shape)
            assert relative_error(got, expected) <= RELATIVE, (block, hook)
