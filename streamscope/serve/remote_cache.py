"""`client.cache(...)`: a `streamscope.Cache` built from a server's harvests, as `model.cache` builds one in process.

What HTTP carries: every stream and contribution a harvest takes (``layer_input`` ... ``layer_output``, the
attention and MLP outputs, a dense MLP's neurons, the token embeddings and the final norm's output), at every
position of every prompt, and the logits (the final norm's output through the engine's own head, in its worker:
`streamscope.serve.head`). The cache's TransformerLens methods that need only those work as in process
(stacks, ``decompose_resid``, ``accumulated_resid``, norm scales, ``logit_attrs`` with the head's rows and
parameters read from the server).

What it does not carry, said where it is asked for: attention internals (``pattern``, ``scores``, ``queries``,
``keys``, ``values``, ``head_outputs``: the server taps no attention kernel), per-head and per-neuron results
(they need the output and down projections' weights, which stay on the server), gradients. Asked for by name,
they are refused before anything runs; left to the default, they are listed in `Cache.unavailable` with the reason.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..blocks import Attention
from ..bulk.sites import value_names
from ..engine import padded
from ..errors import Unavailable
from ..input_checks import indices, names
from ..workflows.cache import (ALL, DEFAULT_VALUES, ROOT, Cache, _block_keys, _checked_request, _final_norm, _keys, _pad,
                               _stored, apply_run_with_cache_arguments)

#: Why a value or a run a server does not carry is refused, by what was asked.
NOT_OVER_HTTP = {
    "trace": ("a server runs no trace body (nnsight's code does not cross HTTP): over a streamscope.Client use "
              "what harvests carry (client.harvest, client.cache, streamscope.lens, streamscope.directions) and "
              "the server's own sweeps (streamscope.patch), or load the model in process for traces, edits inside "
              "a forward and gradients"),
    "attention": ("a streamscope server harvests streams and contributions (one vector per token and block); "
                  "attention internals (patterns, scores, queries, keys, values, head outputs) are not served "
                  "over HTTP: load the model in process (streamscope.load) to read them"),
    "weights": ("a server does not send its projection weights (gigabytes on a large model): compute per-head "
                "and per-neuron results in process (streamscope.load)"),
}


def _reason(full: str) -> str:
    """Why a block value a server cannot harvest is not in the cache."""
    # An attention sublayer's value that is not its contribution is one of its internals (the contribution is
    # harvested).
    return NOT_OVER_HTTP["attention"] if full.startswith(f"{Attention.ROLE}.") else (
        f"{full} is not a value a streamscope server harvests; load the model in process (streamscope.load)")


def plan(client: Any, values: Optional[list[str]], layers: list[int]) -> tuple[list, list[str], dict[str, str]]:
    """``(reads, roots, unavailable)``: the (block, full name) pairs to harvest in the order each block computes
    them, the root values, and ``{key: reason}`` for what is not served (by the model, or over HTTP).

    The names are resolved as in process (`streamscope.workflows.cache._block_keys`, over the server's support
    tables). A value HTTP does not carry is refused where it was named, and listed with the reason where it came
    with the default or ``"all"``."""
    harvestable = set(value_names()) & set(client.facts["values"])
    lenient = values is None or values == [ALL]
    roots = list(ROOT) if lenient else [name for name in values or () if name in ROOT]
    root_rows = client.facts["root"]
    unavailable = {name: root_rows[name] for name in roots if root_rows.get(name) is not None}
    roots = [name for name in roots if name not in unavailable]
    wanted = list(dict.fromkeys(DEFAULT_VALUES if values is None else values))
    found, block_unavailable = _block_keys(client, [name for name in wanted if name not in ROOT], layers, lenient)
    unavailable.update(block_unavailable)
    reads = []
    for index, full in found:
        if full in harvestable:
            reads.append((index, full))
        elif lenient:
            unavailable[f"layers.{index}.{full}"] = _reason(full)
        else:
            raise ValueError(f"model.cache over a server: layers.{index}.{full}: {_reason(full)}")
    return reads, roots, unavailable


def _unique(client: Any, reads: list) -> tuple[list, dict[str, str]]:
    """The reads with each tensor read once, and ``{alias key: key read}`` for the others, as the in-process cache
    (`streamscope.workflows.cache._unique`), from the server's groups of names of one tensor."""
    unique, aliases = [], {}
    first: dict[tuple[int, str], str] = {}
    for index, full in reads:
        group = next((names for names in client.facts["shared"][index] if full in names), [full])
        source = first.setdefault((index, group[0]), f"layers.{index}.{full}")
        if source != f"layers.{index}.{full}":
            aliases[f"layers.{index}.{full}"] = source
            continue
        unique.append((index, full))
    return unique, aliases


