"""The workflows on transformers against oracles that are not streamscope.

The oracle is transformers' own float32 forward read and edited with plain
torch hooks (`oracle.py`, `attention_oracle.py`), and TransformerLens's
definitions written out here from its formulas (its ActivationCache's
`decompose_resid`, `apply_ln_to_stack` and `logit_attrs`; its attention hooks'
layouts). Families: a pre-norm (llama), learned positions with biased layer
norms (gpt2), two parallel (gptj, gpt_neox), a post-norm (olmo2), a sandwich
with a final soft cap (gemma2), scaled logits (granite, cohere) and a
state-space one (mamba).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attention_oracle
import oracle
from access import relative_error
import streamscope
from streamscope.errors import PARALLEL

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
RELATIVE = 1e-5  # float32 on CPU, the same ops: rounding only
FAMILIES = ["llama", "gpt2", "gptj", "gpt_neox", "olmo2", "gemma2", "granite", "cohere", "mamba"]
#: A clean/corrupted pair of the same token count under the tiny tokenizer.
CLEAN, CORRUPTED = "Paris is in Italy", "Rome is in Italy"


class Family:
    def __init__(self, name: str, path):
        self.name, self.path = name, path
        self.model = streamscope.load(path)
        self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.ids = [self.tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        self.expected = [oracle.values(self.reference, name, ids) for ids in self.ids]
        # Padded on the right: the checks below cut each prompt's values to its first positions.
        self.cache = self.model.cache(PROMPTS, padding_side="right")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, checkpoints):
    return Family(request.param, checkpoints(request.param))


def _head(reference, family: str, normed: torch.Tensor) -> torch.Tensor:
    """The family's unembedding with its final soft cap or scale, written from each modeling file."""
    logits = reference.get_output_embeddings()(normed)
    config = reference.config
    if family == "gemma2":
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    if family == "granite":
        logits = logits / config.logits_scaling
    if family == "cohere":
        logits = logits * config.logit_scale
    return logits


def _final_norm(reference, family: str) -> torch.nn.Module:
    return oracle.site(reference, family, "final_norm_output")[0]


# The cache.


def test_cache_holds_every_served_value_of_each_prompt_as_the_oracle_computes_it(family):
    cache = family.cache
    assert cache.tokens.shape[0] == 2 and cache.mask.sum(-1).tolist() == [ids.shape[1] for ids in family.ids]
    checked = 0
    for row, (ids, expected) in enumerate(zip(family.ids, family.expected)):
        length = ids.shape[1]
        for name in (*oracle.BOUNDARIES, *oracle.CONTRIBUTIONS, *oracle.NEURONS):
            for block, reference in enumerate(expected.get(name, [])):
                if reference is None:
                    with pytest.raises((streamscope.Unavailable, KeyError)):
                        cache[f"layers.{block}.{name}"]
                    continue
                value = cache[f"layers.{block}.{name}"]
                assert relative_error(value[row : row + 1, :length], reference) <= RELATIVE, (name, block, row)
                assert value[row, length:].abs().max().item() == 0 if length < value.shape[1] else True
                checked += 1
        for name in ("token_embeddings", "final_norm_output"):
            assert relative_error(cache[name][row : row + 1, :length], expected[name]) <= RELATIVE, name
        assert relative_error(cache.logits[row : row + 1, :length], expected["logits"]) <= RELATIVE
    assert checked >= 2 * 4 * family.model.num_layers


