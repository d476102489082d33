"""GPT-2 (GPT2LMHeadModel): a pre-norm block, ``x + attn(ln_1(x))`` then ``+ mlp(ln_2(.))``, returning a
tensor; nothing transformers-only."""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["gpt2"]
