"""The transformers engine as the workflows see it: one left-padded batch per run, the weights in this process."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import nnsight
import torch

from .. import nnsight_seam as seam
from ..families.logits import scale_and_cap
from ..engine import (Body, Engine, Prompt, attention_modules, cut, down_projections, mask_positions,
                      norm_parameters, output_projection, padded)


class TransformersEngine(Engine):
    """Runs prompts as one left-padded batch with mask-derived positions; reads weights straight off the modules."""

    name = "transformers"
    reference_kernels = True

    def precision(self) -> tuple[str, torch.dtype]:
        weight = seam.module_of(self.model.lm_head).weight
        return weight.device.type, weight.dtype

    def trace_input(self, prompts: Sequence[Prompt]) -> Any:
        # One text prompt goes to nnsight as text; anything else as one left-padded batch whose position ids
        # count each prompt from its first real token, so learned and rotary positions are the prompt's own.
        if len(prompts) == 1 and isinstance(prompts[0], str):
            return prompts[0]
        tokens, mask = padded(self.model.tokenizer, prompts, "left")
        return {"input_ids": tokens, "attention_mask": mask.long(), "position_ids": mask_positions(mask)}

    def run(self, prompts: Sequence[Prompt], body: Body, seq_axes: Sequence[tuple[int, ...]]) -> list[list[torch.Tensor]]:
        tokens, mask = padded(self.model.tokenizer, prompts, "left")
        inputs = {"input_ids": tokens, "attention_mask": mask.long(), "position_ids": mask_positions(mask)}
        with self.model.trace(inputs):
            found: list = nnsight.save([])
            found.extend(body())
        lengths = mask.sum(-1).tolist()
        return [[cut(value, row, length, axes, "left") for value, axes in zip(found, seq_axes)]
                for row, length in enumerate(lengths)]

    def run_each(self, prompt: str, bodies: Sequence[Body]) -> list[list[torch.Tensor]]:
        with self.model.trace() as tracer:
            results: list = nnsight.save([])
            for body in bodies:
                with tracer.invoke(prompt):
                    results.append(list(body()))
        return list(results)

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        model = self.model
        logits = model.lm_head(normed)
        scaling = model.family_spec.logit_scaling
        return scaling(model.config, logits) if scaling is not None else logits

    def norm_parameters(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        return norm_parameters(seam.module_of(self.model.norm))

    def unembedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return seam.module_of(self.model.lm_head).weight.detach()[ids].clone()

    def head_parameters(self) -> tuple[Optional[torch.Tensor], float, Optional[float]]:
        bias = getattr(seam.module_of(self.model.lm_head), "bias", None)
        scale, cap = scale_and_cap(self.model.family_spec.logit_scaling, self.model.config)
        return (None if bias is None else bias.detach().clone()), scale, cap

    def output_projections(self) -> list[torch.Tensor | str]:
        model = self.model
        width = model.num_heads * model.head_dim
        return [module if isinstance(module, str) else output_projection(module, width)
                for module in attention_modules(model, model.num_layers)]

    def down_projections(self) -> list[torch.Tensor | str]:
        return down_projections(self.model, self.model.num_layers)
