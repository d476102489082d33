"""GPT-NeoX (Pythia): ``x + attn(norm1(x)) + mlp(norm2(x))`` where ``use_parallel_residual``, else Llama's
sequential pre-norm block; nothing transformers-only."""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["gpt_neox"]
