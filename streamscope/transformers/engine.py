"""The transformers engine as the workflows see it: one padded batch per run, the weights in this process."""

from __future__ import annotations

from typing import Optional, Sequence

import nnsight
import torch

from .. import nnsight_seam as seam
from ..engine import (Body, Engine, Prompt, attention_modules, cut, down_projections, norm_parameters,
                      output_projection, right_padded)


class TransformersEngine(Engine):
    """Runs prompts as one right-padded batch; reads weights straight off the model's modules."""

    name = "transformers"
    reference_kernels = True

    def precision(self) -> tuple[str, torch.dtype]:
        weight = seam.module_of(self.model.lm_head).weight
        return weight.device.type, weight.dtype

    def run(self, prompts: Sequence[Prompt], body: Body, seq_axes: Sequence[tuple[int, ...]]) -> list[list[torch.Tensor]]:
        tokens, mask = right_padded(self.model.tokenizer, prompts)
        with self.model.trace({"input_ids": tokens, "attention_mask": mask.long()}):
            found: list = nnsight.save([])
            found.extend(body())
        lengths = mask.sum(-1).tolist()
        return [[cut(value, row, length, axes) for value, axes in zip(found, seq_axes)]
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

    def output_projections(self) -> list[torch.Tensor | str]:
        model = self.model
        width = model.num_heads * model.head_dim
        return [module if isinstance(module, str) else output_projection(module, width)
                for module in attention_modules(model, model.num_layers)]

    def down_projections(self) -> list[torch.Tensor | str]:
        return down_projections(self.model, self.model.num_layers)
