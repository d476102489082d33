"""A GGUF file of a tiny Llama checkpoint, written with the `gguf` package as llama.cpp's converter lays it out.

llama.cpp stores each query and key head's rows permuted (pairs interleaved, for its rotary kernel) and names
the tensors its own way; transformers' GGUF reader undoes both. Float32 tensors, the checkpoint's BPE
vocabulary and merges, so a model read back from the file has the checkpoint's weights exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
from safetensors.torch import load_file

#: transformers' Llama parameter names (inside a block) -> llama.cpp's.
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_ROOT = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}


def _permuted(tensor, heads: int):
    """llama.cpp's row order for a query or key projection: each head's two rotary halves interleaved."""
    return tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)


def write_llama_gguf(folder: Path, out: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    specials = {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    tokens = [""] * config["vocab_size"]
    for text, index in {**tokenizer["model"]["vocab"], **specials}.items():
        tokens[index] = text
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if text in specials else gguf.TokenType.NORMAL for text in tokens])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge
                             for merge in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if name in _ROOT:
            target = _ROOT[name]
        else:
            parts = name.split(".")  # model.layers.{i}.{sublayer...}.weight
            inner = ".".join(parts[3:-1])
            target = f"blk.{parts[2]}.{_BLOCK[inner]}.weight"
            if inner == "self_attn.q_proj":
                tensor = _permuted(tensor, heads)
            elif inner == "self_attn.k_proj":
                tensor = _permuted(tensor, kv_heads)
        writer.add_tensor(target, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