def test_transformer_lens_names_reach_the_same_tensors(family):
    cache, last = family.cache, family.model.num_layers - 1
    pairs = {"hook_embed": "token_embeddings", "ln_final.hook_out": "final_norm_output",
             "blocks.1.hook_resid_pre": "layers.1.layer_input", "blocks.1.hook_resid_post": "layers.1.layer_output"}
    for tl, name in pairs.items():
        assert cache[tl] is cache[name]
    assert torch.equal(cache.stack("hook_resid_post"), cache.stack("layer_output"))
    assert cache.stack("layer_output").shape == (family.model.num_layers, *cache["token_embeddings"].shape)
    support = family.model.layers[1].support()
    if support["layer_mid"] is None:
        assert cache["blocks.1.hook_resid_mid"] is cache["layers.1.layer_mid"]
    else:
        with pytest.raises(streamscope.Unavailable, match="resid_mid|layer_mid") as error:
            cache["blocks.1.hook_resid_mid"]
        assert error.value.reason == support["layer_mid"]
        if family.name in ("gptj", "gpt_neox"):
            assert error.value.reason == PARALLEL
    neurons = family.model.layers[last].support()["mlp.neurons"]
    if neurons is None:  # TL's mlp.hook_pre/hook_post are the neurons, before and after the nonlinearity
        assert cache[f"blocks.{last}.mlp.hook_post"] is cache[f"layers.{last}.mlp.neurons"]
        assert cache[f"blocks.{last}.mlp.hook_pre"] is cache[f"layers.{last}.mlp.neurons_pre"]
    else:
        with pytest.raises(streamscope.Unavailable) as error:
            cache[f"blocks.{last}.mlp.hook_post"]
        assert error.value.reason == neurons
    if family.name != "mamba":  # each head's result is computed from head_outputs, which the default cache reads
        results = cache[f"blocks.{last}.attn.hook_result"]
        assert results.shape[:-1] == cache[f"blocks.{last}.attn.hook_z"].shape[:-1]


def test_position_embeddings_where_the_family_adds_them(family):
    cache = family.cache
    if family.name != "gpt2":
        with pytest.raises(streamscope.Unavailable, match="adds no position embedding"):
            cache["hook_pos_embed"]
        return
    # TransformerLens's hook_pos_embed: W_pos[positions], read off GPT-2's own table.
    length = family.ids[0].shape[1]
    expected = family.reference.transformer.wpe.weight[:length]
    assert relative_error(cache["hook_pos_embed"][0, :length], expected) <= RELATIVE


def test_accumulated_resid_is_each_block_input_then_the_final_stream(family):
    stack, labels = family.cache.accumulated_resid(return_labels=True)
    count = family.model.num_layers
    assert labels == [f"{i}_pre" for i in range(count)] + ["final_post"]
    expected = family.expected[0]
    length = family.ids[0].shape[1]
    for index in range(count):
        assert relative_error(stack[index, :1, :length], expected["layer_input"][index]) <= RELATIVE
    assert relative_error(stack[-1, :1, :length], expected["layer_output"][-1]) <= RELATIVE


def test_decompose_resid_sums_to_the_final_stream(family):
    parts, labels = family.cache.decompose_resid(return_labels=True)
    embeds = 2 if family.name == "gpt2" else 1  # TransformerLens 4.3: embed, then pos_embed where learned
    assert labels[0] == "embed" and labels[embeds] == "0_attn_out"
    if family.name == "mamba":  # one sublayer: the mixer's output per block, no MLP
        assert len(labels) == embeds + family.model.num_layers
    else:
        assert len(labels) == embeds + 2 * family.model.num_layers
    length = family.ids[0].shape[1]
    final = family.expected[0]["layer_output"][-1]
    assert relative_error(parts.sum(0)[:1, :length], final) <= RELATIVE


def test_decompose_resid_says_why_on_a_post_ln_block(checkpoints):
    model = streamscope.load(checkpoints("opt", do_layer_norm_before=False))
    cache = model.cache("Rome is in Italy")
    with pytest.raises(streamscope.Unavailable, match="post-LN"):
        cache.decompose_resid()


