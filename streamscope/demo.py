"""The main job: build a tiny checkpoint, show what streamscope serves on it, read, edit and skip.

    python -m streamscope.demo [--family llama] [--engine transformers|vllm] [--folder PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
import transformers

import streamscope
from streamscope.testing import FAMILIES, build_checkpoint

PROMPT = "The Eiffel Tower is in"


def _top(logits: torch.Tensor, tokenizer, k: int = 3) -> str:
    probabilities = logits.softmax(-1)
    values, indices = probabilities.topk(k)
    return ", ".join(f"{tokenizer.decode([int(i)])!r} {float(p):.3f}" for p, i in zip(values, indices))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama", choices=FAMILIES)
    parser.add_argument("--engine", default="transformers", choices=streamscope.ENGINES)
    parser.add_argument("--folder", type=Path, help="where to build the checkpoint (default: a temporary folder)")
    arguments = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.utils.logging.disable_progress_bar()

    folder = arguments.folder or Path(tempfile.mkdtemp(prefix="streamscope-demo-")) / arguments.family
    path = build_checkpoint(arguments.family, folder)
    print(f"Built a tiny random {arguments.family} checkpoint at {path}\n")

    model = streamscope.load(path, engine=arguments.engine)
    # vLLM samples: one greedy token per trace. prompt_logits is every position on either engine.
    settings = {"temperature": 0.0, "max_tokens": 1} if arguments.engine == "vllm" else {}
    print(model.support(), "\n")
    print(f"{model.num_layers} blocks, hidden {model.hidden_size}, {model.num_heads} heads "
          f"({model.num_kv_heads} key/value), head_dim {model.head_dim}, vocabulary {model.vocab_size}\n")

    last = model.num_layers - 1
    with model.trace(PROMPT, **settings):
        layer_input = model.layers[1].layer_input.save()
        attention = model.layers[1].self_attn.attention_output.save()
        mid = model.layers[1].layer_mid.save()
        mlp = model.layers[1].mlp.mlp_output.save()
        output = model.layers[1].layer_output.save()
        logits = model.prompt_logits.save()
    print(f"Read block 1 on {PROMPT!r}: layer_mid {tuple(mid.shape)}, layer_output {tuple(output.shape)}")
    identity = (layer_input + attention + mlp - output).abs().max().item()
    print(f"  layer_input + attention_output + mlp_output - layer_output: max |difference| {identity:.2e}")
    print(f"  next token: {_top(logits[0, -1], model.tokenizer)}\n")

    steering = 4.0 * mid[0, -1] / mid[0, -1].norm() * mid.norm(dim=-1).mean()
    with model.trace(PROMPT, **settings):
        model.layers[1].layer_mid[:, -1] += steering
        steered = model.prompt_logits.save()
    change = (steered[0, -1] - logits[0, -1]).abs().max().item()
    print(f"Added a steering vector to block 1's layer_mid at the last position:")
    print(f"  logits moved by up to {change:.3f}; next token now: {_top(steered[0, -1], model.tokenizer)}\n")

    with model.trace(PROMPT, **settings):
        model.layers[last].skip(model.layers[last].layer_input)
        skipped = model.prompt_logits.save()
    change = (skipped[0, -1] - logits[0, -1]).abs().max().item()
    print(f"Skipped block {last} (its input handed on as its output):")
    print(f"  logits moved by up to {change:.3f}; next token now: {_top(skipped[0, -1], model.tokenizer)}\n")

    with model.trace(PROMPT, **settings):
        for layer in model.layers:
            for name in ("layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input",
                         "layer_output"):
                if layer.support()[name] is None:
                    getattr(layer, name).save()
        unchanged = model.prompt_logits.save()
    print(f"Reading every boundary of every block leaves the logits bit-identical: {torch.equal(unchanged, logits)}\n")

    if arguments.engine == "vllm":
        model.close()  # one engine at a time in this process
    parallel = streamscope.load(build_checkpoint("gptj", folder.parent / "gptj"), engine=arguments.engine)
    try:
        with parallel.trace(PROMPT, **settings):
            parallel.layers[0].layer_mid.save()
    except streamscope.Unavailable as error:
        print(f"On GPT-J's parallel block a value it cannot serve says why:\n  {error}")


if __name__ == "__main__":
    main()
