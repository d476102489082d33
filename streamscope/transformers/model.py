"""streamscope on Hugging Face transformers: nnsight's TransformersModel with the family's names."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from nnsight import TransformersModel

from .. import nnsight_seam as seam
from ..bulk.spec import plain_generation
from ..engine import TRANSFORMERS_BUILD_CONTEXTS
from ..input_checks import check_token_ids
from ..sae import route_harvest
from ..standardized import Standardized
from ..values import OUTPUT, ComputedValue, StreamValue
from . import families
from .bulk import generate, harvest
from .engine import TransformersEngine


class StandardizedTransformers(Standardized, TransformersModel):
    """A transformers causal LM under streamscope's names: `model.layers[i].layer_mid` and the rest."""

    ENGINE_CLASS = TransformersEngine

    @StreamValue(None, OUTPUT, shape="[batch, seq, vocab_size]")
    def logits(self) -> torch.Tensor:
        """The next-token logits at every position, after any final scaling or soft cap, [batch, seq, vocab_size]."""

    @ComputedValue(None, OUTPUT, shape="[batch, seq, vocab_size]", read_only=(
        "{name} is read-only, as on vLLM (where it is computed for the read): edit model.logits instead."),
        no_gradient="{name} is a copy of model.logits made for the read, so no gradient flows through it: read "
                    "model.logits.grad (the same values on this engine).")
    def prompt_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits at every position, [batch, seq, vocab_size]: the same as `logits` on this engine.

        On vLLM `logits` is the sampled position only and `prompt_logits`
        every prompt position, so code that wants every position reads this
        name on either engine. Read-only on both: edit `model.logits`.
        """
        return logits.clone()

    def __init__(self, path: str | Path | torch.nn.Module, *args: Any, family: str | ModuleType | None = None, **kwargs: Any) -> None:
        """`family` overrides the family module found by ``config.model_type``: a module, or a model type's name."""
        kwargs = self._take_family(path, family, families, kwargs, {})
        kwargs.setdefault("dtype", torch.float32)
        kwargs.setdefault("dispatch", True)
        kwargs.setdefault("task", "text-generation")
        # A model built in memory (random weights from a config, as the benchmarks do) is taken as is.
        built = isinstance(path, torch.nn.Module)
        with contextlib.ExitStack() as beside:  # what another engine in this process needs around the build
            for context in TRANSFORMERS_BUILD_CONTEXTS:
                beside.enter_context(context())
            super().__init__(path if built else str(path), *args, **kwargs)
        self._check_family()

    def _batch(self, invokes: list, fn: Any) -> tuple:
        """nnsight's batching, after refusing token ids beyond the vocabulary (the embedding would fail on them)."""
        batched = super()._batch(invokes, fn)
        args, kwargs = batched
        ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        if isinstance(ids, torch.Tensor):
            check_token_ids(ids, self.vocab_size)
        return batched

    # The bulk path (streamscope.bulk): no trace, one hook per module for a whole padded batch.

    def harvest(self, prompts: Any, values: Any = None, layers: Any = None, positions: Any = "last",
                out: str | Path | None = None, **options: Any) -> Any:
        """Read values at chosen blocks and positions of many prompts, per prompt or to shards on disk.

        ``steer=[...]`` reads them under steers; ``sae=`` (with ``top_k=``)
        harvests an SAE's features at its own site (`streamscope.sae`). See
        `streamscope.bulk` for the layout; ``batch_size`` (8), ``shard_size``
        (prompts per shard; by default 1,024, or fewer once they hold 1 GiB of
        rows) and ``progress`` are options.
        """
        return route_harvest(self, prompts, values, layers, positions, out, options, harvest)

    def generate(self, *inputs: Any, steer: Any = None, harvest: Any = None, **kwargs: Any) -> Any:
        """Sample completions of many prompts: a `streamscope.Generation` (texts, tokens, optional logits).

        Called, it is the bulk path (`streamscope.transformers.bulk.generate`), with or without ``steer=``
        and ``harvest=``: ``model.generate(prompts, max_tokens=20)`` returns the same `Generation` as on
        vLLM (transformers' ``max_new_tokens`` and ``do_sample`` are taken too). As a ``with`` block it
        is nnsight's generate, a trace over every step (the decision is made here, at the caller's depth).
        """
        if steer is not None or harvest is not None:
            return generate(self, *inputs, steer=steer or (), harvest=harvest, **kwargs)
        fn = seam.unwrapped_generate(self, TransformersModel)
        if seam.interleaving(self):
            return fn(*inputs, **kwargs)
        tracer = self.trace(*inputs, fn=fn, **kwargs)
        try:
            tracer.capture()
        except seam.WithBlockNotFoundError:
            prompts, settings = plain_generation(inputs, kwargs)
            return generate(self, prompts, **settings)
        return tracer


def load(path: str | Path, **kwargs: Any) -> StandardizedTransformers:
    """Load a causal LM from a folder or repository on transformers, float32 unless `dtype` says otherwise.

    Keyword arguments go to nnsight's TransformersModel (and from it to
    ``from_pretrained``): ``dtype``, ``device_map``, ``attn_implementation``,
    ``dispatch=False`` to load the weights at the first trace; ``family`` (a
    family module, or a model type's name such as ``"default"``) to override
    the family found by ``config.model_type``.
    """
    return StandardizedTransformers(path, **kwargs)
