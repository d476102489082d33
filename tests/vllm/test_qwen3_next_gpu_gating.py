"""Qwen3-Next on vLLM's GPU build: the load-time warning for checkpoints whose gating vLLM 0.22 misreads.

The GPU itself is not needed: the check asks vLLM's platform and version, which
these tests set, and reads the checkpoint's config (a stand-in here).
"""

from types import SimpleNamespace

import pytest

from streamscope.vllm.families import qwen3_next


def _model(key_heads: int, value_heads: int) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(linear_num_key_heads=key_heads, linear_num_value_heads=value_heads))


@pytest.fixture
def gpu_vllm_022(monkeypatch):
    monkeypatch.setattr(qwen3_next.current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(qwen3_next, "_vllm_version", lambda: (0, 22))


def test_equal_key_and_value_heads_on_vllm_022_gpus_warn_with_the_way_out(gpu_vllm_022):
    with pytest.warns(RuntimeWarning, match=r"as many linear-attention value heads as key heads \(2\).*issue 41112"
                                            r".*vLLM >= 0\.32.*engine='transformers'"):
        qwen3_next.warn_on_gpus(_model(2, 2))


@pytest.mark.filterwarnings("error")
def test_two_value_heads_per_key_head_load_silently(gpu_vllm_022):
    qwen3_next.warn_on_gpus(_model(2, 4))


@pytest.mark.filterwarnings("error")
def test_a_fixed_vllm_or_a_cpu_loads_silently(monkeypatch, gpu_vllm_022):
    monkeypatch.setattr(qwen3_next, "_vllm_version", lambda: (0, 32))
    qwen3_next.warn_on_gpus(_model(2, 2))
    monkeypatch.setattr(qwen3_next, "_vllm_version", lambda: (0, 22))
    monkeypatch.setattr(qwen3_next.current_platform, "is_cuda", lambda: False)
    qwen3_next.warn_on_gpus(_model(2, 2))


def test_the_suites_tiny_checkpoint_has_two_value_heads_per_key_head():
    from streamscope.testing.checkpoints import FAMILY_CONFIGS

    config = FAMILY_CONFIGS["qwen3_next"]
    assert config["linear_num_value_heads"] == 2 * config["linear_num_key_heads"]