def _tl_apply_ln(stack: torch.Tensor, final: torch.Tensor, norm: torch.nn.Module, gemma: bool) -> torch.Tensor:
    """TransformerLens's apply_ln_to_stack on a model whose norm weights are applied, not folded:
    centre each component where the norm centres, divide by the final stream's scale, times the weight."""
    centred = "RMS" not in type(norm).__name__  # LayerNorm, CohereLayerNorm centre; the RMS norms do not
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None) or norm.epsilon
    x = final - final.mean(-1, keepdim=True) if centred else final
    scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    parts = stack - stack.mean(-1, keepdim=True) if centred else stack
    weight = norm.weight + 1 if gemma else norm.weight
    return parts / scale * weight


def test_logit_attrs_follow_transformer_lens_and_sum_to_the_logit(family):
    cache, reference = family.cache, family.reference
    parts = cache.decompose_resid()
    token = 7
    attrs = cache.logit_attrs(parts, tokens=token, convention="transformer_lens", norm_weight=True)
    assert attrs.shape == parts.shape[:3]
    length = family.ids[0].shape[1]
    norm = _final_norm(reference, family.name)
    final = family.expected[0]["layer_output"][-1]
    expected = _tl_apply_ln(parts[:, :1, :length], final, norm, gemma=family.name == "gemma2")
    row = reference.get_output_embeddings().weight[token]
    expected = expected @ row
    assert relative_error(attrs[:, :1, :length], expected) <= 1e-5
    # Summed, the model's logit before any soft cap or scale, less the unembedded norm bias.
    raw = reference.get_output_embeddings()(family.expected[0]["final_norm_output"])[..., token]
    bias = getattr(norm, "bias", None)
    if bias is not None:
        raw = raw - bias @ row
    head_bias = getattr(reference.get_output_embeddings(), "bias", None)
    if head_bias is not None:  # GPT-J's unembedding has a bias
        raw = raw - head_bias[token]
    assert relative_error(attrs[:, :1, :length].sum(0), raw) <= 1e-5


def test_attention_hooks_match_transformers_eager_weights_and_output_projection(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path)
    eager = AutoModelForCausalLM.from_pretrained(path, **attention_oracle.load_kwargs("llama", "eager")).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPTS[0], return_tensors="pt").input_ids
    values = ["self_attn.queries_projected", "self_attn.keys_projected", "self_attn.queries", "self_attn.keys",
              "self_attn.values", "self_attn.pattern", "self_attn.scores", "self_attn.head_outputs",
              "attention_output"]
    cache = model.cache(PROMPTS[0], values=values)
    weights = attention_oracle.eager_weights(eager, ids)
    projected = attention_oracle.output_projection_inputs(eager, ids)
    heads, head_dim = model.num_heads, model.head_dim
    for block in range(model.num_layers):
        assert relative_error(cache[f"blocks.{block}.attn.hook_pattern"], weights[block]) <= RELATIVE
        scores = cache[f"blocks.{block}.attn.hook_attn_scores"]
        assert torch.isinf(scores[0, :, 0, 1:]).all()  # causal: -inf above the diagonal, as TransformerLens masks
        # TransformerLens's layouts: q/k/v [batch, pos, head, d_head]; z the same, the output projection's input.
        assert cache[f"blocks.{block}.attn.hook_rot_q"].shape == (1, ids.shape[1], heads, head_dim)
        assert cache[f"blocks.{block}.attn.hook_v"].shape == (1, ids.shape[1], model.num_kv_heads, head_dim)
        z = cache[f"blocks.{block}.attn.hook_z"]
        assert relative_error(z.reshape(1, ids.shape[1], -1), projected[block]) <= RELATIVE
        # attn_out = sum over heads of z_h W_O_h (TransformerLens's definition of hook_attn_out).
        w_o = eager.model.layers[block].self_attn.o_proj.weight.view(-1, heads, head_dim)
        attn_out = torch.einsum("bshd,mhd->bsm", z, w_o)
        assert relative_error(attn_out, cache[f"blocks.{block}.hook_attn_out"]) <= RELATIVE
    # TransformerLens's hook_q / hook_k: the projections before any q/k norm and the rotary (Llama norms nothing
    # there: the arguments transformers hands its rotary), TL's layout.
    kernel = attention_oracle.kernel_tensors(eager, "llama", ids)
    unrotated = attention_oracle.projected_tensors(eager, "llama", ids,
                                                   attention_oracle.pre_rotary_tensors(eager, "llama", ids, kernel))
    for block in range(model.num_layers):
        for hook, name in (("hook_q", "queries_projected"), ("hook_k", "keys_projected")):
            assert relative_error(cache[f"blocks.{block}.attn.{hook}"], unrotated[block][name].transpose(1, 2)) \
                <= RELATIVE, (block, hook)
        assert not torch.allclose(cache[f"blocks.{block}.attn.hook_q"], cache[f"blocks.{block}.attn.hook_rot_q"])


