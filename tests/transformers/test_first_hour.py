"""What a researcher meets in the first hour, on transformers (issue 20): no input accepted and then ignored,
write checks that warn every time, one `generate`, loading as users type it, reprs for notebooks.

One tiny Llama shared by the module; the oracle is transformers' own float32 forward read with torch hooks
(`oracle.py`) and its eager attention weights (`attention_oracle.py`).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attention_oracle
import oracle
from access import relative_error
import streamscope

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
RELATIVE = 1e-5  # float32 on CPU, the same ops: rounding only


class Tiny:
    def __init__(self, path):
        self.path = path
        self.model = streamscope.load(path)
        self.reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.ids = [self.tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        self.expected = [oracle.values(self.reference, "llama", ids) for ids in self.ids]


@pytest.fixture(scope="module")
def tiny(checkpoints):
    return Tiny(checkpoints("llama"))


# 1. Inputs accepted and then ignored.


def test_lens_of_a_list_is_one_lens_per_prompt_each_its_own_prompts(tiny):
    lenses = streamscope.lens(tiny.model, PROMPTS, keep_logits=True)
    assert isinstance(lenses, list) and len(lenses) == len(PROMPTS)
    for lens, ids, expected in zip(lenses, tiny.ids, tiny.expected):
        assert lens.tokens == [tiny.tokenizer.decode([token]) for token in ids[0]]
        # The last block's row is the model's own logits of this prompt, every position.
        assert relative_error(lens.logits[-1], expected["logits"][0]) <= RELATIVE
        top = expected["logits"][0, -1].topk(3).indices.tolist()
        assert lens.top_ids[-1, -1, :3].tolist() == top
    with pytest.raises(TypeError, match="a prompt"):
        streamscope.lens(tiny.model, [PROMPTS[0], 7])


def test_lens_top_k_none_keeps_every_tokens_logits(tiny):
    lens = streamscope.lens(tiny.model, PROMPTS[1], top_k=None)
    assert lens.logits is not None and lens.logits.shape[-1] == tiny.model.vocab_size
    assert relative_error(lens.logits[-1], tiny.expected[1]["logits"][0]) <= RELATIVE
    with pytest.raises(ValueError, match="top_k"):
        streamscope.lens(tiny.model, PROMPTS[1], top_k=0)


def test_cache_takes_short_names_as_the_long_ones(tiny, checkpoints):
    eager = AutoModelForCausalLM.from_pretrained(tiny.path, **attention_oracle.load_kwargs("llama", "eager")).eval()
    weights = attention_oracle.eager_weights(eager, tiny.ids[0])
    for values in (["pattern"], "pattern", ["self_attn.pattern"]):
        cache = tiny.model.cache(PROMPTS[0], values=values)
        assert len(cache) == tiny.model.num_layers, values
        for block in range(tiny.model.num_layers):
            for key in (f"layers.{block}.pattern", f"layers.{block}.self_attn.pattern"):
                assert relative_error(cache[key], weights[block]) <= RELATIVE
        assert cache.stack("pattern").shape[0] == tiny.model.num_layers
    cache = tiny.model.cache(PROMPTS[0], values=["queries", "mlp_output"], layers=[-1])
    last = tiny.model.num_layers - 1
    assert sorted(cache) == [f"layers.{last}.mlp.mlp_output", f"layers.{last}.self_attn.queries"]
    assert relative_error(cache[f"layers.{last}.mlp_output"], tiny.expected[0]["mlp_output"][last]) <= RELATIVE


def test_block_and_position_indices_out_of_range_are_refused_not_wrapped(tiny):
    blocks = tiny.model.num_layers
    with pytest.raises(IndexError, match=f"block {blocks} is out of range"):
        streamscope.lens(tiny.model, PROMPTS[1], layers=[blocks])
    with pytest.raises(IndexError, match="out of range"):
        tiny.model.cache(PROMPTS[1], layers=[blocks + 1])
    with pytest.raises(IndexError, match="position 40 is out of range"):
        streamscope.patch(tiny.model, "Paris is in Italy", "Rome is in Italy", answer=7, wrong=8, positions=[40])
    with pytest.raises(TypeError, match="one prompt"):
        streamscope.patch(tiny.model, ["Paris is in Italy"], "Rome is in Italy", answer=7, wrong=8)
    cache = tiny.model.cache(PROMPTS[1], values=["layer_output"])
    with pytest.raises(KeyError, match="out of range"):
        cache[f"layers.{blocks}.layer_output"]
    assert torch.equal(cache[f"layers.{blocks - 1}.layer_output"], cache.stack("layer_output")[-1])


# 9. Write checks.


def test_a_nan_slice_assignment_warns_every_time(tiny):
    """Python shows a warning once per code location: the check's second firing must not be swallowed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            with tiny.model.trace(PROMPTS[1]):
                tiny.model.layers[1].layer_mid[:, -1] = float("nan")
                logits = tiny.model.logits.save()
            assert torch.isnan(logits[0, -1]).all()
    messages = [str(warning.message) for warning in caught if issubclass(warning.category, RuntimeWarning)]
    assert sum("model.layers[1].layer_mid is written with NaN or inf" in text for text in messages) == 2, messages
    assert all(warning.filename == __file__ for warning in caught if "NaN" in str(warning.message))


