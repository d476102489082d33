"""The inside of a softmax attention, as both engines name it: the query and key projections, the queries and keys
before the rotary embedding, queries, keys, values, scores, pattern and head outputs (`INTERNALS`).

`streamscope.blocks.Attention` lists them; each engine reads them where its
model holds them, composing its own part with the attention kind at load:
transformers at the attention kernel's call inside the module's forward
(`streamscope.transformers.attention`), vLLM at its attention layer
(`streamscope.vllm.attention`). Both engines recompute scores and the pattern
from the queries and keys where the kernel fuses them, and refuse writes to
them alike (`READ_ONLY`).

The queries and keys before the rotary embedding (`PRE_ROTARY`) are read where
the forward hands them to its rotary: the arguments of that call (or, where the
forward rotates a slice of them, the tensor it slices), after any q/k norm the
family applies before rotating: where there is one, that norm's output (the
same tensor, read where the forward computes it, so that a block's values are
read in `INTERNALS` order). TransformerLens's ``hook_rot_q`` /
``hook_rot_k`` are `queries` / `keys`. On a block that rotates nothing (GPT-2,
OPT, Falcon with ALiBi, Llama 4's NoPE blocks, EXAONE 4's global blocks) they
are the kernel's queries and keys.

The query and key projections (`PROJECTED`) are the projection's output per
head, before any q/k norm and rotary: TransformerLens's ``attn.hook_q`` /
``attn.hook_k``. Where the attention norms its queries and keys before the
rotary (a ``q_norm`` / ``k_norm`` child, or StableLM's ``q_layernorm`` /
``k_layernorm``: Qwen3, Gemma 3, OLMo 2, EXAONE 4, Qwen3-Next, Cohere with
``use_qk_norm``), they are that norm's input; elsewhere there is nothing
between the projection and the rotary, and they are the pre-rotary values,
read at the same place (`pre_rotary_of`). Llama 4's ``qk_norm`` follows its
rotary, so it is not one of these norms.
"""

from __future__ import annotations

from typing import Any, Optional

#: The queries and keys before the rotary embedding, by the name of what the kernel receives after it.
PRE_ROTARY = {"queries_pre_rotary": "queries", "keys_pre_rotary": "keys"}

#: The query and key projections per head, before any q/k norm, by the pre-rotary value they are where none is.
PROJECTED = {"queries_projected": "queries_pre_rotary", "keys_projected": "keys_pre_rotary"}
#: The attention's child that norms each projection before the rotary, by engine-neutral name (first one present).
PROJECTION_NORMS = {"queries_projected": ("q_norm", "q_layernorm"), "keys_projected": ("k_norm", "k_layernorm")}

#: The values inside an attention, in the order the model computes them (a q/k norm's input, then its output:
#: each engine reads the pre-rotary values at the norm's output where there is one).
INTERNALS = ("queries_projected", "queries_pre_rotary", "keys_projected", "keys_pre_rotary", "queries", "keys", "values", "scores", "pattern", "head_outputs")

READ_ONLY = ("{name} is recomputed from the queries and keys for the read (the kernel fuses it) and "
             "held by nothing in the model, so it cannot be written; edit queries or keys instead.")

#: Why an attention whose forward fuses its q/k norm and rotary into one kernel serves no pre-rotary values.
FUSED_ROTARY = ("this attention's forward applies its q/k norm and rotary embedding in one fused kernel "
                "({kernel}), so its queries and keys are never held between the two; read queries and keys "
                "(after the rotary) instead")
#: Why such an attention serves no projected values either: its q/k norm is inside the same kernel.
FUSED_PROJECTION = ("this attention's forward hands its fused q/k/v(/gate) projection straight to one kernel that "
                    "norms, rotates and gates it ({kernel}), so no tensor holds its queries or keys per head before "
                    "the norm; read queries and keys (after the norm and rotary) instead")


def pre_rotary_of(name: str) -> str:
    """The pre-rotary value a projected one (`PROJECTED`) is on a block without a q/k norm; other names as they are."""
    return PROJECTED.get(name, name)


def projected_of(name: str) -> str:
    """The projected value (`PROJECTED`) a pre-rotary one is the q/k norm's output of; other names as they are."""
    return {pre_rotary: projected for projected, pre_rotary in PROJECTED.items()}.get(name, name)


def unrotated_of(name: str) -> str:
    """The kernel input (`queries` or `keys`) a pre-rotary or projected value becomes after the rotary; other
    names as they are."""
    name = pre_rotary_of(name)
    return PRE_ROTARY.get(name, name)


def projection_norm(module: Any, name: str) -> Optional[str]:
    """The child of attention `module` that norms the projection of value `name` (`PROJECTED`) before the rotary,
    None where there is none (or `name` is not a projected value)."""
    children = getattr(module, "_modules", {})
    for child in PROJECTION_NORMS.get(name, ()):
        if children.get(child) is not None:
            return child
    return None
