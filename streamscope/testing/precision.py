"""How far a correct engine's values may be from the float32 reference: stated, or measured on the checkpoint.

This is the reference's side, as `streamscope.testing.oracle` is: nothing here
imports streamscope's serving code. Used by `streamscope check` and by the test
suite (tests/precision.py).

- An engine that runs float32 on a CPU computes what the reference computes,
  in another order at most: its tolerance is a stated number (float32
  rounding, about 1e-6 measured, with room).
- Anywhere else, the engine rounds on purpose: bfloat16 or float16 weights and
  activations, or, for vLLM in float32 on a GPU, TF32 dot products (its Triton
  kernels; 0.5-2e-3 relative seen on an H200). Its tolerance is then
  `MEASURED_FACTOR` times the distance that transformers' own forward at the
  same precision keeps from its float32 forward, on the same checkpoint and
  prompt: the engine's kernels round differently again (other reduction
  orders, fused ops), by about as much.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

#: A measured tolerance is this many times transformers' own distance at the engine's precision.
MEASURED_FACTOR = 2.0


def truncated_to_tf32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (float32) with its mantissa cut to TF32's 10 bits, toward zero: what a tensor core does with
    the low 13 bits of a float32 operand that no one rounded first."""
    return (tensor.contiguous().view(torch.int32) & ~((1 << 13) - 1)).view(torch.float32)


def experts_in_truncated_tf32(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts forward (concatenated gate and up projections, no bias) whose two matmuls take
    their operands truncated to TF32 and sum in float32: how vLLM's fused MoE Triton kernel computes a float32
    mixture of experts on a GPU (Triton's `tl.dot` hands float32 operands to the tensor cores as they are).

    Measured on the H200 (tests/GPU.md, run F): vLLM 0.22's `fused_experts` against this rounding, 7e-7 to 9e-5
    relative; against float64, 2.1-2.3e-3, where cuBLAS's TF32 (rounded to nearest) keeps 3.7-6.9e-4.
    """
    assert not (experts.has_bias or experts.is_transposed) and experts.is_concatenated, type(experts).__name__
    output = torch.zeros_like(hidden_states)
    for expert in range(experts.num_experts):
        token, position = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate_up = truncated_to_tf32(hidden_states[token]) @ truncated_to_tf32(experts.gate_up_proj[expert]).T
        inner = truncated_to_tf32(experts._apply_gate(gate_up))
        added = (inner @ truncated_to_tf32(experts.down_proj[expert]).T) * top_k_weights[token, position, None]
        output.index_add_(0, token, added.to(output.dtype))
    return output


#: transformers' name for the experts forward above (``experts_implementation=``).
TRUNCATED_TF32 = "truncated_tf32"
ALL_EXPERTS_FUNCTIONS.register(TRUNCATED_TF32, experts_in_truncated_tf32)
#: Families whose float32 GPU tolerance on vLLM is measured with that forward. Not Llama 4: its transformers
#: experts are one batched matmul, with no implementation to choose (cuBLAS's TF32 measures it, and it passed so
#: on the H200), nor Qwen3-Next, which runs bfloat16 only.
TRUNCATED_TF32_FAMILIES = ("mixtral", "qwen3_moe")


@dataclass(frozen=True)
class Measuring:
    """The transformers forward whose distance from the float32 reference measures an engine's tolerance."""

    dtype: torch.dtype
    tf32: bool = False  # matmuls in TF32 (cuBLAS, rounded to nearest)
    experts: Optional[str] = None  # transformers' experts implementation (None: its default)

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return name + (" with TF32 matmuls" if self.tf32 else "") + (
            " and TF32-truncated experts" if self.experts == TRUNCATED_TF32 else "")


def measuring(device: str, dtype: torch.dtype, family: str, reference_kernels: bool = False) -> Optional[Measuring]:
    """The forward that measures the tolerance of an engine that runs `family` in `dtype` on `device` (a device
    type); None where the tolerance is stated: float32 on a CPU, or float32 anywhere on the reference's own
    kernels (`reference_kernels`: transformers). Elsewhere in float32 (vLLM on a GPU) the dot products are TF32."""
    if dtype == torch.float32 and (device == "cpu" or reference_kernels):
        return None
    if dtype != torch.float32:
        return Measuring(dtype)
    return Measuring(torch.float32, tf32=True,
                     experts=TRUNCATED_TF32 if family in TRUNCATED_TF32_FAMILIES else None)


@contextlib.contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """torch's matmuls (and cuDNN's) in TF32 inside the block when `enabled`, float32 proper otherwise."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
