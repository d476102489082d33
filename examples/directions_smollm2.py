"""A sentiment direction on SmolLM2-135M-Instruct: found, swept over blocks, then steered with and ablated.

    python examples/directions_smollm2.py                    # transformers
    python examples/directions_smollm2.py --engine vllm      # the same inside a vLLM engine

It fetches the model once as `make demo` does (streamscope.models.smollm2),
finds the difference of means between 24 happy and 24 sad sentences at every
block's output (held-out accuracy, separation and steering effect per block;
the block that steers best is chosen), then
measures, on neutral prompts, P(positive) = the probability of the next
word being one of a few positive words, over positive and negative words
together: plain, with the direction added at one block, and with each
block's direction ablated at every block.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import streamscope
from streamscope.directions import find
from streamscope.models import smollm2

THINGS = ["day", "trip", "dinner", "party", "walk", "game", "film", "weekend", "visit", "meeting", "class", "morning"]
HAPPY = [f"The {thing} was wonderful and I felt so happy" for thing in THINGS] + \
        [f"What a lovely {thing}, it made me smile with joy" for thing in THINGS]
SAD = [f"The {thing} was awful and I felt so sad" for thing in THINGS] + \
      [f"What a miserable {thing}, it made me cry with grief" for thing in THINGS]
NEUTRAL = ["After the long day at work I felt", "When I opened the letter I felt", "Walking home in the rain, I felt",
           "At the end of the meeting everyone felt", "Looking at the old photos, she felt"]
POSITIVE_WORDS = [" happy", " great", " good", " wonderful", " excited", " proud", " relieved", " grateful"]
NEGATIVE_WORDS = [" sad", " bad", " terrible", " awful", " lonely", " tired", " angry", " disappointed"]


def word_ids(model, words: list[str]) -> list[int]:
    return [model.tokenizer(word, add_special_tokens=False).input_ids[0] for word in words]


def positive_share(model, steers, positive: list[int], negative: list[int]) -> float:
    """Mean over the neutral prompts of P(positive words) / P(positive or negative words) for the next token."""
    result = model.generate(NEUTRAL, max_tokens=1, steer=steers, return_logits=True, progress=False,
                            harvest=None if steers else {"values": "layer_output", "layers": [0]})
    shares = []
    for logits in result.logits:
        probabilities = torch.softmax(logits[0].float(), dim=-1)
        good, bad = probabilities[positive].sum(), probabilities[negative].sum()
        shares.append(float(good / (good + bad)))
    return sum(shares) / len(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--out", default="demo-output")
    parser.add_argument("--block", type=int, default=None, help="the block to steer at (default: the one that steers best)")
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    model = streamscope.load(smollm2(), engine=args.engine)
    print(f"SmolLM2-135M-Instruct on {args.engine}: {len(HAPPY)} happy and {len(SAD)} sad sentences")
    sweep = find(model, HAPPY, SAD, value="layer_output", method="mean_difference", progress=False)
    print(sweep.table())
    print(f"  wrote {sweep.plot(Path(args.out) / 'sentiment_sweep.png')}")
    # sweep.best: the block whose direction, added to held-out sad sentences, moves their next token furthest
    # toward the happy ones' beyond a random direction at the same dose (accuracy is perfect at most blocks).
    chosen = sweep[args.block] if args.block is not None else sweep.best
    print(f"steering at block {chosen.layer}: {chosen}")
    positive, negative = word_ids(model, POSITIVE_WORDS), word_ids(model, NEGATIVE_WORDS)
    plain = positive_share(model, [], positive, negative)
    added = positive_share(model, [chosen.steer(scale=args.scale, positions="all")], positive, negative)
    subtracted = positive_share(model, [chosen.steer(scale=-args.scale, positions="all")], positive, negative)
    ablated = positive_share(model, [direction.steer(mode="ablate") for direction in sweep], positive, negative)
    print(f"P(positive) on {len(NEUTRAL)} neutral prompts: {plain:.3f} plain, {added:.3f} with +{args.scale:g} x "
          f"the direction at block {chosen.layer}, {subtracted:.3f} with -{args.scale:g} x, {ablated:.3f} with each "
          f"block's direction ablated at every block")
    if hasattr(model, "close"):
        model.close()


if __name__ == "__main__":
    main()
