"""Issue 8's workloads, side by side in one run: the bulk path against bare vLLM, transformers and the trace.

Builds a Llama-3-8B-shape checkpoint folder holding only its config and a
locally trained tokenizer (no weights: vLLM starts with ``load_format="dummy"``,
random bfloat16 weights; the transformers model is built from the config on
the same device with random init), then times, each ``--rounds`` times
(medians; warm-up first):

  W1  1,024 prompts of 64-1,024 tokens (seeded uniform), random token ids
      bare        vLLM generate(max_tokens=1), same engine, same settings
      last        model.harvest(every block's layer_output, positions="last")  bound <= 1.10x bare
      4-all       model.harvest(4 blocks' layer_output, positions="all") to host memory  bound <= 1.30x bare
      hf-last     streamscope on transformers, same values as `last`, its best batch size (padded)
  W2  256 prompts x 128 sampled tokens (temperature 1, ignore_eos), prompts of 32-256 tokens
      bare        vLLM generate
      steered     model.generate(steer=[Steer("layer_output", 16, v, positions="all")])  bound <= 1.15x bare
      hf-steered  the same steering on streamscope's transformers engine (its tokens/s; bound: vLLM >= 5x)
      traced      the same steering written in a trace: one invoke per prompt, the vector added to the
                  block's layer_output at every step (the per-invoke path, no bound: how far a trace is
                  from the bulk path)
  T   16 prompts x 256 tokens, every block's layer_output at every position
      bare        vLLM generate(max_tokens=1)
      trace       one trace, 16 invokes, every block read per invoke (the per-read path: "before")
      bulk        model.harvest of the same values ("after")
  ceiling         W1 and W2 bare on a second engine with vLLM's own defaults (CUDA graphs, prefix
                  caching, chunked prefill), run first in a child process so the GPU is free for it

  W2g W2 again with CUDA graphs: streamscope's engine started with taps=["layers.16.layer_output"]
      (vLLM's breakable graphs, replayed at every decode step, broken at the tap)
      bare        the same tapped engine's vLLM generate, no streamscope work
      steered     the same steer  bound <= 1.15x bare; >= 5x hf-steered's tokens/s
      traced      W2's trace on the tapped engine (the edit at the tap, in the replayed graph's break)
      graph bare  plain vLLM with the same graph settings and no tap (a child process)

"Bare" is the same engine (eager, no prefix caching, no chunked prefill: the
settings that keep values exact) with no streamscope work. Hooks do not fire
inside a replayed graph, so every streamscope run but W2g's is eager; W2g's
engine replays graphs for its decode steps and runs the steer at its tap, where
vLLM's breakable graph hands control back to Python (see `streamscope.vllm.taps`).

    python benchmarks/gpu_workloads.py              # the H200 run (vLLM 0.22+, CUDA)
    python benchmarks/gpu_workloads.py --tiny       # the same code at a tiny shape on this CPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The engine in this process: a harvest's results (18 GB for W1's every-position part) are handed over
# as they are, not pickled through the engine's RPC socket. Set it to 1 to measure the other way.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: Llama-3-8B's shape.
FULL = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
#: A shape this CPU runs in seconds (head_dim 64 for vLLM's CPU attention).
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "rope_theta": 500000.0, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def sizes(tiny: bool) -> dict:
    if tiny:
        return {"w1_prompts": 32, "w1_lengths": (16, 128), "w2_prompts": 16, "w2_tokens": 8, "w2_lengths": (8, 32),
                "t_prompts": 16, "t_length": 32, "steer_block": 2, "max_model_len": 512, "dtype": "float32",
                "hf_batches": (4, 8), "hf_w2_batches": (8, 16)}
    return {"w1_prompts": 1024, "w1_lengths": (64, 1024), "w2_prompts": 256, "w2_tokens": 128,
            "w2_lengths": (32, 256), "t_prompts": 16, "t_length": 256, "steer_block": 16, "max_model_len": 1536,
            "dtype": "bfloat16", "hf_batches": (8, 16, 32), "hf_w2_batches": (64, 128, 256)}


def build_folder(folder: Path, tiny: bool) -> Path:
    """A checkpoint folder with a config and a tokenizer, and no weights.

    The tokenizer covers the model's whole vocabulary, as a real checkpoint's does: the engine samples ids from
    all of it, and vLLM's detokenizer takes some twenty times as long over an id its tokenizer lacks (until
    2026-12-04 the full shape had a 512-token tokenizer, which put about a second of failed look-ups into each
    of W2's bare generations on the H200, 40% of them: see RESULTS.md of that day).
    """
    from transformers import LlamaConfig

    from streamscope.testing.tokenizer import save_tokenizer, word_tokenizer

    shape = TINY if tiny else FULL
    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config.save_pretrained(str(folder))
    if shape["vocab_size"] <= 512:
        save_tokenizer(folder, vocab_size=shape["vocab_size"])
    else:
        word_tokenizer(shape["vocab_size"]).save_pretrained(str(folder))
    return folder


def token_prompts(count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """`count` prompts of random token ids, lengths uniform in `lengths` (seeded)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    low, high = lengths
    counts = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [[0] + torch.randint(3, 512, (length - 1,), generator=generator).tolist() for length in counts]


