"""What a researcher meets in the first hour, inside a vLLM engine (issue 20): no input accepted and then
ignored, write checks that name the value and warn every time, reads out of order named, one `generate`,
a GGUF file loaded as users type it.

One engine shared by the module's tests: a tiny Llama loaded from a GGUF file of it; the oracle is
transformers' own float32 forward of the same checkpoint read with torch hooks (`oracle.py`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import oracle
import precision
from access import relative_error
import streamscope
import streamscope.models
from streamscope.nnsight_seam import OutOfOrderError
from streamscope.vllm.model import beside_engine

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
#: float32 on CPU: vLLM's kernels agree with transformers' to about 1e-6 (tests/precision.py on a GPU).
TOLERANCE = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE] if precision.ON_GPU else 1e-5
GREEDY = {"temperature": 0.0, "max_tokens": 1}


class Engine:
    def __init__(self, gguf: Path):
        # Loaded from a GGUF file as users type it: converted once (streamscope.models.from_gguf); the oracle
        # is transformers' own forward of the converted checkpoint (tests/transformers/test_first_hour.py
        # shows its weights are the original checkpoint's).
        self.path = streamscope.models.from_gguf(gguf, quiet=True)
        self.model = streamscope.load(str(gguf), engine="vllm", **precision.engine_kwargs())
        with beside_engine():
            self.reference = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.ids = [self.tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        self.expected = [oracle.values(self.reference, "llama", ids) for ids in self.ids]


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    from gguf_file import write_llama_gguf

    folder = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STREAMSCOPE_CACHE", str(folder / "cache"))
        engine = Engine(write_llama_gguf(checkpoints("llama"), folder / "tiny-llama.gguf"))
    yield engine
    engine.model.close()


def _serves_the_next_request(engine: Engine) -> None:
    with engine.model.trace(PROMPTS[1], **GREEDY):
        logits = engine.model.logits.save()
    assert relative_error(logits[0], engine.expected[1]["logits"][0, -1]) <= TOLERANCE


# 1. Inputs accepted and then ignored.


def test_lens_of_a_list_is_one_lens_per_prompt_each_its_own_prompts(engine):
    lenses = streamscope.lens(engine.model, PROMPTS, keep_logits=True)
    assert isinstance(lenses, list) and len(lenses) == len(PROMPTS)
    for lens, ids, expected in zip(lenses, engine.ids, engine.expected):
        assert lens.tokens == [engine.tokenizer.decode([token]) for token in ids[0]]
        assert relative_error(lens.logits[-1], expected["logits"][0]) <= TOLERANCE


def test_cache_takes_short_names_as_the_long_ones(engine):
    last = engine.model.num_layers - 1
    for values in (["mlp_input", "mlp_output"], "mlp_output"):
        cache = engine.model.cache(PROMPTS[1], values=values, layers=[-1])
        assert f"layers.{last}.mlp.mlp_output" in cache
        assert relative_error(cache[f"layers.{last}.mlp_output"], engine.expected[1]["mlp_output"][last]) <= TOLERANCE
    cache = engine.model.cache(PROMPTS[1], values=["pattern", "queries"], layers=[0])
    assert sorted(cache.stored) == ["layers.0.self_attn.pattern", "layers.0.self_attn.queries"]
    pattern = cache["layers.0.pattern"]
    length = engine.ids[1].shape[1]
    assert pattern.shape == (1, engine.model.num_heads, length, length)
    assert torch.allclose(pattern.sum(-1), torch.ones(1, engine.model.num_heads, length), atol=1e-5)
    with pytest.raises(IndexError, match="out of range"):
        engine.model.cache(PROMPTS[1], layers=[engine.model.num_layers])


# 9. Write checks.


def test_a_nan_slice_assignment_warns_every_time(engine):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            with engine.model.trace(PROMPTS[1], **GREEDY):
                engine.model.layers[1].layer_mid[:, -1] = float("nan")
                logits = engine.model.logits.save()
            assert torch.isnan(logits).all()
    messages = [str(warning.message) for warning in caught if issubclass(warning.category, RuntimeWarning)]
    assert sum("model.layers[1].layer_mid is written with NaN or inf" in text for text in messages) == 2, messages
    _serves_the_next_request(engine)


def test_logits_of_the_wrong_width_are_refused_naming_the_value(engine):
    with pytest.raises(ValueError, match=r"model.logits cannot take a tensor of shape \(1, 7\)"):
        with engine.model.trace(PROMPTS[1], **GREEDY):
            engine.model.logits = torch.zeros(1, 7)
    # The right width is taken: a one-hot row makes its token the greedy choice.
    with engine.model.trace(PROMPTS[1], **GREEDY):
        forced = torch.full((1, engine.model.vocab_size), -1e9)
        forced[0, 5] = 0.0
        engine.model.logits = forced
        sampled = engine.model.samples.save()
    assert sampled.reshape(-1).tolist() == [5]
    _serves_the_next_request(engine)


# 2. The out-of-order error names the read that came too late, and the one it came after.


def test_reading_prompt_logits_after_logits_names_both(engine):
    with pytest.raises(OutOfOrderError, match=r"model.prompt_logits was read after model.logits"):
        with engine.model.trace(PROMPTS[1], **GREEDY):
            engine.model.layers[1].layer_mid.save()
            engine.model.logits.save()
            engine.model.prompt_logits.save()
    _serves_the_next_request(engine)


# 3. One `generate`.


def test_generate_called_returns_a_generation_with_the_oracles_logits(engine):
    steps = 3
    result = engine.model.generate(PROMPTS, max_tokens=steps, return_logits=True, ignore_eos=True, progress=False)
    assert isinstance(result, streamscope.Generation)
    assert len(result.texts) == len(result.tokens) == len(result.logits) == len(PROMPTS)
    for ids, tokens, text, logits in zip(engine.ids, result.tokens, result.texts, result.logits):
        # The oracle: transformers' forward over the prompt and the engine's own tokens, greedy at each step.
        sequence = torch.cat([ids, torch.tensor([tokens])], dim=1)
        with torch.no_grad():
            expected = engine.reference(sequence).logits[0, ids.shape[1] - 1 : -1]
        assert relative_error(logits, expected) <= TOLERANCE
        assert tokens == expected.argmax(-1).tolist()
        # vLLM's detokenizer holds back a last character whose bytes are incomplete; transformers' decode shows it as
        # U+FFFD. Otherwise the texts are the same.
        assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    same = engine.model.generate(PROMPTS[1], max_new_tokens=steps, do_sample=False, ignore_eos=True, progress=False)
    assert same.tokens == [result.tokens[1]]


# 8. One progress bar per workflow.


def test_a_workflow_prints_its_own_bar_and_none_of_vllms(engine, capfd):
    capfd.readouterr()
    streamscope.patch(engine.model, "Paris is in Italy", "Rome is in Italy", answer=7, wrong=8, layers=[0, -1],
                      positions=[0, -1], batch_size=2, progress=True)
    engine.model.cache(PROMPTS * 2, values=["layer_output"], layers=[0], batch_size=2, progress=True)
    with engine.model.trace(PROMPTS[1], **GREEDY):
        engine.model.logits.save()
    printed = capfd.readouterr().err
    assert "Processed prompts" not in printed and "Rendering prompts" not in printed, printed[-400:]
    assert "patch:" in printed and "cache:" in printed


# 7. The attention view of an engine's pattern, in a real browser.


def test_attention_view_of_the_engines_pattern_shows_transformers_weights(engine, tmp_path):
    import attention_oracle
    from browser import page_of

    eager = AutoModelForCausalLM.from_pretrained(engine.path, **attention_oracle.load_kwargs("llama", "eager")).eval()
    weights = attention_oracle.eager_weights(eager, engine.ids[1])[0][0]  # block 0: [heads, seq, seq]
    tokens = [engine.tokenizer.decode([token]) for token in engine.ids[1][0]]
    cache = engine.model.cache(PROMPTS[1], values=["pattern"], layers=[0])
    streamscope.views.attention(cache["layers.0.pattern"], tokens, tmp_path / "attention.html", block=0)
    query = len(tokens) - 1
    with page_of(tmp_path / "attention.html") as (page, requests):
        page.hover(f".query [data-query='{query}']")
        for head in range(engine.model.num_heads):
            shown = [float(text) for text in page.locator(f"#weights tr[data-head='{head}'] td").all_text_contents()]
            assert torch.allclose(torch.tensor(shown), weights[head, query], atol=5e-4 + TOLERANCE)
        assert all(url.startswith("file://") for url in requests), requests