# The logit lens.


def test_lens_is_each_block_through_the_models_own_head(family):
    result = streamscope.lens(family.model, PROMPTS[0], keep_logits=True, top_k=5)
    count = family.model.num_layers
    ids = family.ids[0]
    assert result.logits.shape == (count, ids.shape[1], family.model.vocab_size)
    norm = _final_norm(family.reference, family.name)
    for block in range(count):
        stream = family.expected[0]["layer_output"][block]
        expected = _head(family.reference, family.name, norm(stream))[0]
        assert relative_error(result.logits[block], expected) <= RELATIVE, block
    assert relative_error(result.logits[-1], family.expected[0]["logits"][0]) <= RELATIVE
    top = result.logits.softmax(-1).topk(5)
    assert torch.equal(result.top_ids, top.indices)
    assert len(result.tokens) == ids.shape[1]
    table = str(result)
    assert table.count("block") == count and "logit lens" in table


def test_lens_of_another_boundary_and_top_k_only(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path)
    full = streamscope.lens(model, PROMPTS[1], value="layer_mid", keep_logits=True, top_k=3)
    top = streamscope.lens(model, PROMPTS[1], value="layer_mid", top_k=3, layers=[0, -1])
    assert top.logits is None and top.layers == [0, model.num_layers - 1]
    assert torch.equal(top.top_ids, full.top_ids[[0, -1]])
    assert torch.allclose(top.top_probs, full.top_probs[[0, -1]], atol=1e-6)
    with pytest.raises(ValueError, match="top k"):
        top.rank(5)
    assert full.rank(int(full.top_ids[0, 0, 0]))[0, 0] == 0


# Activation patching.


def _oracle_patch(family: Family, clean_ids, corrupted_ids, name: str, block: int, position: int, token_a, token_b):
    """The corrupted run with value `name` of `block` at `position` set to the clean run's, by torch hooks."""
    clean = oracle.values(family.reference, family.name, clean_ids)[name][block]
    module, where, factor = oracle.site(family.reference, family.name, name, block)

    def replace(tensor):
        stream = oracle._as_stream(tensor, corrupted_ids.shape)
        stream[:, position] = clean[:, position] / (factor or 1)

    with torch.no_grad(), oracle.hooked(module, where, replace):
        logits = family.reference(corrupted_ids).logits[0, -1]
    return (logits[token_a] - logits[token_b]).item()


@pytest.mark.parametrize("name", ["layer_output", "layer_mid", "attention_output", "neurons"])
def test_patching_matches_hooked_patches(family, name):
    _check_patching(family, name)


def test_patching_takes_blocks_in_any_order_and_answers_in_that_order(checkpoints):
    """Blocks asked last-first are read in the model's order and answered in the order asked: each row equals the
    same block's row of the ascending run (itself held to the hooked patches above)."""
    model = streamscope.load(checkpoints("llama"))
    last = model.num_layers - 1
    ascending = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, layers=[0, last])
    descending = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, layers=[last, 0])
    assert torch.equal(descending.effects, ascending.effects.flip(0))


#: Values a family holds as flattened tokens, [batch * seq, hidden], around its MLP: their patches share a batched
#: forward as every value's do, each invoke editing only its own rows.
FLATTENED_PATCHES = [("opt", "layer_mid"), ("opt", "mlp_output"), ("llama4_text", "mlp_output")]


