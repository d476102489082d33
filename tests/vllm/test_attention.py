"""Every family's attention internals on vLLM against the attention oracle (transformers' own tensors).

One engine per family, alive for this module's tests of it only. queries, keys,
values and head_outputs against the tensors transformers hands its kernel,
channel for channel (Llama 4's load-time permutation undone); the recomputed
pattern against transformers' eager weights, past a sliding window of 4 and
across Llama 4's chunks of 128 (the prompt is longer than both), and on decode
steps against the same rows of the full sequence; pattern @ values against
head_outputs; head, query-channel and key-channel edits against the same edits
made in transformers' own forward; recomputed values refusing writes. Where and in which dtype it runs, and
the tolerances of a GPU or bfloat16 run: tests/precision.py.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attention_oracle as oracle
import matrix
import precision
from access import relative_error
import streamscope
from streamscope.vllm.model import beside_engine
from streamscope.testing import FAMILIES

PROMPT = ("The Eiffel Tower is in Paris, and the quick brown fox jumps over the lazy dog. "
          "Attention heads move information between positions; the MLP writes features. ") * 4
GREEDY = {"temperature": 0.0, "max_tokens": 1}
RELATIVE = precision.CPU_FLOAT32
PATTERN = precision.PATTERN  # absolute, on weights in [0, 1]
INTERNALS = ("queries", "keys", "values", "scores", "pattern", "head_outputs")
KERNEL_INPUTS = ("queries", "keys", "values", "head_outputs")
DECODE_STEPS = 3
CHANNEL = 3  # the query and key channel the edits move (Llama 4: a channel vLLM moved at load)


class Case:
    """A family's checkpoint and engine settings, and the tolerances its values are held to (None: measured)."""

    def __init__(self, family: str, overrides: dict | None = None, dtype: str | None = None,
                 tolerance: float | None = RELATIVE, mix: float | None = RELATIVE):
        self.family, self.overrides, self.dtype = family, overrides or {}, dtype
        self.tolerance, self.mix = tolerance, mix


CASES = {family: Case(family) for family in FAMILIES if family != "mamba"}  # mamba: no attention (and no CPU kernel)
# Qwen3-Next's CPU kernels run bfloat16 only: the tolerance is twice the distance transformers' own bfloat16
# forward keeps from its float32 one, measured per family as test_families.py does.
CASES["qwen3_next"] = Case("qwen3_next", precision.every_expert("qwen3_next"), dtype="bfloat16", tolerance=None,
                           mix=None)
if precision.measured():  # GPU runs (TF32 rounding can flip a routing choice too) and bfloat16: pin routing
    for _family in precision.MOE_FAMILIES:
        CASES[_family] = Case(_family, precision.every_expert(_family), dtype=CASES[_family].dtype, tolerance=None, mix=None)



