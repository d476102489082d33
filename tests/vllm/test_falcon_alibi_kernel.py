"""Falcon-RW (ALiBi) on vLLM's GPU build: the attention kernel the engine is started with.

The GPU itself is not needed: the choice asks vLLM's platform, which these
tests set; the GPU matrix (tests/GPU.md) shows the kernel's values.
"""

from types import SimpleNamespace

import pytest

from streamscope.vllm.families import falcon

ALIBI = SimpleNamespace(alibi=True)


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(falcon.current_platform, "is_cuda", lambda: True)


def test_alibi_on_a_gpu_runs_tritons_kernel(gpu):
    assert falcon.alibi_kernel(ALIBI, {}) == {"attention_backend": "TRITON_ATTN"}
    assert falcon.SPEC.checkpoint_defaults is falcon.alibi_kernel


@pytest.mark.parametrize("asked", [{"attention_backend": "FLASHINFER"}, {"attention_config": {"backend": "FLEX_ATTENTION"}}])
def test_the_callers_kernel_is_kept(gpu, asked):
    assert falcon.alibi_kernel(ALIBI, asked) == {}


def test_rotary_falcon_and_the_cpu_keep_vllms_choice(gpu, monkeypatch):
    assert falcon.alibi_kernel(SimpleNamespace(alibi=False), {}) == {}
    monkeypatch.setattr(falcon.current_platform, "is_cuda", lambda: False)
    assert falcon.alibi_kernel(ALIBI, {}) == {}


def test_the_engine_starts_with_the_kernel_under_the_callers_settings(gpu, checkpoints):
    """What `streamscope.load` hands vLLM for a Falcon-RW checkpoint: the family's kernel, the caller's over it."""
    from streamscope.vllm import families
    from streamscope.vllm.model import StandardizedVLLM

    path = checkpoints("falcon", alibi=True, bias=True, new_decoder_architecture=False, multi_query=False,
                       parallel_attn=False, num_kv_heads=2)
    engine = object.__new__(StandardizedVLLM)  # the settings only: nothing starts
    settings = engine._take_family(path, None, families, {"dtype": "bfloat16"}, {})
    assert settings["attention_backend"] == "TRITON_ATTN" and settings["dtype"] == "bfloat16"
    asked = {"attention_backend": "FLEX_ATTENTION"}
    assert engine._take_family(path, None, families, dict(asked), {})["attention_backend"] == "FLEX_ATTENTION"
