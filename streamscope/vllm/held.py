"""SAEs the engine's workers hold between bulk runs, so their weights cross to the worker once, not every run.

An SAE of width 16 x hidden at Llama-3-8B's shape is 2 GiB of float32: pickled
into every run's plan, it would cross to the engine's process (and onto its
device) on every ``harvest(sae=...)`` and ``generate(steer=[sae.clamp(...)])``.
Instead the client swaps each SAE in a run's plan for a `HeldSAE` (its key),
and sends the weights along only the first time (or after the workers let it
go); each worker keeps the SAE on its device, in float32, under that key.

The client decides what the workers hold: it keeps the keys in the order they
were last used and tells the workers which to drop in the same plan, so the
two sides never disagree and a worker needs no reply to say what it has. At
most `CAPACITY` SAEs are held per engine; `release` lets them go at once.

The key is made once per SAE object (a random id) and carries the weights'
version counters and storage addresses, so an SAE edited in place or given
new tensors is sent again: no per-run hashing of the weights.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

#: The most SAEs an engine's workers keep at once; the least recently used goes first.
CAPACITY = 4
WEIGHTS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")


@dataclass(frozen=True)
class HeldSAE:
    """An SAE a run's plan names by key: the worker's own copy (on its device, float32) stands in for it."""

    key: str


def key_of(sae: Any) -> str:
    """The SAE's key: its object's id (made once) and its weights' versions and storages (changed by an edit)."""
    ident = sae.__dict__.get("_streamscope_id")
    if ident is None:
        ident = sae.__dict__["_streamscope_id"] = uuid.uuid4().hex
    tensors = [getattr(sae, name) for name in WEIGHTS if getattr(sae, name, None) is not None]
    marks = ".".join(f"{tensor._version}-{tensor.untyped_storage().data_ptr():x}" for tensor in tensors)
    return f"{ident}:{marks}"


def _ledger(model: Any) -> "OrderedDict[str, None]":
    """The keys this engine's workers hold, least recently used first (kept on the model, as the engine is)."""
    ledger = model.__dict__.get("_streamscope_held_saes")
    if ledger is None:
        ledger = model.__dict__["_streamscope_held_saes"] = OrderedDict()
    return ledger


def swap_out(model: Any, steers: list, readout: Any) -> tuple[list, Any, dict[str, Any], list[str], list[str]]:
    """A run's steers and readout with every SAE replaced by its `HeldSAE`, plus what the plan must carry.

    Returns ``(steers, readout, ship, drop, used)``: `ship` maps the keys the
    workers do not hold yet to the SAEs (float32, on the CPU, to travel);
    `drop` lists the keys they let go of first, to stay within `CAPACITY`;
    `used` is what `record` takes once the workers have the plan.
    """
    ledger = _ledger(model)
    ship: dict[str, Any] = {}
    used: list[str] = []

    def held(sae: Any) -> HeldSAE:
        key = key_of(sae)
        if key not in ledger and key not in ship:
            ship[key] = sae.to(torch.float32, "cpu")
        used.append(key)
        return HeldSAE(key)

    steers = [replace(steer, sae=held(steer.sae)) if steer.sae is not None and not isinstance(steer.sae, HeldSAE)
              else steer for steer in steers]
    if readout is not None and getattr(readout, "sae", None) is not None and not isinstance(readout.sae, HeldSAE):
        readout = readout.holding(held(readout.sae))
    kept = [key for key in ledger if key not in used] + list(dict.fromkeys(used))
    drop = kept[:max(0, len(kept) - max(CAPACITY, len(set(used))))]
    return steers, readout, ship, drop, used


def record(model: Any, used: list[str], drop: list[str]) -> None:
    """Note on the ledger that the workers took a plan: they hold `used` (now the most recent) and not `drop`."""
    ledger = _ledger(model)
    for key in drop:
        ledger.pop(key, None)
    for key in used:
        ledger[key] = None
        ledger.move_to_end(key)


def forget(model: Any, sae: Optional[Any] = None) -> list[str]:
    """The keys to drop for `release`: `sae`'s (every key it had), or every SAE held; taken off the ledger."""
    ledger = _ledger(model)
    if sae is None:
        keys = list(ledger)
    else:
        ident = sae.__dict__.get("_streamscope_id")
        keys = [key for key in ledger if ident is not None and key.split(":", 1)[0] == ident]
    for key in keys:
        ledger.pop(key, None)
    return keys


class WorkerSAEs:
    """A worker's SAEs by key, each on its device in float32 (`swap_out` names them; `take_in` resolves them)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.saes: dict[str, Any] = {}

    def update(self, ship: dict[str, Any], drop: list[str]) -> None:
        """Let go of `drop`, then keep the SAEs of `ship`, moved to the worker's device."""
        for key in drop:
            self.saes.pop(key, None)
        for key, sae in ship.items():
            self.saes[key] = sae.to(torch.float32, self.device)

    def resolve(self, sae: Any) -> Any:
        """The worker's SAE for a `HeldSAE` (anything else as it is)."""
        if not isinstance(sae, HeldSAE):
            return sae
        found = self.saes.get(sae.key)
        if found is None:
            raise RuntimeError(f"the engine's worker holds no SAE under key {sae.key}: its copy was let go of. "
                               f"Run again: the client sends the SAE's weights again.")
        return found

    def take_in(self, steers: list, readout: Any) -> tuple[list, Any]:
        """A plan's steers and readout with every `HeldSAE` replaced by the worker's SAE."""
        steers = [replace(steer, sae=self.resolve(steer.sae)) if isinstance(steer.sae, HeldSAE) else steer
                  for steer in steers]
        if readout is not None and isinstance(getattr(readout, "sae", None), HeldSAE):
            readout = readout.holding(self.resolve(readout.sae))
        return steers, readout