@pytest.mark.parametrize("family_name, name", FLATTENED_PATCHES)
def test_patching_a_flattened_value_matches_hooked_patches(family_name, name, checkpoints):
    family = Family(family_name, checkpoints(family_name))
    layers = None
    if family_name == "llama4_text":  # a dense block and a mixture of experts (whose output is flattened)
        layers = [0, family.reference.config.moe_layers[0]]
        assert hasattr(family.reference.model.layers[layers[1]].feed_forward, "experts")
    _check_patching(family, name, layers)


def _check_patching(family: Family, name: str, layers=None) -> None:
    """`patch` of `name` on `layers` (blocks 0 and the last by default), at the second and last positions,
    against hooked patches."""
    model = family.model
    rows = model.layers[0].support().rows
    reason = rows.get(name, rows.get(f"mlp.{name}")) if name != "attention_output" else None
    clean_ids = family.tokenizer(CLEAN, return_tensors="pt").input_ids
    corrupted_ids = family.tokenizer(CORRUPTED, return_tensors="pt").input_ids
    if reason is not None:
        with pytest.raises(streamscope.Unavailable):
            streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value=name)
        return
    if family.name == "mamba" and name == "attention_output":
        name_for_patch = "attention_output"  # the mixer's contribution
    else:
        name_for_patch = name
    layers = [0, model.num_layers - 1] if layers is None else layers
    result = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value=name_for_patch, layers=layers)
    assert result.effects.shape == (2, clean_ids.shape[1])
    if name == "neurons":  # a neuron patch is the whole activation vector at one position
        assert not torch.allclose(result.effects, torch.full_like(result.effects, result.corrupted))
    with torch.no_grad():
        clean_logits = family.reference(clean_ids).logits[0, -1]
        corrupted_logits = family.reference(corrupted_ids).logits[0, -1]
    assert result.clean == pytest.approx((clean_logits[3] - clean_logits[4]).item(), abs=1e-5)
    assert result.corrupted == pytest.approx((corrupted_logits[3] - corrupted_logits[4]).item(), abs=1e-5)
    for row, block in enumerate(layers):
        for position in (1, clean_ids.shape[1] - 1):
            expected = _oracle_patch(family, clean_ids, corrupted_ids, name, block, position, 3, 4)
            assert result.effects[row, position].item() == pytest.approx(expected, abs=1e-4), (block, position)
    # Patching the last block's stream at the last position restores the clean run exactly.
    if name == "layer_output":
        assert result.normalized[-1, -1].item() == pytest.approx(1.0, abs=1e-4)


def test_patching_heads_matches_hooked_output_projection(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path)
    reference = attention_oracle.reference_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    clean_ids = tokenizer(CLEAN, return_tensors="pt").input_ids
    corrupted_ids = tokenizer(CORRUPTED, return_tensors="pt").input_ids
    result = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value="head_outputs")
    assert result.effects.shape == (model.num_layers, model.num_heads)
    clean_inputs = attention_oracle.output_projection_inputs(reference, clean_ids)
    d = model.head_dim
    for block in range(model.num_layers):
        for head in range(model.num_heads):
            def swap(_, args, block=block, head=head):
                args[0][..., head * d:(head + 1) * d] = clean_inputs[block][..., head * d:(head + 1) * d]

            projection = attention_oracle.output_projection(attention_oracle.attention_modules(reference)[block])
            handle = projection.register_forward_pre_hook(swap)
            with torch.no_grad():
                logits = reference(corrupted_ids).logits[0, -1]
            handle.remove()
            assert result.effects[block, head].item() == pytest.approx((logits[3] - logits[4]).item(), abs=1e-4)