# 3. One `generate`.


def test_generate_called_returns_a_generation_as_transformers_generates(tiny):
    steps = 4
    result = tiny.model.generate(PROMPTS, max_tokens=steps, return_logits=True, ignore_eos=True, progress=False)
    assert isinstance(result, streamscope.Generation)
    assert len(result.texts) == len(result.tokens) == len(result.logits) == len(PROMPTS)
    for ids, tokens, text, logits in zip(tiny.ids, result.tokens, result.texts, result.logits):
        expected = tiny.reference.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                           output_logits=True, return_dict_in_generate=True, pad_token_id=2)
        assert tokens == expected.sequences[0, ids.shape[1]:].tolist()
        assert text == tiny.tokenizer.decode(tokens, skip_special_tokens=True)
        assert relative_error(logits, torch.cat(expected.logits)) <= RELATIVE
    # transformers' spellings, and one prompt as a string.
    same = tiny.model.generate(PROMPTS[1], max_new_tokens=steps, do_sample=False, ignore_eos=True, progress=False)
    assert same.tokens == [result.tokens[1]]
    assert tiny.model.generate(PROMPTS[1], max_tokens=steps, progress=False).logits is None


# 4. Loading as users type it.


def test_a_gguf_file_loads_with_the_checkpoints_weights(tiny, tmp_path, monkeypatch):
    from gguf_file import write_llama_gguf

    monkeypatch.setenv("STREAMSCOPE_CACHE", str(tmp_path / "cache"))
    gguf = write_llama_gguf(tiny.path, tmp_path / "tiny-llama.gguf")
    model = streamscope.load(str(gguf))
    # transformers' own GGUF reader (the oracle's side) makes the tokenizer; the weights are the checkpoint's.
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with model.trace(PROMPTS[0]):
        logits = model.logits.save()
    with torch.no_grad():
        expected = tiny.reference(ids).logits
    assert relative_error(logits, expected) <= RELATIVE
    assert streamscope.load(gguf).config.num_hidden_layers == tiny.model.num_layers  # converted once, reused
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        streamscope.load(tmp_path / "missing.gguf")


def test_smollm2_by_name_as_the_command_line_takes_it(tiny, tmp_path, monkeypatch):
    """The converted folder stands in for the download (the fetch itself is `make demo`'s)."""
    import shutil

    monkeypatch.setenv("STREAMSCOPE_CACHE", str(tmp_path))
    shutil.copytree(tiny.path, tmp_path / "smollm2-135m-instruct")
    model = streamscope.load("smollm2")
    assert str(model.config._name_or_path).endswith("smollm2-135m-instruct")
    assert model.num_layers == tiny.model.num_layers


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_a_hub_id_without_the_hub_fails_at_once_with_what_to_do(engine, monkeypatch):
    """Only the network boundary is replaced (`streamscope.models.hub_unreachable`): this machine has no hub.

    Where the hub is reachable the id goes to the engine unchanged and it fetches the repository as
    transformers and vLLM do; that path cannot be exercised here.
    """
    import time

    import streamscope.models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(streamscope.models, "hub_unreachable", lambda timeout=3.0: "timed out")
    started = time.monotonic()
    with pytest.raises(ConnectionError) as raised:
        streamscope.load("HuggingFaceTB/SmolLM2-135M-Instruct", engine=engine)
    assert time.monotonic() - started < 2.0
    message = str(raised.value)
    for hint in ("cannot reach the Hugging Face hub", "local checkpoint folder", "HF_HUB_OFFLINE=1", "hub cache ("):
        assert hint in message
    # Where the hub answers, nothing is refused before the engine (which then fetches the repository).
    monkeypatch.setattr(streamscope.models, "hub_unreachable", lambda timeout=3.0: None)
    assert streamscope.models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
