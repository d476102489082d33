"""Granite: Llama's block with multipliers: each sublayer's output is scaled by `residual_multiplier` before its add.

The embeddings are multiplied by `embedding_multiplier` in the model's forward,
after ``embed_tokens``, so token_embeddings is read where the stream enters
block 0; the logits are divided by `logits_scaling` (model.logits is after it).
"""

from ...families.logits import divided_by_logits_scaling
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import INPUT

SPEC = derive(NEUTRAL["granite"], root_sites={"token_embeddings": ("layers.0", INPUT)},
              logit_scaling=divided_by_logits_scaling)
