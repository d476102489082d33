"""EXAONE 4: OLMo 2's post-norm block (q/k norms inside the attention), sliding and full attention by layer."""

from .olmo2 import SPEC

__all__ = ["SPEC"]
