"""TransformerLens 4.3's ``get_full_resid_decomposition``, post-norm blocks included.

Mixed into `streamscope.workflows.tl.TransformerLensCache`, whose methods (`stack_head_results`,
`stack_neuron_results`, `decompose_resid`, `apply_ln_to_stack`) it composes.

A post-normed sublayer (Gemma 2's sandwich, OLMo 2's post-norm) adds ``w * r / s(r)`` to the stream, where ``r`` is
the sum of its parts (heads' results; neurons' results) and ``s(r) = sqrt(mean(r^2) + eps)``. TransformerLens 4.3
stacks the parts ``r_i`` as they are, which on such a block sum to no stream. streamscope by default passes each part
through the norm frozen at the scale it computed on the whole, ``w * r_i / s(r)`` (what ``apply_ln`` does with a
pre-norm's scale): linear, so the parts sum to what the sublayer adds and the decomposition to the stream.
``through_post_norms=False`` gives TransformerLens's numbers.

The post-norm's weight is not read from the model: it is fitted per channel, by least squares over the cache's
real positions, to ``output = w * r / s(r)``, and the fit is held to the model's own output as `fit_final_norm`
holds the final norm (a sublayer with an output bias, or a norm of another form, does not fit, and is refused with
the reason). ``eps`` is the final norm's (the suite's families state one for every norm).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import Unavailable
from .tl_keys import SliceInput, apply_slice


class FullDecomposition:
    """`get_full_resid_decomposition` and the post-norm fit it needs; state and stacks come from the cache."""

    norm_inputs: dict[int, dict[str, str]]
    mask: torch.Tensor
    num_layers: int

    # Supplied by `TransformerLensCache` and `streamscope.Cache`.
    def __getitem__(self, key: Any) -> torch.Tensor:
        raise NotImplementedError

    _layer: Any
    _projection: Any
    _neuron_part: Any
    _down_width: Any
    norm_form: Any
    head_results: Any
    neuron_weights: Any
    stack_head_results: Any
    decompose_resid: Any
    apply_ln_to_stack: Any
    norm_scale: Any

    def get_full_resid_decomposition(self, layer: Optional[int] = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False,
                                     pos_slice: SliceInput = None, return_labels: bool = False,
                                     project_output_onto: Optional[torch.Tensor] = None,
                                     through_post_norms: bool = True) -> Any:
        """The stream entering block `layer` as every head's result, every neuron's result (each MLP's output
        with ``expand_neurons=False``), ``embed``, ``pos_embed`` and ``bias``, as TL 4.3: ``[components, batch,
        pos, hidden]`` (or the projection's width), labels ``L{i}H{h}``, ``L{i}N{n}`` (or ``{i}_mlp_out``),
        ``embed``, ``pos_embed``, ``bias``. They sum to the stream.

        ``bias`` is what each attention adds beyond its heads' results and, with the neurons expanded, what each
        MLP adds beyond its neurons' (the projections' biases: TL's ``accumulated_bias``). `apply_ln` divides
        every component by the frozen scale of the norm that reads the stream (`apply_ln_to_stack`).
        `project_output_onto` (``[hidden]`` or ``[hidden, k]``) projects every component (after the norm), the
        last axis then dropped or ``k``, as TL 4.3: the neurons are projected through their down projection's
        rows before they are multiplied out (`stack_neuron_results`), so the ``[neurons, batch, pos, hidden]``
        stack is never made.

        On a post-normed sublayer (Gemma 2, OLMo 2) the heads' and neurons' results pass through its norm frozen
        (the module docstring), so they still sum to the stream; `through_post_norms` False gives TL 4.3's
        numbers there, the results before the norm (which do not sum to the stream), and no bias from these
        sublayers (the fit has checked they have none). A post-norm that does not fit raises `Unavailable`.
        """
        end = self._layer(layer)
        projection = None if project_output_onto is None else self._projection(project_output_onto)
        attention_blocks = range(end + (1 if mlp_input else 0))
        posts = {(index, role): self._post_norm(index, role, pos_slice)
                 for index in range(min(end + 1, self.num_layers)) for role in ("attention", "mlp")
                 if f"{role}_post_norm" in self.norm_inputs.get(index, {})
                 and (index in attention_blocks if role == "attention" else index < end)}

        def finished(stack: torch.Tensor) -> torch.Tensor:  # the norm, then the projection, of whole-width parts
            if apply_ln:
                stack = self.apply_ln_to_stack(stack, end, mlp_input, pos_slice)
            return stack if projection is None else stack @ projection.to(stack)

        heads, labels = self.stack_head_results(end + (1 if mlp_input else 0), return_labels=True,
                                                pos_slice=pos_slice)
        if through_post_norms and any(role == "attention" for _, role in posts):
            heads = self._heads_through_post_norms(heads, posts)
        parts = [finished(heads)]
        if end > 0 and expand_neurons:
            neurons, neuron_labels = self._neurons(end, mlp_input, apply_ln, pos_slice, projection,
                                                   posts if through_post_norms else {})
            parts.append(neurons.to(parts[0].dtype) if projection is not None else finished(neurons.to(heads.dtype)))
            labels = labels + neuron_labels
        elif end > 0:
            mlps, mlp_labels = self.decompose_resid(end, mlp_input=mlp_input, mode="mlp", incl_embeds=False,
                                                   pos_slice=pos_slice, return_labels=True)
            parts.append(finished(mlps))
            labels = labels + mlp_labels
        embeds, embed_labels = self.decompose_resid(0, pos_slice=pos_slice, return_labels=True)
        parts.append(finished(embeds))
        labels = labels + embed_labels
        bias = self._bias_part(end, mlp_input, expand_neurons, pos_slice, embeds[0], posts, through_post_norms)
        parts.append(finished(bias[None]))
        labels.append("bias")
        stack = torch.cat(parts)
        if project_output_onto is not None and project_output_onto.dim() == 1:
            stack = stack.squeeze(-1)
        return (stack, labels) if return_labels else stack

    def _heads_through_post_norms(self, heads: torch.Tensor, posts: dict) -> torch.Tensor:
        """`heads` ``[blocks * heads, ...]`` with each post-normed block's rows through its frozen norm."""
        rows = list(heads.split(self.head_results(0).shape[-2]))
        for (index, role), (weight, scale) in posts.items():
            if role == "attention" and index < len(rows):
                rows[index] = rows[index] * weight.to(heads) / scale.to(heads)
        return torch.cat(rows)

    def _neurons(self, end: int, mlp_input: bool, apply_ln: bool, pos_slice: SliceInput,
                 projection: Optional[torch.Tensor], posts: dict) -> tuple[torch.Tensor, list[str]]:
        """Every neuron's result before block `end` (`stack_neuron_results`' stack; projected and normed there
        when `projection` is given), each post-normed MLP's through its frozen norm, and the labels."""
        scale = None
        if apply_ln and projection is not None:
            scale = apply_slice(self.norm_scale(end, mlp_input), pos_slice, -2)
        parts, labels = [], []
        for index in range(end):
            parts.append(self._neuron_part(index, None, pos_slice, projection, apply_ln and projection is not None,
                                           scale, posts.get((index, "mlp"))))
            labels += [f"L{index}N{neuron}" for neuron in range(self._down_width(index))]
        return torch.cat(parts), labels

    def _bias_part(self, end: int, mlp_input: bool, expand_neurons: bool, pos_slice: SliceInput,
                   like: torch.Tensor, posts: dict, through_post_norms: bool) -> torch.Tensor:
        """``[batch, pos, hidden]``: what each attention before block `end` adds beyond its heads' results (its
        output projection's bias, at every position) and, with the neurons expanded, what each MLP adds beyond
        its neurons' results (its down projection's); a post-normed sublayer's, beyond its parts through the
        frozen norm (nothing, less rounding: the fit found no bias), or nothing at all for TL's numbers."""
        bias = torch.zeros_like(like)
        for index in range(end + (1 if mlp_input else 0)):
            post = posts.get((index, "attention"))
            if post is not None and not through_post_norms:
                continue
            summed = apply_slice(self.head_results(index), pos_slice, -3).sum(-2)
            if post is not None:
                summed = summed * post[0].to(summed) / post[1].to(summed)
            bias = bias + apply_slice(self[f"layers.{index}.attention_output"], pos_slice, -2) - summed
        if expand_neurons:
            for index in range(end):
                post = posts.get((index, "mlp"))
                if post is not None and not through_post_norms:
                    continue
                acts = apply_slice(self[f"blocks.{index}.mlp.hook_post"], pos_slice, -2)
                weights = self.neuron_weights(index).to(acts.device)
                summed = acts.to(weights.dtype) @ weights
                if post is not None:
                    summed = summed * post[0].to(summed) / post[1].to(summed)
                bias = bias + apply_slice(self[f"blocks.{index}.hook_mlp_out"], pos_slice, -2) - summed
        return bias

    def _post_norm(self, index: int, role: str, pos_slice: SliceInput) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight [hidden], scale [batch, pos, 1])`` of block `index`'s `role` ("attention" or "mlp") post-norm,
        the scale computed on the sum of the sublayer's parts and sliced by `pos_slice`: fitted (module docstring),
        or `Unavailable` with the reason where the sublayer's output is not that norm of its parts' sum."""
        if role == "attention":
            summed = self.head_results(index).sum(-2)
            output = self[f"layers.{index}.attention_output"]
        else:
            acts = self[f"blocks.{index}.mlp.hook_post"]
            weights = self.neuron_weights(index).to(acts.device)
            summed = acts.to(weights.dtype) @ weights
            output = self[f"layers.{index}.mlp_output"]
        form = self.norm_form
        where = f"blocks.{index}"
        if form.centred:
            raise Unavailable("get_full_resid_decomposition", where, f"its {role}'s post-norm is taken to have the "
                              f"final norm's form, a layer norm, whose centring streamscope does not fit: pass "
                              f"expand_neurons=False and read the heads with stack_head_results")
        scale = form.scale(summed)
        normed = summed.float() / scale
        real = self.mask.reshape(-1).bool() if self.mask.numel() * normed.shape[-1] == normed.numel() else \
            torch.ones(normed[..., 0].numel(), dtype=torch.bool)
        x, y = normed.reshape(-1, normed.shape[-1])[real.to(normed.device)], \
            output.float().reshape(-1, normed.shape[-1])[real.to(normed.device)]
        weight = (x * y).sum(0) / (x * x).sum(0).clamp_min(torch.finfo(torch.float32).tiny)
        error = ((x * weight - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
        # The output is rounded to the model's dtype and the parts' sum is taken in another order than the
        # kernel's: float32 gives ~1e-6 here, a missing bias or another norm ~1e-1.
        bound = max(1e-4, 2 * torch.finfo(output.dtype).eps)
        if error > bound:
            raise Unavailable("get_full_resid_decomposition", where, f"its {role}'s output is not weight * x / "
                              f"rms(x) of its parts' sum x (relative error {error:.1e} > {bound:.0e}): an output "
                              f"bias or another norm. Pass expand_neurons=False and read the heads with "
                              f"stack_head_results, or through_post_norms=False for TransformerLens's numbers")
        return weight, apply_slice(scale, pos_slice, -2)