def repeat_heads(values: torch.Tensor, heads: int) -> torch.Tensor:
    return values.repeat_interleave(heads // values.shape[1], dim=1)


def _kernel_reference(family: str, tensors: dict, name: str, value: torch.Tensor) -> torch.Tensor:
    reference = tensors[name]
    if family == "falcon" and name in ("keys", "values"):  # the kernel gets each kv head per query head
        reference = reference[:, ::reference.shape[1] // value.shape[1]]
    return reference


class Engines:
    def __init__(self, case: Case, path):
        self.name = family = case.family
        self.model = streamscope.load(path, engine="vllm", **precision.engine_kwargs(case.dtype))
        device = precision.DEVICE
        with beside_engine():
            # vLLM computes the family's own function: where transformers' sdpa forward computes another (Gemma 2's
            # drops its attention soft cap), the reference is the eager forward.
            implementation = oracle.exact_implementation(family)
            self.reference = AutoModelForCausalLM.from_pretrained(
                path, **oracle.load_kwargs(family, implementation)).to(device)
            self.eager = AutoModelForCausalLM.from_pretrained(path, **oracle.load_kwargs(family, "eager")).to(device)
        self.reference.eval(), self.eager.eval()
        self.input_ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids.to(device)
        self.blocks = sorted(oracle.attention_modules(self.reference))
        self.expected = oracle.kernel_tensors(self.reference, family, self.input_ids)
        self.weights = oracle.eager_weights(self.eager, self.input_ids)
        self.tolerance, self.mix, self.pattern_tolerance = case.tolerance, case.mix, PATTERN
        self.dtype, self.low = case.dtype, None  # low: transformers at the engine's precision, where it is measured
        if case.tolerance is None or precision.measured(case.dtype):
            # measured: transformers' own distance from float32 at the engine's precision, times the factor
            with beside_engine():
                experts = precision.low_precision_experts(family, case.dtype)
                kwargs = {**oracle.load_kwargs(family, implementation),
                          "dtype": precision.low_precision_dtype(case.dtype),
                          **({"experts_implementation": experts} if experts else {})}
                low = self.low = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
                kwargs = {**oracle.load_kwargs(family, "eager"), "dtype": precision.low_precision_dtype(case.dtype)}
                low_eager = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
            with precision.low_precision(case.dtype), torch.no_grad():
                tensors = oracle.kernel_tensors(low, family, self.input_ids)
                weights = oracle.eager_weights(low_eager, self.input_ids)
                logits = low(self.input_ids).logits
            errors = [relative_error(tensors[block][name], self.expected[block][name])
                      for block in self.blocks for name in KERNEL_INPUTS]
            errors.append(relative_error(logits, self.reference(self.input_ids).logits))
            self.tolerance = self.mix = precision.from_distance(max(errors), case.dtype)
            self.pattern_tolerance = precision.from_distance(
                max((weights[block].float() - self.weights[block]).abs().max().item() for block in self.blocks),
                case.dtype)
        self.saved = self.read()
        if not (case.tolerance is None or precision.measured(case.dtype)):
            # the suite's float32 figure, scaled by what this machine's attention kernel measures (precision.py);
            # `mix` (that kernel error itself, pattern @ values against head_outputs) stays the stated figure
            saved = {(f"self_attn.{name}", block): value for (name, block), value in self.saved.items()}
            self.tolerance = precision.cpu_float32(matrix.attention_kernel_error(self.model, saved))

    def edited_tolerance(self, edited_logits: Callable[[torch.nn.Module], torch.Tensor],
                         expected: torch.Tensor) -> float:
        """The tolerance of logits under an edit: `mix`, or where it is measured, at least twice the distance
        transformers' own low-precision forward keeps from `expected` under the same edit (an edit that sharpens
        the attention pattern sharpens its rounding too, beyond what the unedited forward measured)."""
        if self.low is None:
            return self.mix
        with precision.low_precision(self.dtype), torch.no_grad():
            low = edited_logits(self.low)
        return max(self.mix, precision.from_distance(relative_error(low, expected), self.dtype))

    def read(self) -> dict:
        # Saves come back by name from the engine's worker: one saved tensor per internal, stacked over blocks.
        model, blocks = self.model, self.blocks
        with model.trace(PROMPT, **GREEDY):
            read = {name: [] for name in INTERNALS}
            for b in blocks:  # in the order the model computes them
                for name in INTERNALS:
                    read[name].append(getattr(model.layers[b].self_attn, name))
            queries = torch.stack(read["queries"]).save()
            keys = torch.stack(read["keys"]).save()
            values = torch.stack(read["values"]).save()
            scores = torch.stack(read["scores"]).save()
            pattern = torch.stack(read["pattern"]).save()
            head_outputs = torch.stack(read["head_outputs"]).save()
            logits = model.logits.save()
        stacked = {"queries": queries, "keys": keys, "values": values, "scores": scores, "pattern": pattern,
                   "head_outputs": head_outputs}
        # (on a GPU the saves may come back on either device: compare on the oracle's)
        self.logits = logits.to(precision.DEVICE)
        return {(name, block): stacked[name][index].to(precision.DEVICE)
                for name in INTERNALS for index, block in enumerate(blocks)}


@pytest.fixture(scope="module", params=list(precision.selected(CASES)))
def engines(request, checkpoints):
    case = CASES[request.param]
    engines = Engines(case, checkpoints(case.family, **case.overrides))
    yield engines
    engines.model.close()


def test_support_serves_every_internal_on_attention_blocks(engines):
    support = engines.model.support()
    for block in range(engines.model.num_layers):
        for name in INTERNALS:
            reason = support[block].rows[f"self_attn.{name}"]
            assert (reason is None) == (block in engines.blocks), (name, block, reason)


def test_queries_keys_values_and_head_outputs_equal_transformers_channel_for_channel(engines):
    for block in engines.blocks:
        for name in KERNEL_INPUTS:
            value = engines.saved[(name, block)]
            reference = _kernel_reference(engines.name, engines.expected[block], name, value)
            assert value.shape == reference.shape, (name, block, value.shape, reference.shape)
            tolerance = engines.mix if name == "head_outputs" else engines.tolerance
            assert relative_error(value, reference) <= tolerance, (name, block, relative_error(value, reference))
        assert engines.saved[("queries", block)].shape[1] == engines.model.num_heads
        assert engines.saved[("keys", block)].shape[1] == engines.model.num_kv_heads
    model = engines.model  # (a trace body ships what it names to the engine's worker: the model, plain data)
    with model.trace(PROMPT, **GREEDY):
        plain = model.logits.save()
    assert torch.equal(plain.to(precision.DEVICE), engines.logits)  # reading changes nothing


def test_pattern_equals_the_eager_weights_past_windows_and_across_chunks(engines):
    assert engines.input_ids.shape[1] > 128
    config, seq = engines.eager.config, engines.input_ids.shape[1]
    for block in engines.blocks:
        pattern, scores, reference = (engines.saved[("pattern", block)], engines.saved[("scores", block)],
                                      engines.weights[block])
        assert pattern.shape == reference.shape, (block, pattern.shape, reference.shape)
        assert (pattern - reference.float()).abs().max().item() <= engines.pattern_tolerance, block
        assert torch.allclose(pattern.sum(-1), torch.ones((), device=pattern.device), atol=1e-5)
        masked = reference == 0
        assert masked.any(), block
        assert torch.all(pattern[masked] == 0), block
        assert torch.all(torch.isinf(scores[masked])), block
        # Where the model stops looking, the pattern stops too.
        row = pattern[0, 0]
        kind = (getattr(config, "layer_types", None) or [None] * 99)[block]
        window = getattr(config, "sliding_window", None)
        if kind == "chunked_attention":
            chunk = config.attention_chunk_size
            assert torch.all(row[chunk, :chunk] == 0) and row[chunk, chunk] > 0
        elif window and (kind == "sliding_attention" or (kind is None and engines.name == "mistral")):
            assert torch.all(row[seq - 1, :seq - window] == 0) and torch.all(row[seq - 1, seq - window:] > 0)


def test_pattern_at_values_reproduces_head_outputs(engines):
    for block in engines.blocks:
        pattern, values = engines.saved[("pattern", block)], engines.saved[("values", block)].float()
        mix = (pattern @ repeat_heads(values, pattern.shape[1])).transpose(1, 2)
        assert relative_error(mix, engines.saved[("head_outputs", block)]) <= engines.mix, block


def test_zeroing_a_head_gives_transformers_logits(engines):
    model, block, head = engines.model, engines.blocks[-1], 1
    with model.trace(PROMPT, **GREEDY):
        model.layers[block].self_attn.head_outputs[:, :, head] = 0
        logits = model.logits.save()
    head_dim = engines.expected[block]["queries"].shape[-1]
    expected = oracle.logits_with_head_zeroed(engines.reference, engines.input_ids, block, head, head_dim)[:, -1]
    assert not torch.allclose(expected, engines.reference(engines.input_ids).logits[:, -1])
    assert relative_error(logits, expected) <= engines.mix


@torch.no_grad()
def _logits_with_kernel_edit(model, family, input_ids, block, name, edit):
    """transformers' logits with `edit` applied to the queries or keys block `block`'s kernel receives."""
    def edited(index, kernel, before, query, key, value, *rest, **kwargs):
        if index == block:
            if name == "queries":
                query = query.clone()
                edit(query)
            else:
                key = key.clone()
                edit(key)
        return kernel(*before, query, key, value, *rest, **kwargs)

    with oracle.kernel_wrapped(model, family, edited):
        return model(input_ids).logits


@pytest.mark.parametrize("name", ["queries", "keys"])
def test_editing_one_channel_has_the_effect_it_has_on_transformers(engines, name):
    model, block = engines.model, engines.blocks[0]

    def edit(tensor):  # queries: one head's channel; keys: every kv head's (Falcon's kernel gets copies)
        if name == "queries":
            tensor[:, 0, :, CHANNEL] *= 3.0
        else:
            tensor[..., CHANNEL] += 0.5

    with model.trace(PROMPT, **GREEDY):
        edit(getattr(model.layers[block].self_attn, name))
        logits = model.logits.save()
    expected = _logits_with_kernel_edit(engines.reference, engines.name, engines.input_ids, block, name, edit)[:, -1]
    assert not torch.allclose(expected, engines.reference(engines.input_ids).logits[:, -1])
    assert relative_error(logits, expected) <= engines.mix


def test_decode_steps_serve_the_pattern_row_over_the_whole_prefix(engines):
    model, blocks = engines.model, engines.blocks
    with model.trace(PROMPT, temperature=0.0, max_tokens=DECODE_STEPS) as tracer:
        rows = list().save()
        for step in tracer.iter[:DECODE_STEPS]:
            rows.append(torch.stack([model.layers[b].self_attn.pattern[0, :, -1] for b in blocks]))
        result = tracer.result.save()
    generated = list(result.outputs[0].token_ids)
    full = torch.cat([engines.input_ids, torch.tensor([generated[:-1]], device=engines.input_ids.device)], dim=1)
    weights = oracle.eager_weights(engines.eager, full)
    prompt_length = engines.input_ids.shape[1]
    assert len(rows) == DECODE_STEPS
    for step, row in enumerate(rows):
        position = prompt_length - 1 + step
        assert row.shape[-1] == position + 1, (step, row.shape)
        for index, block in enumerate(blocks):
            expected = weights[block][0, :, position, :position + 1].float()
            got = row[index].to(expected.device)
            assert (got - expected).abs().max().item() <= engines.pattern_tolerance, (step, block)
            assert torch.all(got[expected == 0] == 0), (step, block)


def test_recomputed_values_refuse_writes_and_the_engine_serves_on(engines):
    model, block = engines.model, engines.blocks[0]
    for name in ("scores", "pattern"):
        with pytest.raises(ValueError, match="cannot be written"):
            with model.trace(PROMPT, **GREEDY):
                getattr(model.layers[block].self_attn, name)[:] = 0
                model.logits.save()
    with model.trace(PROMPT, **GREEDY):
        logits = model.logits.save()
    assert torch.equal(logits.to(precision.DEVICE), engines.logits)


def test_a_decode_read_without_the_earlier_steps_says_what_it_needs(engines):
    model, block = engines.model, engines.blocks[0]
    with pytest.raises(ValueError, match="every earlier step"):
        with model.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:
            for step in tracer.iter[1:2]:
                model.layers[block].self_attn.pattern.save()


def test_invokes_batched_together_each_serve_their_own_request(engines):
    # Two requests in one step, with their decode steps: each invoke's values, and the prefix its decode
    # scores span, are its own request's (the keys of earlier steps are kept per request).
    model, block = engines.model, engines.blocks[-1]
    prompts = [PROMPT, "Once upon a time"]
    generate = {"temperature": 0.0, "max_tokens": 2}
    with model.trace(**generate) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                rows = list().save()
                queries = list().save()
                for step in tracer.iter[:2]:
                    attention = model.layers[block].self_attn
                    queries.append(attention.queries[0, :, -1].clone())
                    rows.append(attention.pattern[0, :, -1].clone())
    assert len(rows) == len(queries) == 2
    for index, prompt in enumerate(prompts):
        with model.trace(prompt, **generate) as tracer:
            solo_rows = list().save()
            solo_queries = list().save()
            for step in tracer.iter[:2]:
                attention = model.layers[block].self_attn
                solo_queries.append(attention.queries[0, :, -1].clone())
                solo_rows.append(attention.pattern[0, :, -1].clone())
        for step in range(2):
            assert rows[index][step].shape == solo_rows[step].shape, (index, step)
            assert relative_error(rows[index][step], solo_rows[step]) <= engines.mix, (index, step)
            assert relative_error(queries[index][step], solo_queries[step]) <= engines.mix, (index, step)


@pytest.mark.parametrize("name", ["queries_pre_rotary", "keys_pre_rotary"])
def test_editing_queries_or_keys_before_the_rotary_has_the_effect_it_has_on_transformers(engines, name):
    """An edit before the rotary reaches vLLM's model, on every attention block (rotating or not): the logits are
    transformers' with the same edit made where its own modules hold the tensor (the rotary's arguments)."""
    # every head alike (Falcon's kernel gets a copy of each kv head per query head), scaled: a shift of every key
    # alike would move each query's scores by one constant, which the softmax drops. One channel where the tolerance
    # is float32's; where it is measured at a lower precision, half the channels, flipped and 8 times (one channel
    # moves Qwen3-Next's bfloat16 logits less than twice that tolerance, so a dropped edit would pass)
    _edits_have_transformers_effect(engines, name, oracle.logits_with_pre_rotary_edit)


@pytest.mark.parametrize("name", ["queries_projected", "keys_projected"])
def test_editing_the_query_or_key_projection_has_the_effect_it_has_on_transformers(engines, name):
    """An edit of the projection before any q/k norm reaches vLLM's model, on every attention block: the logits
    are transformers' with the same edit made where its own modules hold the tensor (the q/k norm's input, or the
    rotary's arguments where nothing norms)."""
    # as the pre-rotary edit test; flipped as well as scaled, since the q/k norm that follows takes back most of a
    # mere scaling (and bounds what the edit can move: Qwen3-Next's logits move less than twice its bfloat16
    # tolerance, hence the measured rule for a dropped edit)
    _edits_have_transformers_effect(engines, name, oracle.logits_with_projected_edit)


def _edits_have_transformers_effect(engines, name: str, edited_by: Callable[..., torch.Tensor]) -> None:
    """On every attention block, `name` edited in a trace gives the logits of transformers' forward with the same
    edit (`edited_by`, the oracle's edited forward): within the edited tolerance (`Engines.edited_tolerance`), and a
    dropped edit fails. In float32 the edit moves transformers' logits past twice the tolerance; where the
    tolerance is measured, an edit of the queries or keys alone may move the logits less than that (a tiny GPT-2's
    attention moves its logits by 3% whatever its pattern; bfloat16's tolerance is 1.7%), so there the edited run
    must be nearer transformers' edited logits than its unedited ones, which a dropped edit is not."""
    model = engines.model
    measured = engines.mix > RELATIVE

    def edit(tensor):
        if measured:
            tensor[..., :tensor.shape[-1] // 2] *= -8.0
        else:
            tensor[..., CHANNEL] *= 3.0

    unedited = engines.reference(engines.input_ids).logits[:, -1]
    for block in engines.blocks:
        with model.trace(PROMPT, **GREEDY):
            edit(getattr(model.layers[block].self_attn, name))
            logits = model.logits.save()

        def edited_logits(reference, block=block):
            return edited_by(reference, engines.name, engines.input_ids, block, name, edit)[:, -1]

        expected = edited_logits(engines.reference)
        assert relative_error(logits, expected) <= engines.edited_tolerance(edited_logits, expected), block
        if measured:
            assert relative_error(logits, expected) < relative_error(logits, unedited), (block, "edit dropped")
        else:
            assert relative_error(expected, unedited) > 2 * engines.mix, (block, "an edit dropped would pass")
