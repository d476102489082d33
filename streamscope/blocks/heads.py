"""The inside of a softmax attention, as both engines name it: queries, keys, values, scores, pattern and head
outputs (`INTERNALS`).

`streamscope.blocks.Attention` lists them; each engine reads them where its
model holds them, composing its own part with the attention kind at load:
transformers at the attention kernel's call inside the module's forward
(`streamscope.transformers.attention`), vLLM at its attention layer
(`streamscope.vllm.attention`). Both engines recompute scores and the pattern
from the queries and keys where the kernel fuses them, and refuse writes to
them alike (`READ_ONLY`).
"""

from __future__ import annotations

#: The values inside an attention, in the order the model computes them.
INTERNALS = ("queries", "keys", "values", "scores", "pattern", "head_outputs")

READ_ONLY = ("{name} is recomputed from the queries and keys for the read (the kernel fuses it) and "
             "held by nothing in the model, so it cannot be written; edit queries or keys instead.")
