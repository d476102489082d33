"""`streamscope.tl`: TransformerLens 4.3's helpers by their short import path; the module is `streamscope.workflows.tl`."""

from .workflows.tl import (NO_DEFAULT_BOS, NormForm, TransformerLensCache, act_name, apply_slice, test_prompt,
                           to_single_token, to_str_tokens, to_tokens, tokenizer_prepends_bos)

__all__ = ["NO_DEFAULT_BOS", "NormForm", "TransformerLensCache", "act_name", "apply_slice", "test_prompt",
           "to_single_token", "to_str_tokens", "to_tokens", "tokenizer_prepends_bos"]
