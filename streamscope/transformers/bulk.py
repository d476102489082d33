"""The bulk path on transformers: padded batches with plain hooks on the model's own modules, no trace.

`harvest` runs right-padded batches (sorted by length, so little is padding)
through the model's forward; `generate` runs transformers' ``generate`` on
left-padded batches. In both, one hook per module applies every steer and
reads every harvest for the whole batch, at the rows `Applier` worked out for
the step from the attention mask.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from tqdm.auto import tqdm

from .. import nnsight_seam as seam
from ..bulk.apply import Applier, Span, steer_plans
from ..bulk.moments import check_reduce, reduce_buffer
from ..bulk.results import Generation, Harvest, ShardWriter, assemble, check_shard_size, shard_fits
from ..bulk.spec import Positions, check_doses, check_steer, generation_harvest, harvest_spec, token_ids


def _pad_id(model: Any) -> int:
    tokenizer = model.tokenizer
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def _parameters(model: Any) -> tuple[torch.dtype, torch.device]:
    parameter = next(seam.module_of(model).parameters())
    return parameter.dtype, parameter.device


def _batches(ids: Sequence[list[int]], batch_size: int) -> list[list[int]]:
    """Prompt indices in batches of similar length (longest first), so padding stays small."""
    order = sorted(range(len(ids)), key=lambda index: -len(ids[index]))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def _padded(ids: Sequence[list[int]], batch: list[int], pad: int, left: bool, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids[index]) for index in batch)
    tokens = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, index in enumerate(batch):
        length = len(ids[index])
        columns = slice(width - length, width) if left else slice(0, length)
        tokens[row, columns] = torch.tensor(ids[index])
        mask[row, columns] = 1
    return tokens.to(device), mask.to(device)


def step_spans(mask: torch.Tensor, new_tokens: int, keys: Sequence[int]) -> list[Span]:
    """Each row's tokens of this forward: the last `new_tokens` columns of the attention mask, padding left out."""
    mask = mask.detach().to("cpu")
    positions = mask.cumsum(-1) - 1
    tail, tail_positions = mask[:, -new_tokens:], positions[:, -new_tokens:]
    spans = []
    for row, key in enumerate(keys):
        valid = tail[row].nonzero()
        if valid.numel() == 0:
            continue
        first, last = int(valid[0]), int(valid[-1])
        spans.append(Span(key, row * new_tokens + first, last - first + 1, int(tail_positions[row, first])))
    return spans


def _past_length(kwargs: dict) -> int:
    """How many tokens of each row the cache holds before this forward (rows are unpadded: all the same)."""
    start = kwargs.get("cache_position")
    if start is not None and start.numel():
        return int(start[0])
    positions = kwargs.get("position_ids")
    if positions is not None:
        return int(positions.reshape(-1)[0])
    cache = kwargs.get("past_key_values")
    if cache is not None and hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return 0


def _forward_kwargs(module: torch.nn.Module) -> dict[str, Any]:
    # The unembedding of every position is not needed for a harvest: keep the last one where the model allows.
    if "logits_to_keep" in inspect.signature(module.forward).parameters:
        return {"logits_to_keep": 1}
    return {}


def harvest(model: Any, prompts: Sequence[Any], values: Any, layers: Any = None, positions: Positions = "last",
            out: Optional[str | Path] = None, batch_size: int = 8, shard_size: Optional[int] = None,
            progress: bool = True, readout: Any = None, steer: Sequence[Any] = (),
            reduce: Optional[str] = None) -> Harvest | Path:
    """Read values at chosen blocks and positions of many prompts, in padded batches; see `streamscope.bulk`.

    `reduce` (``"last"``, ``"mean"``) reduces each prompt's positions as its batch finishes
    (`streamscope.bulk.moments.reduce_positions`), so only one row a prompt is kept.
    A shard of `out` is written once its batches hold `shard_size` prompts; by default 1,024 prompts or more than
    `streamscope.bulk.results.SHARD_BYTES` of rows (1 GiB), whichever comes first.
    """
    check_shard_size(shard_size)
    ids = token_ids(model, prompts)
    lengths = [len(tokens) for tokens in ids]
    spec = harvest_spec(model, values, layers, positions, lengths)
    spec.reduce = check_reduce(reduce)
    checked = [(item, check_steer(model, item, len(ids), lengths)) for item in steer]
    sites = spec.sites(model)
    dtype, device = _parameters(model)
    checked = list(zip(check_doses(model, [item for item, _ in checked], dtype), [site for _, site in checked]))
    plans = steer_plans(checked, list(range(len(ids))), lengths, dtype, device, root=model)
    module = seam.module_of(model)
    writer = ShardWriter(out, spec, len(ids)) if out is not None else None
    applier = Applier(sites, {index: spec.positions[index] for index in range(len(ids))}, plans, device,
                      readout=readout).install()
    collected: dict[int, list] = {}
    pending: list[int] = []
    extra = _forward_kwargs(module)
    bar = tqdm(total=len(ids), desc="harvest", unit="prompt", disable=not progress)
    try:
        for batch in _batches(ids, batch_size):
            tokens, mask = _padded(ids, batch, _pad_id(model), left=False, device=device)
            applier.step(step_spans(mask, tokens.shape[1], batch))
            with torch.inference_mode():
                module(input_ids=tokens, attention_mask=mask, use_cache=False, **extra)
            if applier.error is not None:
                raise applier.error
            for index in batch:
                collected[index] = reduce_buffer(applier.take(index), spec.reduce)
            pending.extend(batch)
            bar.update(len(batch))
            # The shard is written once another prompt would not fit (its batch's rows exist only after it runs).
            if writer is not None and not shard_fits(len(pending) + 1, _held_bytes(collected, pending), shard_size):
                _flush(writer, spec, collected, pending)
        if writer is None:
            order = list(range(len(ids)))
            return assemble(spec, [collected[index] for index in order], order)
        if pending:
            _flush(writer, spec, collected, pending)
        return writer.close()
    finally:
        if writer is not None:
            writer.abort()  # after close a no-op; on an error, no index (a half harvest) and the thread ends
        applier.remove()
        bar.close()


