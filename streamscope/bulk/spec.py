"""What a bulk run asks for, checked before anything runs: the harvest (`HarvestSpec`), the steers' doses, the prompts.

This is the bulk request's import path: the names it always held are here,
each defined in the module that says what it is: `streamscope.bulk.steer`
(`Steer`, its checks, `apply_steers`), `streamscope.bulk.sites` (`Site`,
`locate`, the value names), `streamscope.bulk.positions` (the positions
rules) and `streamscope.bulk.dose` (`SteerError`, `check_dose`). Defined here:
the harvest a request reads (`HarvestSpec`, `harvest_spec`), the stream norms
the dose check measures (`stream_norms`, `check_doses`) and a request's
prompts and generation settings (`token_ids`, `plain_generation`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .dose import DoseWarning, SteerError, check_bulk_doses, check_dose, dose_field, edit_size
from .positions import RULES, SKIP_FIRST, Positions, check_rule, per_prompt_positions, prompt_positions
from .sites import (HEAD_RESULTS_VALUE, ROOT_VALUES, SHORT, Site, block_index, host_and_name, layer_list, locate,
                    row_width, value_names)
from .steer import (DOSE_ACTIONS, MAX_DOSE, MODE_USES, Steer, apply_steers, check_origin, check_steer, check_vector,
                    condition_sites, steer_positions)

#: The text on which streamscope measures a value's stream norm for the dose check (`stream_norms`).
CALIBRATION_TEXT = ("The old lighthouse keeper walked along the shore at dawn, counting the boats that had come "
                    "back in the night, and wrote their names in a small blue book.")


#: Each model's measured stream norms, ``(value, block) -> ||h||``, kept while the model lives.
_NORMS: dict[int, tuple[Any, dict[tuple[str, Optional[int]], float]]] = {}


def stream_norms(model: Any, sites: Sequence[tuple[str, Optional[int]]]) -> dict[tuple[str, Optional[int]], float]:
    """``||h||`` of each ``(value, block)`` in `sites`: the value's mean row norm over `CALIBRATION_TEXT`'s
    positions after the first (the sink), measured by a harvest on `model` once and kept for the model's life."""
    entry = _NORMS.get(id(model))
    if entry is None or entry[0]() is not model:
        try:
            reference: Any = weakref.ref(model)
        except TypeError:
            reference = lambda: model  # noqa: E731  (kept while the process lives)
        entry = _NORMS[id(model)] = (reference, {})
    known = entry[1]
    missing: dict[str, list[Optional[int]]] = {}
    for value, layer in sites:
        if (value, layer) not in known:
            missing.setdefault(value, [])
            if layer not in missing[value]:
                missing[value].append(layer)
    for value, layers in missing.items():
        blocks = [layer for layer in layers if layer is not None]
        harvest = model.harvest([CALIBRATION_TEXT], value, layers=blocks or None, positions="all", progress=False)
        rows = harvest[value][0].float()  # [blocks, positions, hidden]; [positions, hidden] at the root
        rows = rows.unsqueeze(0) if rows.dim() == 2 else rows
        norms = (rows[:, 1:] if rows.shape[1] > 1 else rows).norm(dim=-1).mean(-1)
        if value in ROOT_VALUES:
            known[(value, None)] = float(norms[0])
        else:
            for index, layer in enumerate(blocks):
                known[(value, layer)] = float(norms[index])
    return {site: known[site] for site in sites}


def measured_norms(model: Any) -> dict[tuple[str, Optional[int]], float]:
    """The stream norms `stream_norms` has measured on `model` so far, ``(value, block) -> ||h||`` (a copy; nothing
    is measured here)."""
    entry = _NORMS.get(id(model))
    return dict(entry[1]) if entry is not None and entry[0]() is model else {}


def check_doses(model: Any, steers: Sequence[Steer], dtype: torch.dtype) -> list[Steer]:
    """`check_dose` for each steer of a bulk run before it runs, ``||h||`` measured once per model, value and block
    (`stream_norms`), or the norm the steer's vector carries there, over any measured
    (`streamscope.bulk.dose.check_bulk_doses`), so that a refusal states it: the steers to run, in order (a clamped
    one replaced)."""
    return check_bulk_doses(model, steers, dtype, lambda sites: stream_norms(model, sites),
                            lambda: measured_norms(model))



@dataclass
class HarvestSpec:
    """A harvest: which values, at which blocks, at which positions of each prompt."""

    values: list[str]
    layers: list[int]
    positions: list[list[int]] = field(default_factory=list)
    #: What each harvested row becomes before it is stored (an SAE's features: `streamscope.sae.FeatureReadout`).
    readout: Optional[Any] = None
    #: A value whose row is not one vector: its row's shape (head_results: ``(heads, hidden_size)``), which the
    #: run stores flattened and `streamscope.bulk.results.assemble` gives back.
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: How each prompt's positions are reduced where they are read (`streamscope.bulk.moments.reduce_positions`):
    #: ``"last"``, ``"mean"``, or None (every position kept).
    reduce: Optional[str] = None

    def sites(self, model: Any) -> list[Site]:
        """Every (value, block) `Site`, root values once."""
        return [locate(model, value, None) if value in ROOT_VALUES else locate(model, value, layer)
                for value in self.values for layer in ([None] if value in ROOT_VALUES else self.layers)]