def timed(function, rounds: int) -> float:
    """The median wall time of `function` over `rounds` runs, after one warm-up run."""
    return timed_together({"only": function}, rounds)["only"]


def timed_together(functions: dict, rounds: int) -> dict:
    """Median wall times of several functions measured in turn, round by round (one warm-up each first), so that
    a drift of the machine over the run (clocks, memory) falls on all of them alike."""
    import torch

    started = time.perf_counter()
    for name, function in functions.items():
        function()
        _progress(f"warm-up {name}", time.perf_counter() - started)
        started = time.perf_counter()
    times: dict = {name: [] for name in functions}
    for number in range(rounds):
        for name, function in functions.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            function()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            _progress(f"round {number + 1} {name}", times[name][-1])
            gc.collect()
    return {name: statistics.median(values) for name, values in times.items()}


def _progress(what: str, seconds: float) -> None:
    # On stderr as each run ends: a run cut by a device call's limit still shows how far it got, and how fast.
    print(f"  [{time.strftime('%H:%M:%S')}] {what}: {seconds:.3f} s", file=sys.stderr, flush=True)


def host_time(run) -> tuple[int, dict[str, float]]:
    """Engine steps of one `run` of a bulk generation, and the host seconds spent in streamscope's per-step work.

    Wraps the worker's per-step span bookkeeping and the hooks' edits (the engine runs in this process) with
    wall clocks; the GPU work those calls queue is not waited for, so this is the time they hold the host.
    """
    from streamscope.bulk import apply
    from streamscope.vllm import bulk as bulk_vllm

    spent = {"spans": 0.0, "hooks": 0.0}
    calls = {"spans": 0}
    originals = {(bulk_vllm.WorkerState, "observe"): "spans", (apply.Applier, "_apply_all"): "hooks"}

    def timed_call(original, name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
                calls[name] = calls.get(name, 0) + 1
        return call

    saved = {key: getattr(*key) for key in originals}
    try:
        for (owner, attribute), name in originals.items():
            setattr(owner, attribute, timed_call(saved[(owner, attribute)], name))
        run()
    finally:
        for (owner, attribute), original in saved.items():
            setattr(owner, attribute, original)
    return calls["spans"], spent


def engine_kwargs(settings: dict, tiny: bool) -> dict:
    kwargs = {"load_format": "dummy", "dtype": settings["dtype"], "max_model_len": settings["max_model_len"],
              "seed": 0}
    if not tiny:
        # Room for the transformers model beside the engine; steps of up to 16K tokens for W1's prefills.
        kwargs.update(gpu_memory_utilization=0.55, max_num_batched_tokens=16384)
    return kwargs


def bare_w1(llm, prompts):
    from vllm import SamplingParams

    return lambda: llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)


def bare_w2(llm, prompts, tokens, marked: bool = False):
    """W2's bare generation; `marked`: each request with its own params, marked as a bulk run marks them."""
    from vllm import SamplingParams

    if marked:
        def run():
            params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True,
                                     extra_args={"streamscope_bulk": (-1, index)}) for index in range(len(prompts))]
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return run
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True)
    return lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def traced_w2(model, prompts, tokens, block: int, vector, edit: str = "slice"):
    """W2's steer written in a trace: an invoke per prompt, the vector added to block `block`'s layer_output at
    every step of its generation (`edit`: "slice", ``current[:] += vector``; "inplace", ``current += vector``;
    "none", the value read and not edited)."""
    def run():
        with model.trace(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True) as tracer:
            for prompt in prompts:
                with tracer.invoke({"prompt_token_ids": prompt}):
                    for _ in tracer.iter[:tokens]:
                        current = model.layers[block].layer_output
                        if edit == "slice":
                            current[:] += vector.to(device=current.device, dtype=current.dtype)
                        elif edit == "inplace":
                            current += vector.to(device=current.device, dtype=current.dtype)
    return run


#: The graph settings of a tapped streamscope engine, for plain vLLM (`streamscope.vllm.model._graph_settings`).
GRAPHS = {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}, "enable_prefix_caching": False,
          "enable_chunked_prefill": False}


