"""TransformerLens's exploratory-analysis demo, cache section, on TransformerLens 4.3 and on streamscope.

    .venv/bin/python scripts/tl_notebook.py [checkpoint folder] [--engine transformers|vllm]

The same calls run twice: once on TransformerLens 4.3's bridge (from .venv/transformer-lens-4.3), once with
`TransformerBridge.boot_transformers(...)` replaced by `streamscope.load(...)` and `run_with_cache` by
`model.cache`. Each prints the demo's numbers; the last lines give the largest difference per quantity.
Beyond the demo's own cells it attributes the logit difference to every head, MLP and neuron through
`get_full_resid_decomposition` (the neurons with `project_output_onto`, as TL folds the projection in) and
`get_neuron_results`. The default checkpoint is SmolLM2-135M-Instruct as `streamscope.load("smollm2")` converts
it. The suite runs it on both engines (`test_the_tl_demo_cache_section_prints_tl_numbers_on_smollm2` in
tests/transformers/ and tests/vllm/test_transformer_lens.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PROMPTS = ["When John and Mary went to the shops, John gave the bag to",
           "When John and Mary went to the shops, Mary gave the bag to",
           "When Tom and James went to the park, James gave the ball to",
           "When Tom and James went to the park, Tom gave the ball to"]
ANSWERS = [(" Mary", " John"), (" John", " Mary"), (" Tom", " James"), (" James", " Tom")]


def demo(model, cache_of, directions_of, layers: int) -> dict[str, torch.Tensor]:
    """The demo's cache section, written once against TransformerLens's names.

    `directions_of(cache)` is where the unembedding directions come from: TL's model, streamscope's cache.
    `layers` is the model's block count (TL's ``model.cfg.n_layers``, streamscope's ``model.num_layers``).
    """
    answer_tokens = torch.tensor([[model.to_single_token(answer) for answer in pair] for pair in ANSWERS])
    tokens = model.to_tokens(PROMPTS, prepend_bos=True)
    cache = cache_of(tokens)
    directions = directions_of(cache)(answer_tokens)
    logit_diff_directions = directions[:, 0] - directions[:, 1]

    def to_logit_diff(stack):
        scaled = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)
        return torch.einsum("...bd,bd->...", scaled, logit_diff_directions) / len(PROMPTS)

    found = {}
    final = cache["resid_post", -1][:, -1, :]
    found["logit diff (final stream)"] = to_logit_diff(final)
    stack, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
    found["logit lens logit diffs"] = to_logit_diff(stack)
    stack, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    found["per layer logit diffs"] = to_logit_diff(stack)
    stack, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    found["per head logit diffs"] = to_logit_diff(stack)
    found["attention pattern of L2 (prompt 0)"] = cache["pattern", 2][0]
    found["accumulated_resid(apply_ln=True), last position"] = cache.accumulated_resid(apply_ln=True)[:, :, -1]
    # After the neurons: every head, MLP and neuron's share of the logit difference. Each prompt's direction is a
    # column of the projection; prompt b's share is column b of its own row (the diagonal).
    stack = cache.get_full_resid_decomposition(layer=-1, pos_slice=-1, expand_neurons=False)
    found["per head and MLP logit diffs (full decomposition)"] = to_logit_diff(stack)
    projected, labels = cache.get_full_resid_decomposition(layer=-1, pos_slice=-1, apply_ln=True, return_labels=True,
                                                           project_output_onto=logit_diff_directions.T)
    found["per neuron logit diffs (full decomposition, projected)"] = projected.diagonal(dim1=-2, dim2=-1).mean(-1)
    last = layers - 1
    neurons = cache.get_neuron_results(last, pos_slice=-1, project_output_onto=logit_diff_directions.T)
    found[f"L{last} neuron results on the logit diff directions"] = neurons.diagonal(dim1=0, dim2=-1).mean(-1)
    found["neuron activations of the last block"] = cache["post", last][:, -1]
    for name, value in found.items():
        print(f"{name}: {value.flatten()[:6].tolist()}")
    return found


def compare(path, load) -> dict[str, float]:
    """Run the demo on TransformerLens 4.3's bridge and on `load()` (a streamscope model of the checkpoint at
    `path`, closed after); each quantity's largest difference, relative to its largest value."""
    import transformer_lens_parity as parity
    from streamscope.workflows.cache import DEFAULT_VALUES

    with parity.transformer_lens_4_3():
        print("TransformerLens 4.3:")
        bridge = parity.bridge(path)
        theirs = demo(bridge, lambda tokens: bridge.run_with_cache(tokens)[1],
                      lambda cache: bridge.tokens_to_residual_directions, bridge.cfg.n_layers)
        model = load()
        try:
            print(f"streamscope on {model.engine.name}:")
            values = [*DEFAULT_VALUES, "token_embeddings", "final_norm_output", "self_attn.pattern",
                      "self_attn.head_outputs"]
            ours = demo(model, lambda tokens: model.cache(tokens, values=values),
                        lambda cache: cache.tokens_to_residual_directions, model.num_layers)
        finally:
            model.engine.close()
    errors = {}
    print("largest difference, relative to the largest value:")
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, (name, ours[name].shape, theirs[name].shape)
        errors[name] = ((ours[name] - theirs[name]).abs().max() / theirs[name].abs().max()).item()
        print(f"  {name}: {errors[name]:.1e}")
    return errors


def main() -> None:
    import streamscope

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=None)
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    args = parser.parse_args()
    from streamscope.models import smollm2

    path = args.path or smollm2()
    compare(path, lambda: streamscope.load(path, engine=args.engine))


if __name__ == "__main__":
    main()
