"""Tiny random checkpoints of every family, built and saved locally.

Each checkpoint is a real `save_pretrained` folder (config, float32 safetensors
and a tokenizer trained here), so it loads by path on every engine with no hub
access. The sizes keep a forward pass in milliseconds while meeting what the
kernels ask for: head_dim >= 32 (vLLM's CPU attention), grouped-query attention
where the family has it, and norm weights and biases moved away from their
initial values so that a value read before or after a norm, or with a weight
skipped, cannot pass for the right one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..families import MODEL_TYPES
from .tokenizer import save_tokenizer

VOCAB_SIZE = 512
SPECIAL_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}

# The sizes every family shares, in the names most configs use.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    **SPECIAL_IDS,
}

# What each family changes or adds; `None` drops a common key the config does not take.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 4},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "decoder_sparse_step": 1, "mlp_only_layers": [0]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    # Tied, as every Gemma checkpoint is: vLLM 0.22's Gemma asserts it.
    "gemma": {"tie_word_embeddings": True},
    # Tied, as every Gemma 2 checkpoint is: vLLM's Gemma 2 has no lm_head and unembeds with embed_tokens.
    "gemma2": {"sliding_window": 4, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "query_pre_attn_scalar": 32, "tie_word_embeddings": True},
    "gemma3_text": {"sliding_window": 4, "query_pre_attn_scalar": 32,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "phi3": {"pad_token_id": 2},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0,
                "attention_multiplier": 0.2},
    "olmo2": {},
    # Tied, as Command R checkpoints are: vLLM's Cohere always unembeds with embed_tokens.
    "cohere": {"logit_scale": 0.5, "use_qk_norm": False, "tie_word_embeddings": True},
    "exaone4": {"sliding_window": 4, "sliding_window_pattern": 2},
    "stablelm": {"partial_rotary_factor": 0.5, "head_dim": None},
    "gpt2": {"n_embd": 64, "n_layer": 3, "n_head": 2, "n_positions": 512, "hidden_size": None,
             "intermediate_size": None, "num_hidden_layers": None, "num_attention_heads": None,
             "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": None},
    "gptj": {"n_embd": 64, "n_layer": 3, "n_head": 2, "n_positions": 512, "rotary_dim": 16,
             "hidden_size": None, "intermediate_size": None, "num_hidden_layers": None,
             "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None,
             "max_position_embeddings": None},
    "gpt_neox": {"rotary_pct": 0.5, "use_parallel_residual": True, "num_key_value_heads": None,
                 "head_dim": None},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64, "do_layer_norm_before": True,
            "intermediate_size": None, "num_key_value_heads": None, "head_dim": None},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 1, "parallel_attn": True,
               "num_key_value_heads": None, "head_dim": None, "intermediate_size": None},
    "llama4_text": {"attention_chunk_size": 128, "interleave_moe_layer_step": 2, "num_local_experts": 4,
                    "num_experts_per_tok": 1, "intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 0],
                    "use_qk_norm": True},
    "mamba": {"state_size": 16, "expand": 2, "conv_kernel": 4, "num_attention_heads": None,
              "num_key_value_heads": None, "head_dim": None, "intermediate_size": None,
              "max_position_embeddings": None},
    # Two value heads per key head in the gated delta net, as in the released checkpoints (16 and 32): with as
    # many value heads as key heads, vLLM 0.22's GPU kernels read the gating vectors at the wrong places and
    # its decode refuses them (vLLM issue 41112; `streamscope.vllm.families.qwen3_next`).
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention", "linear_attention"],
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                   "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "head_dim": 64,
                   "num_attention_heads": 2, "hidden_size": 128},
}

#: The model types of `streamscope.families.FAMILIES`: each has its entry in FAMILY_CONFIGS.
FAMILIES: tuple[str, ...] = MODEL_TYPES


def tiny_config(model_type: str, **overrides: Any):
    """The tiny config of a family (a `model_type` of FAMILY_CONFIGS), with overrides (None sets None)."""
    if model_type not in FAMILY_CONFIGS:
        raise ValueError(f"no tiny config for model type {model_type!r}; known: {', '.join(FAMILIES)}")
    values = {**_COMMON, **FAMILY_CONFIGS[model_type]}
    # None in a family's entry drops a common key; None in an override sets the key to None.
    values = {key: value for key, value in values.items() if value is not None} | overrides
    return AutoConfig.for_model(model_type, **values)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every 1-d parameter (norm weights, biases) off its initial value."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))


def build_checkpoint(model_type: str, path: str | Path, *, seed: int = 0, overwrite: bool = False,
                     **overrides: Any) -> Path:
    """Save a tiny random float32 checkpoint of `model_type` with a tokenizer at `path`.

    The folder loads with `streamscope.load(path)` on either engine. Overrides
    change the config (`num_hidden_layers=4`, `sliding_window=8`, ...).
    """
    path = Path(path)
    if path.exists():
        if not overwrite and (path / "config.json").exists():
            return path
        shutil.rmtree(path)
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model, seed)
    model.save_pretrained(str(path))
    save_tokenizer(path, vocab_size=VOCAB_SIZE)
    return path