def _width(client: Any, full: str) -> int:
    """A value's row width, for sizing harvest requests (a dense MLP's neurons are wider than the stream)."""
    if full.split(".")[-1].startswith("neurons"):
        config = client.facts["config"]
        return int(config.get("intermediate_size") or config.get("n_inner") or 4 * client.hidden_size)
    return client.hidden_size


def harvest_all(client: Any, ids: list[list[int]], reads: list, roots: list[str]) -> dict[str, list[torch.Tensor]]:
    """``{key: one [seq, width] tensor per prompt}``: every read at every position, in as few harvest requests
    as the server's ``--max-harvest-bytes`` lets (a value's blocks split into groups that fit)."""
    limit = int(client.limits["max_harvest_bytes"])
    longest = max(map(len, ids))
    by_name: dict[str, list[int]] = {}
    for index, full in reads:
        by_name.setdefault(full, []).append(index)
    found: dict[str, list[torch.Tensor]] = {}
    for full, blocks in by_name.items():
        per_block = longest * _width(client, full) * 4
        group = max(1, limit // max(1, per_block))
        for start in range(0, len(blocks), group):
            chosen = blocks[start:start + group]
            harvest = client.harvest(ids, full, layers=chosen, positions="all")
            for slot, index in enumerate(chosen):
                found[f"layers.{index}.{full}"] = [rows[slot] for rows in harvest.values[full]]
    for name in roots:
        found[name] = list(client.harvest(ids, name, positions="all").values[name])
    return found


def remote_cache(client: Any, prompts: Any, values: Any = None, layers: Any = None, *, logits: bool = True,
                 batch_size: Optional[int] = None, progress: Optional[bool] = None, names_filter: Any = None,
                 pos_slice: Any = None, prepend_bos: Optional[bool] = None, padding_side: str = "left",
                 remove_batch_dim: bool = False, device: Any = None) -> Any:
    """`streamscope.workflows.cache.build_cache`'s cache from a server's harvests (arguments as there, which
    hands a model whose engine runs no traces here; `batch_size` and `progress` are taken for the signature:
    the client sends its requests concurrently).

    Every real position's value is the one the prompt gives alone (one request each), padded afterwards on
    `padding_side` with zeros, as the in-process vLLM cache is."""
    ids, pos_slice = _checked_request(client, prompts, prepend_bos, padding_side, remove_batch_dim, pos_slice)
    layers = indices(layers, client.num_layers, "block", "model.cache")
    reads, roots, unavailable = plan(client, names(values), layers)
    reads, aliases = _unique(client, reads)
    if logits and client.facts["root"].get("final_norm_output") is not None:
        raise Unavailable("logits", "model", f"over a server the logits are the final norm's output through the "
                          f"engine's head, and this model serves none: {client.facts['root']['final_norm_output']}; "
                          f"pass logits=False")
    harvested_roots = roots + (["final_norm_output"] if logits and "final_norm_output" not in roots else [])
    found = harvest_all(client, ids, reads, harvested_roots)
    tokens, mask = padded(client.tokenizer, ids, padding_side)
    longest = tokens.shape[1]
    keys = _keys(roots, reads)
    stored = _stored(keys, {key: [rows[None] for rows in found[key]] for key in keys}, aliases, longest,
                     padding_side)
    stored_logits = None
    if logits:
        per_prompt = [client.engine.head(rows, normed=True)["logits"][None] for rows in found["final_norm_output"]]
        stored_logits = _pad("logits", per_prompt, longest, padding_side)
    facts = client.facts
    try:
        heads: Optional[int] = client.num_heads
    except Unavailable:
        heads = None
    engine = client.engine
    cache = Cache(stored, tokens=tokens, mask=mask, logits=stored_logits, model_type=client.config.model_type,
                  num_layers=client.num_layers, unavailable=unavailable, final_norm=_final_norm(client, stored, mask),
                  unembedding=engine.unembedding_rows, head=engine.head_parameters,
                  norm_inputs={int(index): inputs for index, inputs in facts["norm_inputs"].items()},
                  num_heads=heads, tokenizer=client.tokenizer, logit_transform=facts["logit_transform"],
                  output_weights=engine.output_projections, down_weights=engine.down_projections,
                  learned_positions=facts["learned_positions"], padding_side=padding_side, model=client)
    apply_run_with_cache_arguments(cache, names_filter, pos_slice, remove_batch_dim, device)
    return cache


__all__ = ["NOT_OVER_HTTP", "remote_cache", "plan"]
