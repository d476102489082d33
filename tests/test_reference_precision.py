"""The reference side's precision rules (`streamscope.testing.precision`), shared by `streamscope check` and the
GPU suite: which forward measures an engine's tolerance, and the TF32 truncation of vLLM's fused MoE kernel."""

import torch
from transformers import AutoModelForCausalLM

from streamscope.testing import precision


def test_float32_on_a_cpu_or_on_the_references_kernels_is_stated_the_rest_measured():
    assert precision.measuring("cpu", torch.float32, "llama") is None
    assert precision.measuring("cuda", torch.float32, "mixtral", reference_kernels=True) is None
    assert precision.measuring("cpu", torch.bfloat16, "llama") == precision.Measuring(torch.bfloat16)
    assert precision.measuring("cuda", torch.float16, "llama", reference_kernels=True) == \
        precision.Measuring(torch.float16)
    assert precision.measuring("cuda", torch.float32, "llama") == precision.Measuring(torch.float32, tf32=True)
    fused = precision.measuring("cuda", torch.float32, "mixtral")
    assert fused == precision.Measuring(torch.float32, tf32=True, experts=precision.TRUNCATED_TF32)
    assert str(fused) == "float32 with TF32 matmuls and TF32-truncated experts"


def test_each_engine_says_where_and_in_what_it_computes(checkpoints):
    import streamscope

    model = streamscope.load(checkpoints("llama"), dtype="bfloat16")
    assert model.engine.precision() == ("cpu", torch.bfloat16) and model.engine.reference_kernels


def test_truncation_keeps_ten_mantissa_bits_and_cuts_toward_zero():
    values = torch.tensor([1 + 2**-10, 1 + 2**-11, 1 + 2**-10 + 2**-12, -(1 + 2**-11 + 2**-23), 3.0])
    assert precision.truncated_to_tf32(values).tolist() == [1 + 2**-10, 1.0, 1 + 2**-10, -1.0, 3.0]


def test_the_truncated_experts_forward_is_the_default_one_within_tf32_rounding(checkpoints):
    path = checkpoints("mixtral")
    input_ids = torch.tensor([[0, 5, 9, 14, 3, 7, 21, 4]])
    with torch.no_grad():
        exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids).logits
        rounded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                       experts_implementation=precision.TRUNCATED_TF32)(input_ids).logits
    distance = ((rounded - exact).abs().max() / exact.abs().max()).item()
    # TF32 keeps 10 of float32's 23 mantissa bits: each truncated operand is off by up to 2**-10 relative.
    assert 0 < distance < 2**-10 * 8, distance


def test_tf32_matmuls_are_restored_after_the_block():
    before = torch.backends.cuda.matmul.allow_tf32
    with precision.tf32_matmuls(not before):
        assert torch.backends.cuda.matmul.allow_tf32 is (not before)
    assert torch.backends.cuda.matmul.allow_tf32 is before
