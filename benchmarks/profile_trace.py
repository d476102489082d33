"""Where the time goes in a 16-invoke trace that reads every block's layer_output, against the bulk harvest.

Runs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so one
cProfile sees the client, the engine core and the worker, profiles the trace
and `model.harvest` of the same values on the same prompts, and prints, for
each, the wall time and a table of where it went, grouped:

  greenlet switches   nnsight's workers and the model taking turns (greenlet.switch)
  device syncs        waits for the device (synchronize, .item, .tolist, .cpu, copies to host)
  per-step nnsight    nnsight's per-step bookkeeping in the runner (scope, spans, batcher, collect)
  streamscope values  streamscope's eproperty callbacks (resolve, read, copy, write-back)
  copies              clone / copy_ / cat / stack / contiguous
  (de)serialization   pickling the trace to the worker and the saves back
  forward (model)     vLLM's model forward itself
  other               the rest of vLLM's step (scheduler, sampler, output processing)

A function is counted in the first group whose pattern its name or file
matches (own time, so nothing is counted twice), then the top own-time
functions are listed. ``--torch`` adds torch.profiler's table of device and
host ops for the trace (on a GPU: kernel time against host time).

    python benchmarks/profile_trace.py            # Llama-3-8B shape on a GPU
    python benchmarks/profile_trace.py --tiny     # a tiny shape on this CPU
    python benchmarks/profile_trace.py --tiny --w2  # W2's steer in a trace (an invoke per prompt, every step)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_workloads import build_folder, engine_kwargs, sizes, token_prompts  # noqa: E402

#: (group, patterns matched against "file:function"), first match wins.
GROUPS = [
    ("greenlet switches", ("greenlet", "switch")),
    ("device syncs", ("synchronize", "'item'", "'tolist'", "'cpu'", "_local_scalar_dense", "'wait'")),
    ("streamscope values", ("streamscope/",)),
    ("(de)serialization", ("pickle", "serialization", "msgspec", "msgpack", "dumps", "loads")),
    ("per-step nnsight", ("nnsight/",)),
    ("copies", ("'clone'", "'copy_'", "'cat'", "'stack'", "'contiguous'", "'to'")),
    ("forward (model)", ("vllm/model_executor", "torch/nn/modules", "'linear'", "_C.", "_ops")),
]


def group_of(key: tuple) -> str:
    filename, _, function = key
    text = f"{filename}:'{function}'"
    for group, patterns in GROUPS:
        if any(pattern in text for pattern in patterns):
            return group
    return "other"


def table(profile: cProfile.Profile, wall: float, top: int) -> None:
    stats = pstats.Stats(profile)
    totals: dict[str, list[float]] = {}
    rows = []
    for key, (calls, _, own, cumulative, _) in stats.stats.items():
        group = group_of(key)
        entry = totals.setdefault(group, [0, 0.0])
        entry[0] += calls
        entry[1] += own
        rows.append((own, calls, key))
    print(f"  {'group':<22} {'calls':>10} {'own s':>9} {'% wall':>7}")
    for group, (calls, own) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"  {group:<22} {calls:>10,} {own:9.3f} {100 * own / wall:6.1f}%")
    print(f"  top {top} functions by own time:")
    for own, calls, (filename, line, function) in sorted(rows, reverse=True)[:top]:
        short = filename.split("site-packages/")[-1]
        print(f"    {own:8.3f} s {calls:>9,}  {function}  ({short}:{line})")
    # Where a hook's or an invoke's time goes as a whole (its callees included): streamscope's and nnsight's own.
    ours = [(cumulative, calls, key) for key, (calls, _, _, cumulative, _) in stats.stats.items()
            if "streamscope/" in key[0] or "nnsight/" in key[0]]
    print(f"  top {top} of streamscope's and nnsight's functions by time with their callees:")
    for cumulative, calls, (filename, line, function) in sorted(ours, reverse=True)[:top]:
        short = filename.split("site-packages/")[-1].split("main/")[-1]
        print(f"    {cumulative:8.3f} s {calls:>9,}  {function}  ({short}:{line})")


def profiled(function) -> tuple[cProfile.Profile, float]:
    """One call of `function` under cProfile: the profile and the call's wall time in seconds."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    function()
    profile.disable()
    return profile, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--w2", action="store_true",
                        help="profile W2's steer written in a trace (an invoke per prompt, every step) instead of T")
    parser.add_argument("--prompts", type=int, help="--w2: this many prompts (invokes) instead of the shape's")
    parser.add_argument("--tokens", type=int, help="--w2: this many generated tokens (steps) instead of the shape's")
    parser.add_argument("--torch", action="store_true", help="also torch.profiler's op table for the trace")
    parser.add_argument("--taps", action="store_true",
                        help="--w2: on an engine tapped at the steer's block (CUDA graphs replayed), W2's target")
    args = parser.parse_args()

    import torch
    from vllm.platforms import current_platform

    import streamscope

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    settings = sizes(args.tiny)
    folder = build_folder(Path(tempfile.mkdtemp(prefix="profile-trace-")), args.tiny)
    taps = {"taps": [f"layers.{settings['steer_block']}.layer_output"]} if args.taps else {}
    model = streamscope.load(folder, engine="vllm", **taps, **engine_kwargs(settings, args.tiny))
    prompts = token_prompts(settings["t_prompts"], (settings["t_length"], settings["t_length"]), 3)

    def trace():
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            for prompt in prompts:
                with tracer.invoke({"prompt_token_ids": prompt}):
                    torch.stack([layer.layer_output for layer in model.layers]).save()

    def bulk():
        model.harvest(prompts, "layer_output", positions="all", progress=False)

    def bare():
        from vllm import SamplingParams

        model.vllm_entrypoint.generate([{"prompt_token_ids": p} for p in prompts],
                                       SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

    parts = [("bare generate", bare), (f"trace, {len(prompts)} invokes x every block", trace),
             ("bulk harvest, the same values", bulk)]
    if args.w2:
        from gpu_workloads import FULL, TINY, bare_w2, traced_w2

        prompts = token_prompts(args.prompts or settings["w2_prompts"], settings["w2_lengths"], 2)
        vector = torch.randn((TINY if args.tiny else FULL)["hidden_size"], generator=torch.Generator().manual_seed(0))
        tokens = args.tokens or settings["w2_tokens"]
        trace = traced_w2(model, prompts, tokens, settings["steer_block"], vector)
        parts = [("bare generate (W2)", bare_w2(model.vllm_entrypoint, prompts, tokens)),
                 (f"W2 steer in a trace, {len(prompts)} invokes x {tokens} steps", trace)]
    for name, function in parts:
        function()  # warm-up
        profile, wall = profiled(function)
        print(f"\n{name}: {wall * 1000:.1f} ms under cProfile")
        if os.environ.get("PROFILE_DUMP"):
            profile.dump_stats(f"{os.environ['PROFILE_DUMP']}.{len(name)}")
        table(profile, wall, args.top)

    if args.torch:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with torch_profile(activities=activities) as profiler:
            trace()
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=sort, row_limit=args.top))
    model.close()


if __name__ == "__main__":
    main()
