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
from streamscope.display import token

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
RELATIVE = 1e-5  # float32 on CPU, the same ops: rounding only


class Tiny:
    def __init__(self, path):
        self.path = path
        self.model = streamscope.load(path)
        self.reference = attention_oracle.reference_model(path)
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
        assert len(cache.stored) == tiny.model.num_layers, values
        for block in range(tiny.model.num_layers):
            for key in (f"layers.{block}.pattern", f"layers.{block}.self_attn.pattern"):
                assert relative_error(cache[key], weights[block]) <= RELATIVE
        assert cache.stack("pattern").shape[0] == tiny.model.num_layers
    cache = tiny.model.cache(PROMPTS[0], values=["queries", "mlp_output"], layers=[-1])
    last = tiny.model.num_layers - 1
    assert sorted(cache.stored) == [f"layers.{last}.mlp.mlp_output", f"layers.{last}.self_attn.queries"]
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
    # A whole assignment after a read warns once too (its shape is checked at once, its numbers on the way back).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tiny.model.trace(PROMPTS[1]):
            read = tiny.model.layers[1].layer_mid
            tiny.model.layers[1].layer_mid = torch.full_like(read, float("inf"))
    assert sum("layer_mid is written with NaN or inf" in str(warning.message) for warning in caught) == 1


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


# 5. Notebooks: short reprs, rich display, names help() and tab completion find.


def test_results_repr_shapes_not_numbers_and_display_in_html_and_png(tiny):
    lens = streamscope.lens(tiny.model, PROMPTS[1], keep_logits=True)
    patching = streamscope.patch(tiny.model, "Paris is in Italy", "Rome is in Italy", answer=7, wrong=8)
    cache = tiny.model.cache(PROMPTS, values=["pattern", "layer_output"])
    generation = tiny.model.generate(PROMPTS, max_tokens=2, return_logits=True, progress=False)
    harvest = tiny.model.harvest(PROMPTS, ["layer_output"], layers=[0, 2], progress=False)
    steer = streamscope.Steer("layer_output", 1, torch.ones(tiny.model.hidden_size), scale=2.0)
    blocks, length = tiny.model.num_layers, tiny.ids[1].shape[1]
    expected = [
        (lens, f"Lens(layer_output, {blocks} blocks x {length} positions, top 10, logits [{blocks}, {length}, 512]; "),
        (patching, f"Patching(layer_output, effects [{blocks}, 7] blocks x positions, logit difference: clean "),
        (cache, f"Cache(llama, {blocks} blocks, batch 2, seq {tiny.ids[0].shape[1]}, {2 * blocks} values)"),
        (generation, "Generation(2 prompts, 2 tokens each, with logits; text 0: "),
        (harvest, f"Harvest(2 prompts, blocks [0, 2]; prompt 0: layer_output [2, 1, {tiny.model.hidden_size}])"),
        (steer, f"Steer(add [{tiny.model.hidden_size}] x 2 at layers[1].layer_output, positions 'all_but_first')"),
    ]
    for result, start in expected:
        text = repr(result)
        assert text.startswith(start), text
        assert "tensor(" not in text and len(text) < 200 and "\n" not in text
        page = result._repr_html_() if hasattr(result, "_repr_html_") else None
        if page is not None:
            assert page.startswith("<table>") and "tensor(" not in page
    assert "Rome is in Italy" in lens._repr_html_() and "layer_output" in cache._repr_html_()
    for figure in (lens, patching):
        assert figure._repr_png_().startswith(b"\x89PNG")


def test_help_and_completion_find_streamscopes_names():
    import pydoc

    names = dir(streamscope)
    for name in ("plot", "lens", "patch", "Lens", "Patching", "Cache", "Steer", "Generation", "Harvest", "load"):
        assert name in names, name
    assert callable(streamscope.plot.attention)
    page = pydoc.render_doc(streamscope, renderer=pydoc.plaintext)
    assert "lens(model" in page and "plot" in page


def test_help_of_trace_is_streamscopes(tiny):
    import pydoc

    page = pydoc.render_doc(tiny.model.trace, renderer=pydoc.plaintext)
    assert "model.layers[1].layer_mid.save()" in page and "gpt2" not in page.lower()


