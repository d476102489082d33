"""The workflows on vLLM against transformers' own forward read with torch hooks (the oracle).

One engine per family, shared by the module's tests of it: a pre-norm (llama),
a parallel (gptj), a post-norm (olmo2) and a sandwich with a final soft cap
(gemma2). The cache's per-request values, the lens computed in the worker with
the engine's own head, patches run as invokes of one step, and steering over
many generated tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attention_oracle
import matrix
import oracle
import precision
from bulk_checks import ROUNDING
from access import difference_tolerance, relative_error, sum_tolerance
import streamscope
from streamscope.vllm.model import beside_engine

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
CLEAN, CORRUPTED = "Paris is in Italy", "Rome is in Italy"
GREEDY = {"temperature": 0.0, "max_tokens": 1}
FAMILIES = ["llama", "gptj", "olmo2", "gemma2"]


class Engine:
    def __init__(self, family: str, path):
        self.name = family
        self.model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
        # The family's own function: Gemma 2's sdpa forward in transformers drops its attention soft cap, which
        # vLLM computes (5e-4 apart on this checkpoint), so its reference is the eager forward.
        implementation = attention_oracle.exact_implementation(family)
        with beside_engine():
            self.reference = AutoModelForCausalLM.from_pretrained(
                path, **attention_oracle.load_kwargs(family, implementation)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.ids = [self.tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        self.expected = [oracle.values(self.reference, family, ids) for ids in self.ids]
        # On a GPU: what a batched request keeps from its solo run there. On the CPU: the suite's float32 figure,
        # scaled by what this machine's attention kernel measures against torch's arithmetic (tests/precision.py).
        if precision.ON_GPU:
            self.tolerance = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE]
        else:
            attention = matrix.read(self.model, matrix.attention_steps(self.model), PROMPTS[0], **GREEDY)
            self.tolerance = precision.cpu_float32(matrix.attention_kernel_error(self.model, attention))


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, checkpoints):
    engine = Engine(request.param, checkpoints(request.param))
    yield engine
    engine.model.close()


def test_cache_of_several_requests_equals_the_oracle(engine):
    cache = engine.model.cache(PROMPTS, padding_side="right")  # each prompt's values are its first positions
    assert cache.mask.sum(-1).tolist() == [ids.shape[1] for ids in engine.ids]
    checked = 0
    for row, (ids, expected) in enumerate(zip(engine.ids, engine.expected)):
        length = ids.shape[1]
        for name in (*oracle.BOUNDARIES, *oracle.CONTRIBUTIONS, *oracle.NEURONS):
            for block, reference in enumerate(expected.get(name, [])):
                if reference is None:
                    with pytest.raises(streamscope.Unavailable):
                        cache[f"layers.{block}.{name}"]
                    continue
                value = cache[f"layers.{block}.{name}"][row : row + 1, :length]
                assert relative_error(value, reference) <= engine.tolerance, (name, block, row)
                checked += 1
        assert relative_error(cache.logits[row : row + 1, :length], expected["logits"]) <= engine.tolerance
        # A lookup: exact, but for the engine's dtype (its rounding in a bfloat16 run).
        assert relative_error(cache["hook_embed"][row : row + 1, :length], expected["token_embeddings"]) <= ROUNDING
    assert checked >= 2 * 4 * engine.model.num_layers
    parts = cache.decompose_resid()
    final = engine.expected[0]["layer_output"][-1]
    assert relative_error(parts.sum(0)[:1, : engine.ids[0].shape[1]], final) <= engine.tolerance
    # logit_attrs with the engine's own unembedding rows, read in the worker: summed, the raw logit.
    attrs = cache.logit_attrs(parts, tokens=7, convention="transformer_lens", norm_weight=True)[:, :1, : engine.ids[0].shape[1]]
    head = engine.reference.get_output_embeddings()
    raw = head(engine.expected[0]["final_norm_output"])[..., 7]
    norm = oracle.site(engine.reference, engine.name, "final_norm_output")[0]
    if getattr(norm, "bias", None) is not None:  # the norm's and the head's biases belong to no component
        raw = raw - norm.bias @ head.weight[7]
    if getattr(head, "bias", None) is not None:
        raw = raw - head.bias[7]
    # Each part is held to the tolerance of its own scale, so their sum to the sum of those bounds.
    # On a GPU run the cache's tensors and the reference's sit on different devices: compare on the host.
    assert (attrs.sum(0).float().cpu() - raw.float().cpu()).abs().max().item() <= sum_tolerance(attrs, engine.tolerance)


def test_lens_in_the_worker_equals_the_hooked_head(engine):
    result = streamscope.lens(engine.model, PROMPTS[0], keep_logits=True)
    norm = oracle.site(engine.reference, engine.name, "final_norm_output")[0]
    cap = getattr(engine.reference.config, "final_logit_softcapping", None)
    for block in range(engine.model.num_layers):
        with torch.no_grad():
            logits = engine.reference.get_output_embeddings()(norm(engine.expected[0]["layer_output"][block]))[0]
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        assert relative_error(result.logits[block], logits) <= engine.tolerance, block
    top = streamscope.lens(engine.model, PROMPTS[0], top_k=4)
    assert top.logits is None and top.top_ids.shape == (engine.model.num_layers, engine.ids[0].shape[1], 4)
    assert torch.equal(top.top_ids[:, -1], result.top_ids[:, -1, :4])


def test_patches_run_as_invokes_of_one_step_and_match_hooked_patches(engine):
    clean_ids = engine.tokenizer(CLEAN, return_tensors="pt").input_ids
    corrupted_ids = engine.tokenizer(CORRUPTED, return_tensors="pt").input_ids
    layers = [0, engine.model.num_layers - 1]
    result = streamscope.patch(engine.model, CLEAN, CORRUPTED, answer=3, wrong=4, layers=layers, batch_size=32)
    assert result.effects.shape == (2, clean_ids.shape[1])
    clean = oracle.values(engine.reference, engine.name, clean_ids)["layer_output"]
    for row, block in enumerate(layers):
        for position in range(clean_ids.shape[1]):
            module, where, _ = oracle.site(engine.reference, engine.name, "layer_output", block)

            def replace(tensor, block=block, position=position):
                tensor[:, position] = clean[block][:, position]

            with torch.no_grad(), oracle.hooked(module, where, replace):
                logits = engine.reference(corrupted_ids).logits[0, -1]
            expected = (logits[3] - logits[4]).item()
            # A difference of two logits, each held to the engine's tolerance of the logits' scale.
            bound = difference_tolerance(logits, engine.tolerance)
            assert result.effects[row, position].item() == pytest.approx(expected, abs=bound), (block, position)


def test_patching_takes_blocks_in_any_order_and_answers_in_that_order(engine):
    """Blocks asked last-first are read in the model's order and answered in the order asked: each row equals the
    same block's row of the ascending run (itself held to the hooked patches above)."""
    last = engine.model.num_layers - 1
    ascending = streamscope.patch(engine.model, CLEAN, CORRUPTED, answer=3, wrong=4, layers=[0, last])
    descending = streamscope.patch(engine.model, CLEAN, CORRUPTED, answer=3, wrong=4, layers=[last, 0])
    assert torch.equal(descending.effects, ascending.effects.flip(0))


