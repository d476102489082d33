"""Editing the stream at every generated token in a trace: streamscope on vLLM against raw nnsight, in one run.

Builds a random-weight Llama checkpoint, starts one vLLM engine on it (the CPU
worker here, the GPU one where there is a GPU), then times, interleaved round
by round, the same prompts generating the same number of tokens (greedy), one
invoke per prompt:

  bare       vLLM generating, no trace
  empty      a trace whose invokes step through every token and do nothing (nnsight's own cost)
  raw        raw nnsight: a vector added to block `--block`'s output at every step (vLLM's block
             returns (hidden, residual); adding to the hidden half adds to their sum)
  ss         streamscope: the same vector added to that block's layer_output at every step

Both edits are first shown to give the same logits at every step. It prints
the times and the cost over bare of each invoke at each step, and the ratio
streamscope / raw nnsight.

    python benchmarks/vllm_trace_edits.py              # 32 prompts x 16 tokens, 4 x 512 Llama
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


def prompts_of(count: int, length: int, vocabulary: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids (seeded)."""
    generator = torch.Generator().manual_seed(0)
    return [[0] + torch.randint(3, vocabulary, (length - 1,), generator=generator).tolist() for _ in range(count)]


def traced(model, prompts: list, tokens: int, edit, keep_logits: bool = False) -> list:
    """One trace, an invoke per prompt, `edit(model)` at each of `tokens` steps; the logits per step if kept."""
    with model.trace(temperature=0.0, max_tokens=tokens, ignore_eos=True) as tracer:
        logits = list().save()
        for prompt in prompts:
            with tracer.invoke({"prompt_token_ids": prompt}):
                steps = list()
                for _ in tracer.iter[:tokens]:
                    edit(model)
                    if keep_logits:
                        steps.append(model.logits.clone())
                logits.append(steps)
    return list(logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--block", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="streamscope-bench-")) / "llama"
    build_checkpoint("llama", folder, num_hidden_layers=arguments.layers, hidden_size=arguments.hidden,
                     num_attention_heads=arguments.heads, num_key_value_heads=2,
                     head_dim=arguments.hidden // arguments.heads, intermediate_size=arguments.intermediate,
                     max_position_embeddings=4 * (arguments.length + arguments.tokens), initializer_range=0.02)
    model = streamscope.load(folder, engine="vllm", max_model_len=2 * (arguments.length + arguments.tokens),
                             max_num_seqs=arguments.prompts)
    prompts = prompts_of(arguments.prompts, arguments.length, model.vocab_size)
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1))
    block = arguments.block

    def nothing(model) -> None:
        pass

    def raw(model) -> None:
        hidden = model.model.layers[block].output[0]
        hidden[:] += vector.to(device=hidden.device, dtype=hidden.dtype)

    def ours(model) -> None:
        stream = model.layers[block].layer_output
        stream[:] += vector.to(device=stream.device, dtype=stream.dtype)

    # The two edits are the same edit: the logits agree at every step before anything is timed.
    raw_logits = traced(model, prompts[:2], arguments.tokens, raw, keep_logits=True)
    our_logits = traced(model, prompts[:2], arguments.tokens, ours, keep_logits=True)
    plain = traced(model, prompts[:1], arguments.tokens, nothing, keep_logits=True)
    difference = max(((r - o).norm() / r.norm()).item()
                     for rs, os_ in zip(raw_logits, our_logits) for r, o in zip(rs, os_))
    moved = ((plain[0][-1] - our_logits[0][-1]).norm() / plain[0][-1].norm()).item()
    print(f"streamscope's edit vs raw nnsight's, largest relative difference in the logits over "
          f"{arguments.tokens} steps: {difference:.2e} (the edit itself moves the last logits by {moved:.2e})")
    assert difference < 1e-4 < moved, "the two edits differ: the timings below would compare different work"

    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=arguments.tokens, ignore_eos=True)
    variants = {
        "bare": lambda: model.vllm_entrypoint.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                       use_tqdm=False),
        "empty": lambda: traced(model, prompts, arguments.tokens, nothing),
        "raw": lambda: traced(model, prompts, arguments.tokens, raw),
        "ss": lambda: traced(model, prompts, arguments.tokens, ours),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():
        run()  # warm up
    for _ in range(arguments.rounds):
        for name, run in variants.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{platform.machine()} CPU"
    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, vllm {__import__('vllm').__version__}, "
          f"nnsight {__import__('nnsight').__version__}; Llama {arguments.layers} x {arguments.hidden}, "
          f"{arguments.prompts} prompts of {arguments.length} tokens x {arguments.tokens} generated, block "
          f"{block}; median of {arguments.rounds} rounds")
    median = {name: statistics.median(values) for name, values in times.items()}
    steps = arguments.prompts * arguments.tokens
    for name, seconds in median.items():
        over = (seconds - median["bare"]) / steps * 1e3
        print(f"  {name:<6} {seconds:8.3f} s   {over:6.3f} ms per invoke and step over bare")
    paired = [ours / raw for ours, raw in zip(times["ss"], times["raw"])]
    raw_edit, ours_edit = median["raw"] - median["empty"], median["ss"] - median["empty"]
    # Raw nnsight's edit can cost less than the noise between two runs: then no ratio of the two edits is printed.
    over_empty = f"{ours_edit / raw_edit:.2f}x raw's cost of the edit" if raw_edit > 0.05 * median["empty"] else \
        "raw's edit is within the noise of the empty trace here, so no ratio of the edits"
    print(f"\n  streamscope / raw nnsight: {statistics.median(paired):.3f} per round (wall time); over the empty "
          f"trace, {over_empty}")
    model.close()


if __name__ == "__main__":
    main()