@pytest.mark.parametrize("family_name", ["llama", "gpt2"])
def test_patching_head_results_matches_hooked_results(family_name, checkpoints):
    """Each head's result (after the output projection) patched from the clean run, at every position, against
    transformers whose output projection's output is moved by the difference of the two results, by a hook."""
    path = checkpoints(family_name)
    model = streamscope.load(path)
    reference = attention_oracle.reference_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    clean_ids = tokenizer(CLEAN, return_tensors="pt").input_ids
    corrupted_ids = tokenizer(CORRUPTED, return_tensors="pt").input_ids
    positions = [1, clean_ids.shape[1] - 1]
    result = streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value="head_results", positions=positions)
    assert result.effects.shape == (model.num_layers, model.num_heads) and result.value == "head_results"
    assert "heads" in repr(result)
    for block in range(model.num_layers):
        for head in range(model.num_heads):
            logits = attention_oracle.logits_with_head_result_patched(reference, clean_ids, corrupted_ids, block,
                                                                      head, model.head_dim, positions)
            assert result.effects[block, head].item() == pytest.approx((logits[3] - logits[4]).item(), abs=1e-4)


def test_patching_refuses_prompts_of_different_lengths(checkpoints):
    model = streamscope.load(checkpoints("llama"))
    with pytest.raises(ValueError, match="same number of tokens"):
        streamscope.patch(model, "Rome is in Italy", "The Eiffel Tower is in Paris", answer=3, wrong=4)
    with pytest.raises(ValueError, match="metric"):
        streamscope.patch(model, CLEAN, CORRUPTED)


# Steering in the trace syntax over many generated tokens.


def test_steering_every_generated_token_matches_a_hooked_generate(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path)
    reference = attention_oracle.reference_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0)) * 4
    steps = 6
    # The README's syntax: the edit applies at every step (the prompt, then each new token).
    with model.generate(PROMPTS[1], max_new_tokens=steps, min_new_tokens=steps, do_sample=False) as tracer:
        tokens = list().save()
        for step in tracer.iter[:]:
            model.layers[1].layer_output[:, -1] += vector
            tokens.append(model.logits[0, -1].argmax(-1))
    handle = reference.model.layers[1].register_forward_hook(
        lambda _, args, output: output.__setitem__((slice(None), -1), output[:, -1] + vector)
        if isinstance(output, torch.Tensor) else output[0][:, -1].add_(vector))
    try:
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    finally:
        handle.remove()
    with torch.no_grad():
        unsteered = reference.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    assert torch.stack(tokens).tolist() == expected[0, -steps:].tolist()
    assert not torch.equal(expected, unsteered)  # the vector changes the text


def test_a_gated_attention_refuses_head_results_computed_from_head_outputs(checkpoints):
    """Qwen3-Next gates each head's output before the output projection: the cache's computed `head_results`
    (head_outputs @ W_O) and a patch of head_results (made at head_outputs) are refused with the reason, while the
    traced `self_attn.head_results` (taken at the projection's input) sums to the attention's output less its bias."""
    from streamscope.errors import Unavailable

    model = streamscope.load(checkpoints("qwen3_next"))
    block = next(layer for layer, reason in
                 ((layer, model.layers[layer].support().rows.get("self_attn.head_results", "none"))
                  for layer in range(model.num_layers)) if reason is None)
    cache = model.cache(PROMPTS[1], values=["self_attn.head_outputs", "self_attn.attention_output"])
    with pytest.raises(Unavailable, match="output gate"):
        cache.head_results(block)
    with pytest.raises(Unavailable, match="output gate"):
        streamscope.patch(model, CLEAN, CORRUPTED, answer=3, wrong=4, value="head_results", layers=[block])
    traced = model.cache(PROMPTS[1], values=["self_attn.head_results", "self_attn.attention_output"])
    results = traced.head_results(block)
    output = traced[f"layers.{block}.self_attn.attention_output"]
    bias_free = output - results.sum(-2)
    # The projection has no bias on Qwen3-Next: the heads' results add up to the attention's output.
    assert relative_error(results.sum(-2), output) < RELATIVE, bias_free.abs().max()