def test_patching_head_results_and_neurons_matches_hooked_patches(engine):
    """Each head's result (after the output projection) patched from the clean run at two positions, against
    transformers whose output projection's output is moved by the two results' difference by a hook; and each
    block's MLP neurons at the last position, against transformers' down projection's input replaced by a hook."""
    model = engine.model
    clean_ids = engine.tokenizer(CLEAN, return_tensors="pt").input_ids
    corrupted_ids = engine.tokenizer(CORRUPTED, return_tensors="pt").input_ids
    positions, layers = [1, clean_ids.shape[1] - 1], [0, model.num_layers - 1]
    result = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value="head_results", layers=layers,
                               positions=positions, batch_size=32)
    assert result.effects.shape == (2, model.num_heads)
    for row, block in enumerate(layers):
        for head in range(model.num_heads):
            logits = attention_oracle.logits_with_head_result_patched(engine.reference, clean_ids, corrupted_ids,
                                                                      block, head, model.head_dim, positions)
            bound = difference_tolerance(logits, engine.tolerance)
            assert result.effects[row, head].item() == pytest.approx((logits[3] - logits[4]).item(), abs=bound)
    served = [block for block in layers if model.layers[block].support()["mlp.neurons"] is None]
    result = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value="mlp.neurons", layers=served,
                               positions=[clean_ids.shape[1] - 1])
    clean = oracle.values(engine.reference, engine.name, clean_ids)["neurons"]
    for row, block in enumerate(served):
        module, where, _ = oracle.site(engine.reference, engine.name, "neurons", block)

        def replace(tensor, block=block):
            tensor[:, -1] = clean[block][:, -1]

        with torch.no_grad(), oracle.hooked(module, where, replace):
            logits = engine.reference(corrupted_ids).logits[0, -1]
        bound = difference_tolerance(logits, engine.tolerance)
        assert result.effects[row, 0].item() == pytest.approx((logits[3] - logits[4]).item(), abs=bound), block