def ceiling(folder: Path, tiny: bool, rounds: int, mode: str) -> dict:
    """W1 and W2 bare on plain vLLM in a child process: its own defaults ("defaults"), or the graph settings of a
    tapped engine ("graphs": breakable graphs for decode steps, no tap), W2 only. ("tapped": `tapped_w2`.)"""
    from vllm import LLM

    settings = sizes(tiny)
    llm = LLM(str(folder), **engine_kwargs(settings, tiny), **(GRAPHS if mode == "graphs" else {}))
    w2 = token_prompts(settings["w2_prompts"], settings["w2_lengths"], 2)
    times = {"w2": timed(bare_w2(llm, w2, settings["w2_tokens"]), rounds)}
    if mode == "defaults":
        times["w1"] = timed(bare_w1(llm, token_prompts(settings["w1_prompts"], settings["w1_lengths"], 1)), rounds)
    return times


def run_ceiling(folder: Path, tiny: bool, rounds: int, mode: str = "defaults") -> dict | None:
    command = [sys.executable, __file__, "--ceiling", str(folder), "--mode", mode, "--rounds", str(rounds)] + (
        ["--tiny"] if tiny else [])
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # vLLM's default
                   "VLLM_USE_BREAKABLE_CUDAGRAPH": "1" if mode in ("graphs", "tapped") else "0"}
    run = subprocess.run(command, capture_output=True, text=True, env=environment)
    lines = [line for line in run.stdout.splitlines() if line.startswith("CEILING ")]
    if run.returncode != 0 or not lines:
        print("ceiling run failed:\n" + run.stderr[-2000:])
        return None
    return json.loads(lines[-1][len("CEILING "):])


