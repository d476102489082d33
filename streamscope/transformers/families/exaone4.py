"""EXAONE 4: OLMo 2's post-norm block (q/k norms inside the attention), sliding and full attention by
layer; nothing transformers-only."""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["exaone4"]