# 6. Figures a paper can use.


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions draw, kept for inspection instead of closed."""
    from streamscope import plot

    drawn = []
    original = plot._save

    def keep(figure, path, dpi):
        drawn.append(figure)
        figure.savefig(path, dpi=dpi)
        return path

    monkeypatch.setattr(plot, "_save", keep)
    yield drawn
    monkeypatch.setattr(plot, "_save", original)


def _texts(figure) -> list[str]:
    found = [figure._suptitle.get_text()] if figure._suptitle is not None else []
    for axis in figure.axes:
        found += [axis.get_title(), *(label.get_text() for label in axis.get_xticklabels())]
    return found


def test_figures_carry_prompt_block_metric_and_visible_whitespace(tiny, figures, tmp_path):
    from matplotlib.colors import LogNorm

    from streamscope import plot

    prompt = "Rome is in Italy\n and Paris"
    lens = streamscope.lens(tiny.model, prompt)
    lens.plot(tmp_path / "lens.png")
    texts = _texts(figures[-1])
    assert any("logit lens of layer_output on 'Rome is in Italy\\n and Paris'" in text for text in texts), texts
    tokens = [tiny.tokenizer.decode([id_]) for id_ in tiny.tokenizer(prompt)["input_ids"]]
    assert any(text.startswith(" ") for text in tokens)
    for text in tokens:
        if text.startswith(" "):
            assert "␣" + text.lstrip(" ") in texts
    assert all(label.get_fontsize() >= 9 for axis in figures[-1].axes for label in axis.get_xticklabels())

    patching = streamscope.patch(tiny.model, "Paris is in Italy", "Rome is in Italy", answer=7, wrong=8)
    patching.plot(tmp_path / "patch.png")
    assert any("patching layer_output: normalized logit difference" in text and "'Paris is in Italy' into "
               "'Rome is in Italy'" in text for text in _texts(figures[-1]))

    with tiny.model.trace(prompt):
        pattern = tiny.model.layers[1].self_attn.pattern.save()
    plot.attention(pattern, tokens, tmp_path / "attention.png", block=1, heads=[1], drop_first=True)
    figure = figures[-1]
    assert figure._suptitle.get_text().startswith("block 1 attention on 'Rome is in Italy")
    panel = figure.axes[0]
    assert panel.get_title() == "head 1" and len(panel.get_xticklabels()) == len(tokens) - 1
    shown = panel.images[0].get_array()
    assert torch.equal(torch.as_tensor(shown.data), pattern[0, 1, 1:, 1:])
    assert panel.images[0].norm.vmax == pytest.approx(float(pattern[0, 1, 1:, 1:].max()))
    plot.attention(pattern, tokens, tmp_path / "log.png", log_scale=True)
    assert isinstance(figures[-1].axes[0].images[0].norm, LogNorm)


def test_the_command_line_takes_layers_positions_and_heads(tiny, tmp_path, capsys):
    from streamscope import cli, plot

    import matplotlib.image

    assert cli.main(["lens", str(tiny.path), PROMPTS[1], "--layers", "0,-1", "--png", str(tmp_path / "l.png"),
                     "--positions", "1-3"]) == 0
    table = capsys.readouterr().out
    assert "block   0" in table and f"block {tiny.model.num_layers - 1:>3}" in table and "block   1" not in table
    pixels = matplotlib.image.imread(str(tmp_path / "l.png"))
    width, height = plot.lens_size(3, 2)
    assert pixels.shape[:2] == (round(height * plot.DPI), round(width * plot.DPI))
    assert cli.main(["patch", str(tiny.path), "--clean", "Paris is in Italy", "--corrupted", "Rome is in Italy",
                     "--answer", "7", "--wrong", "8", "--layers", "1", "--positions", "0,-1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].split()[0] == "1" and len(lines[-1].split()) == 3
    assert cli.main(["attention", str(tiny.path), PROMPTS[1], "--layer", "1", "--heads", "0", "--drop-first",
                     "--png", str(tmp_path / "a.png")]) == 0
    pixels = matplotlib.image.imread(str(tmp_path / "a.png"))
    width, height = plot.attention_size(tiny.ids[1].shape[1] - 1, 1)
    assert pixels.shape[:2] == (round(height * plot.DPI), round(width * plot.DPI))


# 7. Interactive views, in a real browser.


def test_attention_view_shows_each_heads_weights_on_hover(tiny, tmp_path):
    from browser import page_of

    eager = AutoModelForCausalLM.from_pretrained(tiny.path, **attention_oracle.load_kwargs("llama", "eager")).eval()
    weights = attention_oracle.eager_weights(eager, tiny.ids[1])[1][0]  # block 1: [heads, seq, seq]
    tokens = [tiny.tokenizer.decode([id_]) for id_ in tiny.ids[1][0]]
    with tiny.model.trace(PROMPTS[1]):
        pattern = tiny.model.layers[1].self_attn.pattern.save()
    view = streamscope.views.attention(pattern, tokens, tmp_path / "attention.html", block=1)
    assert "<iframe srcdoc=" in view._repr_html_()
    with page_of(tmp_path / "attention.html") as (page, requests):
        for query in (2, len(tokens) - 1):
            page.hover(f".query [data-query='{query}']")
            assert page.text_content("#query-label") == token(tokens[query])
            for head in range(tiny.model.num_heads):
                shown = [float(text) for text in page.locator(f"#weights tr[data-head='{head}'] td").all_text_contents()]
                assert torch.allclose(torch.tensor(shown), weights[head, query], atol=5e-4 + 1e-6), (query, head)
        assert all(url.startswith("file://") for url in requests), requests


def test_lens_view_shows_the_top_tokens_of_a_cell_on_hover(tiny, tmp_path):
    from browser import page_of

    lens = streamscope.lens(tiny.model, PROMPTS[1])
    lens.view(tmp_path / "lens.html", k=4)
    # The oracle: the model's own logits are the last block's lens.
    probabilities = tiny.expected[1]["logits"][0].softmax(-1)
    last = tiny.model.num_layers - 1
    with page_of(tmp_path / "lens.html") as (page, requests):
        for position in (0, tiny.ids[1].shape[1] - 1):
            page.hover(f"td.cell[data-row='{last}'][data-position='{position}']")
            assert page.text_content("#block") == str(last)
            top = probabilities[position].topk(4)
            shown_tokens = page.locator("#top td.token").all_text_contents()
            shown = [float(text) for text in page.locator("#top td.probability").all_text_contents()]
            assert shown_tokens == [token(tiny.tokenizer.decode([int(i)])) for i in top.indices]
            assert torch.allclose(torch.tensor(shown), top.values, atol=5e-4 + 1e-6)
        assert all(url.startswith("file://") for url in requests), requests