def best_batch(model, prompts, batches, **options) -> tuple[int, float]:
    """The fastest batch size of streamscope's transformers harvest, and its time."""
    best = None
    for batch in batches:
        try:
            seconds = timed(lambda: model.harvest(prompts, batch_size=batch, progress=False, **options), 1)
        except RuntimeError as error:  # out of memory at this batch size
            print(f"  hf batch {batch}: {str(error).splitlines()[0]}")
            continue
        print(f"  hf batch {batch}: {seconds:.2f} s")
        if best is None or seconds < best[1]:
            best = (batch, seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, for a CPU check")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: ceiling,w1,w2,w2g,trace,hf")
    parser.add_argument("--hf-batches", help="comma-separated batch sizes to try for W1 on transformers")
    parser.add_argument("--ceiling", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="defaults", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ceiling:
        times = (tapped_w2(Path(args.ceiling), args.tiny, args.rounds) if args.mode == "tapped"
                 else ceiling(Path(args.ceiling), args.tiny, args.rounds, args.mode))
        print("CEILING " + json.dumps(times))
        return
    skip = set(filter(None, args.skip.split(",")))

    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    settings = sizes(args.tiny)
    if args.hf_batches:
        settings["hf_batches"] = tuple(int(batch) for batch in args.hf_batches.split(","))
    folder = Path(tempfile.mkdtemp(prefix="gpu-workloads-"))
    build_folder(folder, args.tiny)
    import vllm

    import streamscope

    print(f"gpu_workloads.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  "
          f"{'tiny' if args.tiny else 'Llama-3-8B shape'}  {settings['dtype']}  rounds={args.rounds}")
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"device {device_name}; vllm {vllm.__version__}, torch {torch.__version__}, "
          f"nnsight {__import__('nnsight').__version__}, python {platform.python_version()}")

    model = streamscope.load(folder, engine="vllm", **engine_kwargs(settings, args.tiny))
    llm = model.vllm_entrypoint
    rows: list[tuple[str, str, float, str]] = []  # (workload, what, seconds, note)
    layers = model.num_layers
    hf = None
    if "hf" not in skip:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from streamscope.transformers.model import StandardizedTransformers

        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                                      dtype=getattr(torch, settings["dtype"]))
        hf = StandardizedTransformers(module.eval(), tokenizer=AutoTokenizer.from_pretrained(folder))

    if "w1" not in skip:
        prompts = token_prompts(settings["w1_prompts"], settings["w1_lengths"], 1)
        tokens = sum(map(len, prompts))
        four = sorted({0, layers // 3, 2 * layers // 3, layers - 1})
        bare = timed(bare_w1(llm, prompts), args.rounds)
        last = timed(lambda: model.harvest(prompts, "layer_output", positions="last", progress=False), args.rounds)
        every = timed(lambda: model.harvest(prompts, "layer_output", layers=four, positions="all", progress=False),
                      args.rounds)
        rows += [("W1", "vLLM bare generate(max_tokens=1)", bare, f"{tokens / bare:,.0f} prompt tok/s"),
                 ("W1", "harvest: every block, last position", last, f"{last / bare:.3f}x bare (bound 1.10)"),
                 ("W1", f"harvest: blocks {four}, every position", every, f"{every / bare:.3f}x bare (bound 1.30)")]
        if hf is not None:
            print("W1 on transformers, choosing the batch size:")
            best = best_batch(hf, prompts, settings["hf_batches"], values="layer_output", positions="last")
            if best is not None:
                hf_time = timed(lambda: hf.harvest(prompts, "layer_output", positions="last", batch_size=best[0],
                                                   progress=False), args.rounds)
                rows.append(("W1", f"transformers harvest, batch {best[0]}", hf_time,
                             f"vLLM harvest {hf_time / last:.2f}x faster"))
        report(rows)

    if "w2" not in skip:
        prompts = token_prompts(settings["w2_prompts"], settings["w2_lengths"], 2)
        count = settings["w2_tokens"]
        torch.manual_seed(0)
        vector = torch.randn(model.hidden_size)
        steer = streamscope.Steer("layer_output", settings["steer_block"], vector, positions="all")
        generated = len(prompts) * count
        measured = timed_together({
            "bare": bare_w2(llm, prompts, count),
            "steered": lambda: model.generate(prompts, max_tokens=count, steer=[steer], temperature=1.0, seed=0,
                                              ignore_eos=True, progress=False),
            "marked": bare_w2(llm, prompts, count, marked=True),
            "traced": traced_w2(model, prompts, count, settings["steer_block"], vector)}, args.rounds)
        bare, steered, marked, traced = (measured[key] for key in ("bare", "steered", "marked", "traced"))
        rows += [("W2", "vLLM bare generation", bare, f"{generated / bare:,.0f} tok/s"),
                 ("W2", "steered generation", steered,
                  f"{steered / bare:.3f}x bare (bound 1.15), {generated / steered:,.0f} tok/s"),
                 ("W2", "the same steer in a trace, an invoke per prompt", traced,
                  f"{traced / bare:.2f}x bare, {traced / steered:.2f}x steered")]
        rows.append(("W2", "  bare, a SamplingParams per request (as sent)", marked, f"{marked / bare:.3f}x bare"))
        steps, host = host_time(lambda: model.generate(prompts, max_tokens=count, steer=[steer], temperature=1.0,
                                                       seed=0, ignore_eos=True, progress=False))
        if steps:
            rows.append(("W2", f"  of which streamscope's host work, {steps} steps", sum(host.values()),
                         ", ".join(f"{name} {1e3 * seconds / steps:.2f} ms/step" for name, seconds in host.items())
                         + f"; a bare step {1e3 * bare / steps:.1f} ms"))
        if hf is not None:
            best = None
            for batch in settings["hf_w2_batches"]:
                try:
                    hf_time = timed(lambda: hf.generate(prompts, max_tokens=count, steer=[steer], temperature=1.0,
                                                        ignore_eos=True, batch_size=batch, progress=False), 1)
                except torch.cuda.OutOfMemoryError:
                    print(f"W2 on transformers, batch {batch}: out of memory")
                    torch.cuda.empty_cache()
                    continue
                print(f"W2 on transformers, batch {batch}: {hf_time:.3f} s", flush=True)
                if best is None or hf_time < best[1]:
                    best = (batch, hf_time)
            if best is not None:
                batch, hf_time = best
                rows.append(("W2", f"transformers steered generation, best batch {batch}", hf_time,
                             f"{generated / hf_time:,.0f} tok/s; vLLM {hf_time / steered:.1f}x the tokens/s "
                             f"(bound 5)"))
        report(rows)

    if "trace" not in skip:
        prompts = token_prompts(settings["t_prompts"], (settings["t_length"], settings["t_length"]), 3)

        def trace():
            with model.trace(temperature=0.0, max_tokens=1) as tracer:
                for prompt in prompts:
                    with tracer.invoke({"prompt_token_ids": prompt}):
                        # Bound to a name: nnsight ships a vLLM trace's saves back by name, and an unnamed
                        # save travels nowhere (the 2026-11-30 H200 run timed that, 2.46x bare).
                        outputs = torch.stack([layer.layer_output for layer in model.layers]).save()  # noqa: F841

        bare = timed(bare_w1(llm, prompts), args.rounds)
        traced = timed(trace, args.rounds)
        bulk = timed(lambda: model.harvest(prompts, "layer_output", positions="all", progress=False), args.rounds)
        rows += [("T", f"vLLM bare, {len(prompts)} prompts", bare, ""),
                 ("T", f"trace, {len(prompts)} invokes x every block (before)", traced, f"{traced / bare:.2f}x bare"),
                 ("T", "harvest, the same values (after)", bulk, f"{bulk / bare:.2f}x bare, {traced / bulk:.1f}x faster")]

    report(rows)
    model.close()
    hf_w2 = next((seconds for w, what, seconds, _ in rows if w == "W2" and what.startswith("transformers")), None)
    if "w2g" not in skip:
        w2_graphs(folder, settings, args, rows, hf_w2)
    if "ceiling" not in skip:  # last, with this engine closed: the other figures come first
        ceiling_times = run_ceiling(folder, args.tiny, args.rounds)
        if ceiling_times:
            for workload in ("W1", "W2"):
                bare = next((seconds for w, what, seconds, _ in rows if w == workload and "bare" in what), None)
                if bare:
                    rows.append((workload, "vLLM defaults bare (ceiling)", ceiling_times[workload.lower()],
                                 f"{ceiling_times[workload.lower()] / bare:.3f}x exact bare"))
            report(rows)


def tapped_w2(folder: Path, tiny: bool, rounds: int) -> dict:
    """W2 bare and steered, in turn, on a streamscope engine started with a tap at the steer (a child process)."""
    import torch

    import streamscope

    settings = sizes(tiny)
    block = settings["steer_block"]
    tapped = streamscope.load(folder, engine="vllm", taps=[f"layers.{block}.layer_output"],
                              **engine_kwargs(settings, tiny))
    prompts = token_prompts(settings["w2_prompts"], settings["w2_lengths"], 2)
    count = settings["w2_tokens"]
    torch.manual_seed(0)
    vector = torch.randn(tapped.hidden_size)
    steer = streamscope.Steer("layer_output", block, vector, positions="all")
    return timed_together({
        "bare": bare_w2(tapped.vllm_entrypoint, prompts, count),
        "steered": lambda: tapped.generate(prompts, max_tokens=count, steer=[steer], temperature=1.0, seed=0,
                                           ignore_eos=True, progress=False),
        "traced": traced_w2(tapped, prompts, count, block, vector)}, rounds)


def w2_graphs(folder: Path, settings: dict, args: Any, rows: list, hf_time: float | None) -> None:
    """W2 with CUDA graphs: a tapped streamscope engine, then plain vLLM with its graph settings and no tap.

    Each in a child process with vLLM's default engine process (VLLM_ENABLE_V1_MULTIPROCESSING=1), so that
    both schedule the same way.
    """
    generated = settings["w2_prompts"] * settings["w2_tokens"]
    measured = run_ceiling(folder, args.tiny, args.rounds, mode="tapped")
    if measured is None:
        return
    bare, steered = measured["bare"], measured["steered"]
    rows += [("W2g", "tapped engine (graphs), bare generation", bare, f"{generated / bare:,.0f} tok/s"),
             ("W2g", "tapped engine (graphs), steered generation", steered,
              f"{steered / bare:.3f}x bare (bound 1.15), {generated / steered:,.0f} tok/s"),
             ("W2g", "tapped engine (graphs), the steer in a trace", measured["traced"],
              f"{measured['traced'] / bare:.2f}x bare, {measured['traced'] / steered:.2f}x steered")]
    eager_trace = next((seconds for w, what, seconds, _ in rows if w == "W2" and "in a trace" in what), None)
    if eager_trace is not None:
        rows.append(("W2g", "  W2's trace, eager engine in this process", eager_trace,
                     f"the tapped engine's trace takes {measured['traced'] / eager_trace:.2f}x its time"))
    if hf_time is not None:
        rows.append(("W2g", "  against transformers' steered generation (W2)", hf_time,
                     f"vLLM {hf_time / steered:.1f}x the tokens/s (bound 5)"))
    report(rows)
    plain = run_ceiling(folder, args.tiny, args.rounds, mode="graphs")
    if plain:
        rows.append(("W2g", "plain vLLM, the same graph settings, no tap", plain["w2"],
                     f"steered {steered / plain['w2']:.3f}x this bare"))
        report(rows)


def report(rows: list) -> None:
    """The table so far (printed after each part, so that a run cut short still says what it measured)."""
    print()
    print(f"{'':3} {'what':<52} {'seconds':>9}  ratio", flush=True)
    for workload, what, seconds, note in rows:
        print(f"{workload:3} {what:<52} {seconds:9.3f}  {note}", flush=True)


if __name__ == "__main__":
    main()