def test_patches_run_on_the_bulk_path_as_one_engine_run_and_equal_the_traced_patches(engine, monkeypatch):
    """A block value's patches run as requests of one bulk run (`Engine.set_each`), never as a trace invoke per
    patch (on an H200 that route took 19.6x the plain forwards); the numbers equal the traced route's bit for
    bit on the CPU. Head values keep the trace (`patching._trace_route` says why)."""
    model = engine.model
    kind = type(model.engine)
    calls: dict[str, list[int]] = {"set_each": [], "run_each": []}

    def counted(name):
        original = getattr(kind, name)

        def method(self, prompt, items):
            calls[name].append(len(items))
            return original(self, prompt, items)
        return method

    monkeypatch.setattr(kind, "set_each", counted("set_each"))
    monkeypatch.setattr(kind, "run_each", counted("run_each"))
    layers, positions = [0, model.num_layers - 1], [0, 2, -1]
    served = [block for block in layers if model.layers[block].support()["mlp.neurons"] is None]
    found = {value: streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value=value, positions=positions,
                                      layers=layers if value == "layer_output" else served)
             for value in ("layer_output", "mlp.neurons")}
    assert calls == {"set_each": [len(layers) * len(positions), len(served) * len(positions)], "run_each": []}
    heads = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value="head_outputs", layers=[0],
                              positions=[-1])
    assert calls["run_each"] == [model.num_heads] and heads.effects.shape == (1, model.num_heads)
    # The same patches through the trace's invokes, as every patch ran before the bulk route.
    monkeypatch.setattr(kind, "settable", lambda self, value, block: "forced onto the trace by the test")
    for value, result in found.items():
        traced = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value=value, positions=positions,
                                   layers=result.layers)
        if precision.ON_GPU:  # a GPU's kernels need not round the two routes alike: the engine's tolerance
            assert relative_error(result.effects, traced.effects) <= engine.tolerance, value
        else:
            assert torch.equal(result.effects, traced.effects), value
    assert calls["set_each"] == [len(layers) * len(positions), len(served) * len(positions)]


def test_steering_over_generated_tokens_matches_a_hooked_generate(engine):
    if engine.name != "llama":
        pytest.skip("one family suffices for the trace syntax; the values are tested on every family above")
    model, steps = engine.model, 5
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0)) * 4
    # The README's syntax on vLLM: the prompt's step, then one step per generated token.
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        tokens = list().save()
        for step in tracer.iter[:]:
            stream = model.layers[1].layer_output
            stream[:, -1] += vector.to(device=stream.device, dtype=stream.dtype)
            tokens.append(model.logits[0].argmax(-1))
    # The oracle: greedy decoding by whole forwards, the vector added at every position that was the last one
    # at some step (the prompt's last, then each generated token), as a cached generation sees it.
    ids = engine.ids[1]
    start = ids.shape[1] - 1

    def add(_, args, output):
        (output if isinstance(output, torch.Tensor) else output[0])[:, start:].add_(vector)

    handle = engine.reference.model.layers[1].register_forward_hook(add)
    try:
        with torch.no_grad():
            for _ in range(steps):
                next_token = engine.reference(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, next_token.view(1, 1)], dim=1)
    finally:
        handle.remove()
    assert [int(token) for token in tokens] == ids[0, -steps:].tolist()