def _held_bytes(collected: dict[int, Any], pending: list[int]) -> int:
    return sum(collected[index].nbytes for index in pending if collected[index] is not None)


def _flush(writer: ShardWriter, spec: Any, collected: dict[int, list], pending: list[int]) -> None:
    order = sorted(pending)
    writer.write(assemble(spec, [collected.pop(index) for index in order], order))
    pending.clear()


def generate(model: Any, prompts: Sequence[Any], max_tokens: int = 16, *, steer: Sequence[Any] = (),
             harvest: Optional[dict[str, Any]] = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: Optional[int] = None, ignore_eos: bool = False, return_logits: bool = False,
             batch_size: int = 8, progress: bool = True) -> Generation:
    """Sample many completions with steers applied and values harvested; see `streamscope.bulk`."""
    ids = token_ids(model, prompts)
    lengths = [len(tokens) for tokens in ids]
    checked = [(item, check_steer(model, item, len(ids), lengths)) for item in steer]
    spec = generation_harvest(model, harvest, lengths)
    dtype, device = _parameters(model)
    checked = list(zip(check_doses(model, [item for item, _ in checked], dtype), [site for _, site in checked]))
    plans = steer_plans(checked, list(range(len(ids))), lengths, dtype, device, root=model)
    sites = spec.sites(model) if spec is not None else []
    wanted = {index: spec.positions[index] for index in range(len(ids))} if spec is not None else {}
    applier = Applier(sites, wanted, plans, device).install()
    module = seam.module_of(model)
    keys: list[int] = []

    def scope(_: Any, args: tuple, kwargs: dict) -> None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if mask is None:  # an unpadded batch: generate may leave the all-ones mask out
            past = _past_length(kwargs)
            mask = torch.ones(tokens.shape[0], past + tokens.shape[1], dtype=torch.long)
        applier.step(step_spans(mask, tokens.shape[1], keys))

    hook = module.register_forward_pre_hook(scope, with_kwargs=True)
    if seed is not None:
        torch.manual_seed(seed)
    sampling: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        sampling.update(temperature=temperature, top_p=top_p, top_k=top_k)
    if ignore_eos:
        sampling["min_new_tokens"] = max_tokens
    generated: list[list[int]] = [[] for _ in ids]
    logits: list[Optional[torch.Tensor]] = [None] * len(ids)
    collected: dict[int, list] = {}
    eos = model.tokenizer.eos_token_id
    bar = tqdm(total=len(ids), desc="generate", unit="prompt", disable=not progress)
    try:
        for batch in _batches(ids, batch_size):
            tokens, mask = _padded(ids, batch, _pad_id(model), left=True, device=device)
            keys[:] = batch
            with torch.inference_mode():
                output = module.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=max_tokens,
                                         pad_token_id=_pad_id(model), output_logits=return_logits,
                                         return_dict_in_generate=True, **sampling)
            if applier.error is not None:
                raise applier.error
            new = output.sequences[:, tokens.shape[1]:].tolist()
            for row, index in enumerate(batch):
                sequence = new[row]
                if eos is not None and not ignore_eos and eos in sequence:
                    sequence = sequence[:sequence.index(eos) + 1]
                generated[index] = sequence
                if return_logits:
                    logits[index] = torch.stack([step[row] for step in output.logits[:len(sequence)]]).float().cpu()
                if spec is not None:
                    collected[index] = applier.take(index)
            bar.update(len(batch))
    finally:
        hook.remove()
        applier.remove()
        bar.close()
    texts = [model.tokenizer.decode(sequence, skip_special_tokens=True) for sequence in generated]
    harvested = None
    if spec is not None:
        order = list(range(len(ids)))
        harvested = assemble(spec, [collected[index] for index in order], order)
    return Generation(generated, texts, logits if return_logits else None, harvested)
