"""StableLM: Llama's tree and Llama's pre-norm block."""

from .llama import ENVOYS, RENAME

__all__ = ["ENVOYS", "RENAME"]