def harvest_values(values: str | Sequence[str]) -> list[str]:
    """A harvest's value names as a list (one name alone is a list of one); none at all is refused."""
    names = [values] if isinstance(values, str) else list(values)
    if not names:
        raise ValueError("harvest needs at least one value name.")
    return names


def harvest_spec(model: Any, values: Any, layers: Any, positions: Positions, lengths: Sequence[int]) -> HarvestSpec:
    """Check a harvest's values, blocks and positions on `model`, before anything runs."""
    values = harvest_values(values)
    spec = HarvestSpec(values, layer_list(model, layers), per_prompt_positions(positions, lengths))
    spec.sites(model)  # every site resolves, or the error says which does not
    if HEAD_RESULTS_VALUE in values:
        spec.shapes[HEAD_RESULTS_VALUE] = (model.num_heads, model.hidden_size)
    # Each prompt's rows are kept in one [sites, positions, width] buffer, filled as the steps run.
    widths: dict[str, list[str]] = {}
    for value in values:
        widths.setdefault(row_width(value), []).append(value)
    if len(widths) > 1:
        described = "; ".join(f"{', '.join(names)} {width}" for width, names in widths.items())
        raise ValueError(f"one harvest's values share one width, and these differ ({described}): harvest the values "
                         f"of each width in a harvest of their own.")
    return spec


__all__ = [
    # Defined here.
    "CALIBRATION_TEXT", "HarvestSpec", "check_doses", "generation_harvest", "harvest_spec", "harvest_values",
    "plain_generation", "stream_norms", "token_ids",
    # Defined in the modules named above, and imported from here as before.
    "DOSE_ACTIONS", "HEAD_RESULTS_VALUE", "MAX_DOSE", "MODE_USES", "Positions", "ROOT_VALUES", "RULES", "SHORT",
    "SKIP_FIRST", "DoseWarning", "Site", "Steer", "SteerError", "apply_steers", "block_index", "check_dose",
    "check_origin", "check_rule", "check_steer", "check_vector", "condition_sites", "dose_field", "edit_size",
    "host_and_name", "layer_list", "locate", "per_prompt_positions", "prompt_positions", "row_width",
    "steer_positions", "value_names",
]


def generation_harvest(model: Any, harvest: Any, lengths: Sequence[int]) -> Optional[HarvestSpec]:
    """The harvest a generation reads along (``harvest={"values": ..., "layers": ..., "positions": ...}``), or None."""
    if harvest is None:
        return None
    options = dict(harvest)
    spec = harvest_spec(model, options.pop("values"), options.pop("layers", None),
                        options.pop("positions", "last"), lengths)
    if options:
        raise TypeError(f"harvest= takes values, layers and positions; not {', '.join(options)}.")
    return spec


def plain_generation(inputs: tuple, kwargs: dict[str, Any]) -> tuple[list, dict[str, Any]]:
    """`model.generate(...)` called outside a ``with`` block, as the bulk path's (prompts, settings).

    One prompt (a string) is a list of one; transformers' spellings are taken too: ``max_new_tokens`` is
    ``max_tokens``, ``do_sample=False`` greedy (``temperature=0``), ``do_sample=True`` sampling at temperature 1
    unless one is given.
    """
    if len(inputs) != 1:
        raise TypeError(f"model.generate takes the prompts as one argument (a string or a list); got {len(inputs)}")
    prompts = inputs[0]
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    settings = dict(kwargs)
    if "max_new_tokens" in settings:
        if "max_tokens" in settings:
            raise TypeError("give max_tokens or max_new_tokens, not both")
        settings["max_tokens"] = settings.pop("max_new_tokens")
    if "do_sample" in settings:
        sample = settings.pop("do_sample")
        if not sample:
            if settings.get("temperature", 0.0) != 0.0:
                raise ValueError("do_sample=False is greedy: leave temperature out, or sample with do_sample=True")
            settings["temperature"] = 0.0
        else:
            settings.setdefault("temperature", 1.0)
    return prompts, settings


def token_ids(model: Any, prompts: Sequence[Any]) -> list[list[int]]:
    """Each prompt's token ids: a string is tokenized as a trace tokenizes it; a list of ids is taken as is."""
    if isinstance(prompts, str):
        raise TypeError("bulk runs take a list of prompts; wrap a single prompt in a list.")
    ids = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids.append(list(model.tokenizer(prompt)["input_ids"]))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(token, int) for token in prompt):
            ids.append(list(prompt))
        else:
            raise TypeError(f"prompt {index} is a {type(prompt).__name__}: give a string or a list of token ids.")
        if not ids[-1]:
            raise ValueError(f"prompt {index} has no tokens.")
    return ids
