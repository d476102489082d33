"""A distributed harvest's default shard size: the in-process harvest's bound, planned once on the driver.

`model.harvest(..., out=)` cuts its shards at `streamscope.bulk.results.SHARD_BYTES` of rows (1 GiB) or
`SHARD_PROMPTS` prompts (1,024), whichever comes first (`ShardCutter`). A replica of `streamscope.scale.harvest`
holds a whole shard's rows in host memory before it writes them, so its shards need the same bound. They must
also be the same on a resume, and the manifest records one number of prompts a shard: the plan is that number,
fixed by the call's arguments and the dataset alone. The largest prompt (the longest, at the most positions)
decides it, since a shard must hold whichever prompts land in it.

A prompt's bytes are its rows (one a harvested position) times a row's bytes over every value and block
(`streamscope.bulk.results.estimated_row_bytes`, the estimate the bulk path cuts its first shard by), with the
widths the replica cannot measure before it runs taken from the checkpoint's config: the MLP's neurons
``intermediate_size`` wide, each head's result ``[heads, hidden_size]``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from transformers import AutoTokenizer

from ..blocks.sublayers import NEURONS
from ..bulk import results
from ..bulk.positions import Positions, prompt_positions
from ..bulk.sites import HEAD_RESULTS_VALUE, ROOT_VALUES
from ..bulk.spec import HarvestSpec

#: Text prompts tokenized at a time on the driver (the fast tokenizer's batch call).
TOKENIZE_BATCH = 1024
#: The dtype each engine runs in when ``engine_options`` names none: the transformers engine loads float32
#: (`streamscope.transformers.model`); vLLM's ``"auto"`` is the checkpoint's own (`config_dtype`).
ENGINE_DEFAULT_DTYPES = {"transformers": torch.float32}
#: Spellings of a dtype both engines take besides torch's own names.
DTYPE_WORDS = {"half": torch.float16, "float": torch.float32}
#: Position rules whose count does not depend on the prompt's length.
FIXED_RULES = {"last": 1, "none": 0}


def planned_shard_size(prompts: Sequence[Any], checkpoint: str, config: Any, engine: str,
                       engine_options: dict[str, Any], values: list[str], layers: Optional[list[int]],
                       positions: Positions, harvest_options: dict[str, Any]) -> int:
    """The prompts a shard holds when ``shard_size`` is left out: as many of the largest prompt as fit
    `SHARD_BYTES` of rows, one at least and `SHARD_PROMPTS` at most.

    Args:
        prompts: The dataset's prompts (strings, tokenized with the checkpoint's tokenizer, or token-id lists).
        checkpoint: The model folder or hub id, whose tokenizer counts a text prompt's tokens.
        config: The checkpoint's `transformers` config.
        engine, engine_options: The replicas' engine and `streamscope.load` options (``dtype``).
        values, layers: The checked values and blocks (None: every block).
        positions: The positions rule, or one list per prompt.
        harvest_options: `model.harvest`'s options; ``reduce`` keeps one row a prompt.
    """
    text = getattr(config, "text_config", None) or config
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    blocks = len(layers) if layers is not None else _first(text, "num_hidden_layers", "n_layer")
    if hidden is None or blocks is None:
        raise ValueError(f"{checkpoint}'s config gives no hidden size or block count to size the shards by: "
                         f"pass shard_size= (prompts a shard).")
    spec = HarvestSpec(list(values), list(range(blocks)))
    spec.shapes.update(_row_shapes(text, values, hidden))
    row_bytes = results.estimated_row_bytes(spec, hidden, engine_dtype(config, engine, engine_options))
    rows = 1 if harvest_options.get("reduce") else positions_a_prompt(positions, lambda: prompt_lengths(prompts,
                                                                                                        checkpoint))
    return shard_size_for(rows * row_bytes)


def shard_size_for(prompt_bytes: int) -> int:
    """How many prompts of `prompt_bytes` bytes of rows a shard holds: at most `SHARD_BYTES` of them (one prompt
    at least) and at most `SHARD_PROMPTS` prompts."""
    if prompt_bytes <= 0:
        return results.SHARD_PROMPTS
    return max(1, min(results.SHARD_PROMPTS, results.SHARD_BYTES // prompt_bytes))


def engine_dtype(config: Any, engine: str, engine_options: dict[str, Any]) -> torch.dtype:
    """The dtype a replica's engine runs in: ``engine_options``' ``dtype`` where it names one, else the engine's
    default (float32 on transformers; on vLLM the checkpoint's own, bfloat16 where the config names none)."""
    named = _dtype(engine_options.get("dtype", engine_options.get("torch_dtype")))
    if named is not None:
        return named
    return ENGINE_DEFAULT_DTYPES.get(engine) or config_dtype(config) or torch.bfloat16


def config_dtype(config: Any) -> Optional[torch.dtype]:
    """The dtype a checkpoint's config names (``dtype``, or the older ``torch_dtype``), on it or its text config."""
    for part in (config, getattr(config, "text_config", None)):
        # ``torch_dtype`` is read only where there is no ``dtype``: transformers warns of the alias.
        found = _dtype(getattr(part, "dtype" if hasattr(part, "dtype") else "torch_dtype", None))
        if found is not None:
            return found
    return None


def positions_a_prompt(positions: Positions, lengths: Callable[[], set[int]]) -> int:
    """The most positions a prompt's harvest holds under `positions`; `lengths` (the prompts' distinct token
    counts) is called only for a rule that depends on them (``"all"``, ``"all_but_first"``, a slice)."""
    if isinstance(positions, str) and positions in FIXED_RULES:
        return FIXED_RULES[positions]
    if isinstance(positions, int) and not isinstance(positions, bool):
        return 1
    if isinstance(positions, (list, tuple, range)):
        if positions and all(isinstance(item, (list, tuple, range)) for item in positions):
            return max(len(chosen) for chosen in positions)  # type: ignore[arg-type]
        return len(positions)
    prompt_positions(positions, 1, 0)  # an unknown rule is refused here, before any prompt is tokenized
    return max(len(prompt_positions(positions, length, 0)) for length in lengths())


def prompt_lengths(prompts: Sequence[Any], checkpoint: str) -> set[int]:
    """The prompts' distinct token counts: a token-id prompt's own; a string's as the replica's engine tokenizes
    it (`streamscope.bulk.spec.token_ids`: the checkpoint's tokenizer, special tokens added), in batches."""
    lengths = {len(prompt) for prompt in prompts if not isinstance(prompt, str)}
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    if texts:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        for start in range(0, len(texts), TOKENIZE_BATCH):
            batch = tokenizer(texts[start:start + TOKENIZE_BATCH], return_attention_mask=False)["input_ids"]
            lengths.update(len(ids) for ids in batch)
    return lengths


def _row_shapes(config: Any, values: list[str], hidden: int) -> dict[str, tuple[int, ...]]:
    """The rows of `values` not `hidden` wide, by the config (the bulk path measures these after its first
    shard; a replica's shard is planned before it runs)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for value in values:
        if value in ROOT_VALUES:
            continue
        if value == HEAD_RESULTS_VALUE:
            heads = _first(config, "num_attention_heads", "n_head")
            if heads is not None:
                shapes[value] = (heads, hidden)
        elif value.split(".")[-1] in NEURONS:  # GPT-2's n_inner None: four times the hidden size
            shapes[value] = (_first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden,)
    return shapes


def _first(config: Any, *names: str) -> Optional[int]:
    for name in names:
        found = getattr(config, name, None)
        if isinstance(found, int) and not isinstance(found, bool):
            return found
    return None


def _dtype(value: Any) -> Optional[torch.dtype]:
    """`value` (a torch dtype or its name) as a floating torch dtype; None for ``"auto"``, None or other."""
    if isinstance(value, torch.dtype):
        return value if value.is_floating_point else None
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        found = DTYPE_WORDS.get(name, getattr(torch, name, None))
        if isinstance(found, torch.dtype) and found.is_floating_point:
            return found
    return None
