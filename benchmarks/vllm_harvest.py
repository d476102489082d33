"""Harvesting every block's layer_output over many prompts: streamscope on vLLM against its peers, in one run.

Builds a random-weight Llama checkpoint, starts one vLLM engine on it (the CPU
worker here, the GPU one where there is a GPU) and one transformers model, then
times, interleaved round by round, the same prompts every time:

  vllm-bare     vLLM generating one token per prompt, no trace
  vllm-raw      raw nnsight on that engine: every block's output, (hidden, residual)
                summed and stacked per prompt, one invoke per prompt
  vllm-ss       streamscope on that engine: every block's layer_output, stacked per prompt
  hf-ss         streamscope on transformers: the same values, the prompts batched together

It prints tokens per second (prompt tokens harvested per second) and the
ratios; the bound is streamscope at most 5% over raw nnsight on vLLM.

    python benchmarks/vllm_harvest.py                  # 64 prompts x 128 tokens, 4 x 512 Llama
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import streamscope  # noqa: E402
from streamscope.testing import build_checkpoint  # noqa: E402


def prompts_of(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids."""
    generator = torch.Generator().manual_seed(0)
    vocabulary = len(tokenizer)
    return [[tokenizer.bos_token_id] + torch.randint(3, vocabulary, (length - 1,), generator=generator).tolist()
            for _ in range(count)]


def harvest_streamscope(model, prompts):
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in prompts:
            with tracer.invoke({"prompt_token_ids": prompt}):
                stacked = torch.stack([layer.layer_output for layer in model.layers]).save()
    return stacked


def harvest_raw(model, prompts):
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in prompts:
            with tracer.invoke({"prompt_token_ids": prompt}):
                stacked = torch.stack([sum(layer.output) for layer in model.model.layers]).save()
    return stacked


def harvest_transformers(model, prompts, batch: int):
    outputs = []
    for start in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[start:start + batch])
        with model.trace(ids):
            stacked = torch.stack([layer.layer_output for layer in model.layers]).save()
        outputs.append(stacked)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hf-batch", type=int, default=16)
    arguments = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="streamscope-bench-")) / "llama"
    build_checkpoint("llama", folder, num_hidden_layers=arguments.layers, hidden_size=arguments.hidden,
                     num_attention_heads=arguments.heads, num_key_value_heads=arguments.kv_heads,
                     head_dim=arguments.hidden // arguments.heads, intermediate_size=arguments.intermediate,
                     max_position_embeddings=4 * arguments.tokens, initializer_range=0.02)
    model = streamscope.load(folder, engine="vllm", max_model_len=2 * arguments.tokens,
                             max_num_seqs=arguments.prompts, max_num_batched_tokens=arguments.prompts * arguments.tokens)
    transformers_model = streamscope.load(folder)
    prompts = prompts_of(transformers_model.tokenizer, arguments.prompts, arguments.tokens)

    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    variants = {
        "vllm-bare": lambda: model.vllm_entrypoint.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                            use_tqdm=False),
        "vllm-raw": lambda: harvest_raw(model, prompts),
        "vllm-ss": lambda: harvest_streamscope(model, prompts),
        "hf-ss": lambda: harvest_transformers(transformers_model, prompts, arguments.hf_batch),
    }
    # The harvests agree before anything is timed.
    raw, ours = harvest_raw(model, prompts), harvest_streamscope(model, prompts)
    assert len(raw) == len(ours) == arguments.prompts
    difference = max((r.squeeze(1) - o.squeeze(1)).abs().max().item() for r, o in zip(raw, ours))
    print(f"streamscope vs raw nnsight on vLLM, largest difference over all values: {difference:.2e}")

    times: dict[str, list[float]] = {name: [] for name in variants}
    for name, run in variants.items():
        run()  # warm up
    for _ in range(arguments.rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)

    tokens = arguments.prompts * arguments.tokens
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"\n{datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}; "
          f"Llama {arguments.layers} x {arguments.hidden}, {arguments.prompts} prompts x {arguments.tokens} tokens, "
          f"median of {arguments.rounds} rounds")
    for name, seconds in median.items():
        low, _, high = statistics.quantiles(times[name], n=4)
        print(f"  {name:<10} {seconds:8.3f} s  (q1-q3 {low:.3f}-{high:.3f})  {tokens / seconds:10.0f} tokens/s")
    # Each round times the two side by side, so the ratio within a round is the steadier figure.
    paired = [ours / raw for ours, raw in zip(times["vllm-ss"], times["vllm-raw"])]
    ratio = statistics.median(paired)
    low, _, high = statistics.quantiles(paired, n=4)
    print(f"\n  streamscope / raw nnsight on vLLM: {ratio:.3f} per round (q1-q3 {low:.3f}-{high:.3f}), "
          f"{median['vllm-ss'] / median['vllm-raw']:.3f} of medians; bound 1.05: "
          f"{'met' if ratio <= 1.05 else 'NOT met'}")
    print(f"  streamscope on vLLM / bare vLLM:   {median['vllm-ss'] / median['vllm-bare']:.3f}")
    print(f"  streamscope on transformers / on vLLM: {median['hf-ss'] / median['vllm-ss']:.3f}")
    model.close()


if __name__ == "__main__":
    main()
