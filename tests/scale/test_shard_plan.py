"""A distributed harvest's default shard size, planned on the driver (`streamscope.scale.planning`): at most
`SHARD_BYTES` of the largest prompt's rows and `SHARD_PROMPTS` prompts, as the in-process harvest bounds its shards.
No Ray here: the harvest itself runs in tests/scale/test_ray_harvest.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from streamscope.bulk import results
from streamscope.scale.planning import engine_dtype, planned_shard_size, positions_a_prompt, prompt_lengths

MIB = 1 << 20
#: A 70B model's shape (Llama-3.1-70B): 8,192 wide, 80 blocks, 64 heads, bfloat16.
SEVENTY_B = LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=28672, dtype="bfloat16")
SIX_BLOCKS = [10, 20, 30, 40, 50, 60]
LONG_PROMPTS = [[1] * 1024, [2] * 512, [3] * 1024]  # token ids: their lengths are exact


def plan(prompts, values=("layer_output",), layers=SIX_BLOCKS, positions="all", engine="vllm", engine_options=None,
         harvest_options=None, config=SEVENTY_B, checkpoint="unused"):
    return planned_shard_size(prompts, checkpoint, config, engine, dict(engine_options or {}), list(values),
                              layers, positions, dict(harvest_options or {}))


def test_a_70b_model_at_every_position_plans_shards_of_at_most_1_gib():
    # 6 blocks x 8,192 x 2 bytes x 1,024 positions = 96 MiB a prompt: 10 prompts (960 MiB), not 1,024 (96 GiB).
    assert 6 * 8192 * 2 * 1024 == 96 * MIB
    assert plan(LONG_PROMPTS) == results.SHARD_BYTES // (96 * MIB) == 10
    # The transformers engine loads float32 unless told: twice the bytes a row.
    assert plan(LONG_PROMPTS, engine="transformers") == results.SHARD_BYTES // (192 * MIB) == 5
    assert plan(LONG_PROMPTS, engine="transformers", engine_options={"dtype": "bfloat16"}) == 10
    # The root values count once, not once a block.
    assert plan(LONG_PROMPTS, values=["layer_output", "token_embeddings"]) == results.SHARD_BYTES // (112 * MIB)


def test_the_last_position_holds_shard_prompts_or_as_many_as_fit(monkeypatch):
    assert plan(LONG_PROMPTS, positions="last") == results.SHARD_PROMPTS  # 96 KiB a prompt: 10,922 would fit
    monkeypatch.setattr(results, "SHARD_BYTES", 1 * MIB)
    assert plan(LONG_PROMPTS, positions="last") == MIB // (6 * 8192 * 2) == 10
    monkeypatch.setattr(results, "SHARD_PROMPTS", 4)
    assert plan(LONG_PROMPTS, positions="last") == 4
    monkeypatch.setattr(results, "SHARD_BYTES", 1)
    assert plan(LONG_PROMPTS) == 1  # a prompt larger than the bound: a shard of its own


def test_positions_count_the_largest_prompts_rows(monkeypatch):
    def never():
        raise AssertionError("the prompts were tokenized for a rule that does not need their lengths")

    assert positions_a_prompt("last", never) == 1 and positions_a_prompt("none", never) == 0
    assert positions_a_prompt([0, -1, 5], never) == 3 and positions_a_prompt(7, never) == 1
    assert positions_a_prompt([[0], [0, 1, 2, 3], [1, 2]], never) == 4  # one list a prompt: the longest
    assert positions_a_prompt("all", lambda: {3, 9, 4}) == 9
    assert positions_a_prompt("all_but_first", lambda: {3, 9, 4}) == 8
    assert positions_a_prompt(slice(-4, None), lambda: {3, 9}) == 4 and positions_a_prompt(slice(2), lambda: {9}) == 2
    with pytest.raises(ValueError, match="positions='every'"):
        positions_a_prompt("every", never)
    # reduce= keeps one row a prompt whatever its positions.
    assert plan(LONG_PROMPTS, harvest_options={"reduce": "mean"}) == results.SHARD_PROMPTS
    monkeypatch.setattr(results, "SHARD_BYTES", 96 * MIB)
    assert plan(LONG_PROMPTS, positions=[[0]] * 2 + [list(range(512))]) == 2  # 48 MiB for the 512-row prompt


def test_wider_rows_are_sized_from_the_config(monkeypatch):
    monkeypatch.setattr(results, "SHARD_BYTES", 1 << 40)  # so the prompt bound alone would not decide it
    monkeypatch.setattr(results, "SHARD_PROMPTS", 1 << 40)
    row = 6 * 2 * 1024  # 6 blocks, bfloat16, 1,024 positions
    assert plan(LONG_PROMPTS, values=["mlp.neurons"]) == (1 << 40) // (row * 28672)
    assert plan(LONG_PROMPTS, values=["self_attn.head_results"]) == (1 << 40) // (row * 64 * 8192)


def test_the_engine_dtype():
    float32 = LlamaConfig(dtype="float32")
    assert engine_dtype(float32, "vllm", {}) == torch.float32  # vLLM's "auto": the checkpoint's own
    assert engine_dtype(float32, "vllm", {"dtype": "auto"}) == torch.float32
    assert engine_dtype(float32, "vllm", {"dtype": "half"}) == torch.float16
    assert engine_dtype(float32, "vllm", {"dtype": torch.bfloat16}) == torch.bfloat16
    assert engine_dtype(float32, "transformers", {"torch_dtype": "float16"}) == torch.float16
    assert engine_dtype(SEVENTY_B, "transformers", {}) == torch.float32  # its load's default
    assert engine_dtype(LlamaConfig(), "vllm", {}) == torch.bfloat16  # the config names none


def test_text_prompts_are_tokenized_as_the_engine_tokenizes_them(checkpoints, monkeypatch):
    path = str(checkpoints("llama"))
    texts = ["The Eiffel Tower is in Paris", "A quick brown fox", "one two three four five six seven"]
    ids = [AutoTokenizer.from_pretrained(path)(text)["input_ids"] for text in texts]
    monkeypatch.setattr("streamscope.scale.planning.TOKENIZE_BATCH", 2)  # more than one batch
    assert prompt_lengths(texts + [[5, 6]], path) == {len(tokens) for tokens in ids} | {2}

    config = AutoConfig.from_pretrained(path)
    # Computed apart from the planner: 2 values x 2 blocks + the root's embeddings, float32 (the transformers
    # engine's), the longest prompt's every position.
    prompt_bytes = (2 * 2 + 1) * config.hidden_size * 4 * max(len(tokens) for tokens in ids)
    monkeypatch.setattr(results, "SHARD_BYTES", 2 * prompt_bytes + 100)
    arguments = {"values": ["layer_output", "mlp_output", "token_embeddings"], "layers": [0, 1],
                 "engine": "transformers", "config": config, "checkpoint": path}
    assert plan(texts, **arguments) == plan(ids, **arguments) == 2
