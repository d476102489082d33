"""Issue 24's workloads: the trace on vLLM against bare vLLM, raw nnsight and plain forwards, side by side in one run.

Builds the Llama-3-8B-shape checkpoint folder of `gpu_workloads.py` (config and tokenizer only: vLLM starts with
``load_format="dummy"``, random bfloat16 weights) and times, each ``--rounds`` times after a warm-up, round by
round (medians):

  T     16 prompts x 256 tokens, every block's layer_output read in each invoke (one trace, 16 invokes)
        bare        vLLM generate(max_tokens=1), the same engine, no streamscope work       target: trace <= 3x
        trace       streamscope's trace
        nnsight     raw nnsight 0.8.1's same trace (its own engine, a child process without streamscope's changes:
                    each block's output is (hidden, residual), summed as streamscope's layer_output is)
  W2    256 prompts (32-256 tokens) x 128 sampled tokens (temperature 1, ignore_eos), a streamscope engine started
        with taps=["layers.16.layer_output"] (CUDA graphs for decode steps), in a child process
        bare        that engine's vLLM generate                                             target: trace <= 2x
        trace       the steer written in a trace, an invoke per prompt, the vector added at every step
        placed      the same trace with the vector on the device in the model's dtype beforehand (the trace's
                    `vector.to(device, dtype)` at each step then copies nothing)
        unchecked   `placed` with streamscope's NaN/inf check of each write off: what the check costs
        at once     `placed` with each write-back made on its invoke's worker as it goes, not held to the end of
                    the block's visit to land with the others' (`streamscope.vllm.write_batch`): what holding gains
        steered     the same steer on the bulk path (model.generate(steer=...)), for reference
        peer        raw nnsight 0.8.1's same steer in its trace (its own engine, eager, in a child process; the
                    vector added in place to the block's hidden half), against its own bare generation
  P     streamscope.patch of layer_output over every block and the last 16 positions of a 64-token prompt pair
        patch       the call, on the T engine
        forwards    the same number of plain forwards (blocks x 16 + the two clean runs), one vLLM generate of that
                    many 64-token prompts, max_tokens=1                                      target: patch <= 2x
        traced      (--trace-route) the same patches, one trace invoke each: the route before the bulk path
                    The patch row counts the patches each route ran (bulk requests, trace invokes).

Every engine runs in its process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager unless tapped, no prefix caching,
no chunked prefill: the settings that keep values exact. The trace's transport is reported with each figure
(``handed`` collects, ``pickled`` collects), so a run that fell back to pickling says so.

``--engine-process`` runs instead T with the engine core in a process of its own (vLLM's default,
``VLLM_ENABLE_V1_MULTIPROCESSING=1``, what ``streamscope.load(path, engine="vllm")`` gives on a GPU unless told
otherwise), in a child process, on one engine, round by round:

  X     bare        vLLM generate(max_tokens=1)
        packed      the trace, its saves packed into one buffer per collect (the default there)
        pickled     the trace, its saves pickled one tensor at a time as nnsight does (STREAMSCOPE_SAVES_TRANSPORT=
                    pickle, set in the worker's process through its RPC before each run, as packed sets it back)
        one each    packed, with the trace's invokes pickled one by one as nnsight does (STREAMSCOPE_BUNDLE_INVOKES=0)
                    rather than together, once, and sent to the worker ahead of the requests
        at T's shape, and with --tiny also 16 x 256 tokens (a larger read on the tiny model); the counters of the
        worker's process say which path each ran and how many bytes the packed one carried.

    python benchmarks/gpu_trace.py                 # the H200 run, one command, about 6 minutes
    python benchmarks/gpu_trace.py --tiny          # the same code at a tiny shape on this CPU
    python benchmarks/gpu_trace.py --skip w2       # parts to skip: t,nnsight,w2,w2peer,patch
    python benchmarks/gpu_trace.py --skip t,nnsight,w2 --trace-route   # P alone, with the old route beside it
    python benchmarks/gpu_trace.py --engine-process [--tiny]   # X: packed against pickled, engine in its process
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The engine in this process, except in the --engine-process child, whose engine core runs in a process of its own.
ENGINE_PROCESS = "--child" in sys.argv and "xproc" in sys.argv
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if ENGINE_PROCESS else "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_workloads import (FULL, TINY, bare_w1, bare_w2, build_folder, engine_kwargs, sizes,  # noqa: E402
                           timed_together, token_prompts, traced_w2)

#: The patch workload: a prompt pair of this many tokens, the last `PATCH_POSITIONS` positions patched.
PATCH_TOKENS, PATCH_POSITIONS = 64, 16


def shape(tiny: bool) -> dict:
    settings = sizes(tiny)
    if not tiny:
        settings["gpu_memory_utilization"] = 0.40  # the T engine, and the tapped engine of the child after it
    settings["patch_tokens"] = 24 if tiny else PATCH_TOKENS
    settings["patch_positions"] = 6 if tiny else PATCH_POSITIONS
    return settings


def kwargs_for(settings: dict, tiny: bool) -> dict:
    kwargs = engine_kwargs(settings, tiny)
    if not tiny:
        kwargs["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
    return kwargs


def t_trace(model, prompts):
    """T on streamscope: one trace, an invoke per prompt, every block's layer_output stacked and saved."""
    import torch

    def run():
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            for prompt in prompts:
                with tracer.invoke({"prompt_token_ids": prompt}):
                    blocks = torch.stack([layer.layer_output for layer in model.layers]).save()  # noqa: F841
    return run


def nnsight_engine(folder: Path, settings: dict, tiny: bool):
    """Raw nnsight's VLLM on `folder`, with the settings that keep values exact (eager: nnsight has no taps)."""
    kwargs = {**kwargs_for(settings, tiny), "enforce_eager": True, "enable_prefix_caching": False,
              "enable_chunked_prefill": False}
    if tiny:
        from streamscope.vllm.worker import cpu_vllm  # nnsight's VLLM through the CPU worker (no GPU here)

        return cpu_vllm(str(folder), dispatch=True, **kwargs)
    from nnsight.modeling.vllm import VLLM

    return VLLM(str(folder), dispatch=True, **kwargs)


def raw_nnsight(folder: Path, tiny: bool, rounds: int) -> dict:
    """T on raw nnsight (a child process): its VLLM, its own trace, nnsight's transport."""
    import torch

    settings = shape(tiny)
    model = nnsight_engine(folder, settings, tiny)
    prompts = token_prompts(settings["t_prompts"], (settings["t_length"], settings["t_length"]), 3)
    layers = model.model.layers

    def run():
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            for prompt in prompts:
                with tracer.invoke({"prompt_token_ids": prompt}):
                    # vLLM's Llama block returns (hidden, residual); the stream after the block is their sum.
                    blocks = torch.stack([layer.output[0] + layer.output[1] for layer in layers]).save()  # noqa: F841

    return timed_together({"bare": bare_w1(model.vllm_entrypoint, prompts), "nnsight": run}, rounds)


def tapped_w2(folder: Path, tiny: bool, rounds: int) -> dict:
    """W2 on a tapped streamscope engine (a child process): bare, the steer in a trace, the bulk steer."""
    import torch

    import streamscope
    from streamscope.vllm import trace_transport

    settings = shape(tiny)
    block = settings["steer_block"]
    tapped = streamscope.load(folder, engine="vllm", taps=[f"layers.{block}.layer_output"],
                              **kwargs_for(settings, tiny))
    prompts = token_prompts(settings["w2_prompts"], settings["w2_lengths"], 2)
    count = settings["w2_tokens"]
    torch.manual_seed(0)
    vector = torch.randn(tapped.hidden_size)
    steer = streamscope.Steer("layer_output", block, vector, positions="all")
    # The trace's own vector.to(device, dtype) at every step is a copy from host memory (and a wait for the
    # device) per invoke-step; with the vector on the model's device and in its dtype already it is a no-op.
    placed = vector.to(device="cuda" if torch.cuda.is_available() else "cpu", dtype=getattr(torch, settings["dtype"]))
    before = trace_transport.transport_counts()
    times = timed_together({
        "bare": bare_w2(tapped.vllm_entrypoint, prompts, count),
        "trace": traced_w2(tapped, prompts, count, block, vector),
        "steered": lambda: tapped.generate(prompts, max_tokens=count, steer=[steer], temperature=1.0, seed=0,
                                           ignore_eos=True, progress=False)}, rounds)
    times["transport"] = transport_since(before)
    try:  # the variants after, against bare again: a failure of theirs leaves the figures above standing
        variants = timed_together({
            "bare": bare_w2(tapped.vllm_entrypoint, prompts, count),
            "placed": traced_w2(tapped, prompts, count, block, placed),
            "unchecked": unchecked(traced_w2(tapped, prompts, count, block, placed)),
            "at once": at_once(traced_w2(tapped, prompts, count, block, placed))}, rounds)
        times.update({"variants bare": variants["bare"], "placed": variants["placed"],
                      "unchecked": variants["unchecked"], "at once": variants["at once"]})
    except Exception as error:  # noqa: BLE001 (reported, and the run goes on)
        print(f"the W2 variants failed: {error!r}", file=sys.stderr, flush=True)
    tapped.close()
    return times


def engine_process(folder: Path, tiny: bool, rounds: int) -> dict:
    """X (a child process, the engine core in its own): bare, the T trace packed, pickled, and with its invokes
    pickled one by one."""
    import streamscope
    from streamscope.vllm import trace_transport

    settings = shape(tiny)
    model = streamscope.load(folder, engine="vllm", **kwargs_for(settings, tiny))
    llm = model.vllm_entrypoint

    def worker_counts() -> dict:
        return llm.collective_rpc("streamscope_transport_counts")[0]

    def with_transport(name, trace):
        def run():
            llm.collective_rpc("streamscope_saves_transport", args=(name,))
            trace()
        return run

    def one_each(trace):  # each invoke pickled on its own (nnsight's way), the saves packed
        def run():
            llm.collective_rpc("streamscope_saves_transport", args=(None,))
            os.environ["STREAMSCOPE_BUNDLE_INVOKES"] = "0"
            try:
                trace()
            finally:
                del os.environ["STREAMSCOPE_BUNDLE_INVOKES"]
        return run

    shapes = [(settings["t_prompts"], settings["t_length"])] + ([(16, 256)] if tiny else [])
    measured = []
    for count, length in shapes:
        prompts = token_prompts(count, (length, length), 3)
        trace = t_trace(model, prompts)
        before, read_before = worker_counts(), trace_transport.received_counts()
        times = timed_together({"bare": bare_w1(llm, prompts), "packed": with_transport(None, trace),
                                "pickled": with_transport("pickle", trace), "one each": one_each(trace)}, rounds)
        after, read_after = worker_counts(), trace_transport.received_counts()
        moved = {key: after[key] - before[key] for key in after}
        read = {key: read_after[key] - read_before[key] for key in read_after}
        times.update(prompts=count, tokens=length, counts=moved, read=read, traces=rounds + 1)  # with the warm-up
        measured.append(times)
    model.close()
    return {"rows": measured}


def engine_process_rows(measured: dict, layers: int) -> list:
    rows = []
    for times in measured["rows"]:
        counts, bare = times["counts"], times["bare"]
        # Collects counted include the bare runs' (nnsight's engine collects for every finished request), with no
        # bytes: the bytes are the packed traces'.
        traces, read = times["traces"], times["read"]
        per_trace = counts["bytes_packed"] / traces / 2**20
        what = f"{times['prompts']} x {times['tokens']} tokens, every block's layer_output ({layers} blocks)"
        # The transport's own time per trace: the worker answering the collect, the caller reading it (the bare runs'
        # empty collects, a few per trace, fall on both arms alike).
        packing, pickling = counts["seconds_packing"] / traces * 1e3, counts["seconds_pickling"] / traces * 1e3
        unpacking, unpickling = read["seconds_packed"] / traces * 1e3, read["seconds_pickled"] / traces * 1e3
        rows += [("X", f"vLLM bare, {times['prompts']} prompts x {times['tokens']} tokens", bare, ""),
                 ("X", "trace packed: " + what, times["packed"],
                  f"{times['packed'] / bare:.2f}x bare; pickled / packed {times['pickled'] / times['packed']:.2f}; "
                  f"{per_trace:.1f} MiB a trace; worker {packing:.1f} ms + caller {unpacking:.1f} ms a trace; "
                  f"collects packed {counts['packed']}, pickled {counts['pickled']}"),
                 ("X", "trace pickled: " + what, times["pickled"],
                  f"{times['pickled'] / bare:.2f}x bare; worker {pickling:.1f} ms + caller {unpickling:.1f} ms a "
                  "trace"),
                 ("X", "trace packed, each invoke pickled on its own: " + what, times["one each"],
                  f"{times['one each'] / bare:.2f}x bare; one each / bundled {times['one each'] / times['packed']:.2f}")]
    return rows


def unchecked(run):
    """`run` with streamscope's NaN/inf check of each write off (`values.WARN_NON_FINITE`): the check is two
    reductions on the device per visit of the block (by row, over every invoke's write), read together when an
    invoke ends, so this measures what is left of it."""
    from streamscope import values

    def call():
        values.WARN_NON_FINITE = False
        try:
            run()
        finally:
            values.WARN_NON_FINITE = True
    return call


def at_once(run):
    """`run` with each write-back of the stream made on its invoke's worker as it goes (the path before
    `streamscope.vllm.write_batch`), not held to land with the visit's others."""
    from streamscope.vllm import write_batch

    def call():
        span = write_batch.span
        write_batch.span = lambda hidden, residual: None
        try:
            run()
        finally:
            write_batch.span = span
    return call


def transport_since(before: dict) -> str:
    from streamscope.vllm import trace_transport

    after = trace_transport.transport_counts()
    return f"collects handed {after['handed'] - before['handed']}, pickled {after['pickled'] - before['pickled']}"


def child(part: str, folder: Path, tiny: bool, rounds: int) -> dict | None:
    """Run `part` ("nnsight" or "w2") in a child process, its engine in that process; its times, or None."""
    command = [sys.executable, __file__, "--child", part, "--folder", str(folder), "--rounds", str(rounds)] + (
        ["--tiny"] if tiny else [])
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # The child's log (its engine's, and each timed run as it ends) streams to this process's stderr as it comes.
    run = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=environment)
    lines = [line for line in run.stdout.splitlines() if line.startswith("CHILD ")]
    if run.returncode != 0 or not lines:
        print(f"the {part} run failed (exit {run.returncode}; its log is above)", flush=True)
        return None
    return json.loads(lines[-1][len("CHILD "):])


def raw_nnsight_w2(folder: Path, tiny: bool, rounds: int) -> dict:
    """W2 on raw nnsight (a child process): its VLLM (eager: nnsight has no taps), bare generation and the same
    steer written in its trace, an invoke per prompt, the vector added to the block's hidden half in place (the
    stream is hidden + residual, so the stream moves by the vector, as streamscope's edit of layer_output)."""
    import torch

    settings = shape(tiny)
    model = nnsight_engine(folder, settings, tiny)
    prompts = token_prompts(settings["w2_prompts"], settings["w2_lengths"], 2)
    count, block = settings["w2_tokens"], settings["steer_block"]
    torch.manual_seed(0)
    vector = torch.randn(FULL["hidden_size"] if not tiny else TINY["hidden_size"]).to(
        device="cuda" if torch.cuda.is_available() else "cpu", dtype=getattr(torch, settings["dtype"]))
    layer = model.model.layers[block]

    def run():
        with model.trace(max_tokens=count, temperature=1.0, seed=0, ignore_eos=True) as tracer:
            for prompt in prompts:
                with tracer.invoke({"prompt_token_ids": prompt}):
                    for _ in tracer.iter[:count]:
                        layer.output[0][:] += vector

    return timed_together({"bare": bare_w2(model.vllm_entrypoint, prompts, count), "trace": run}, rounds)


def report(rows: list) -> None:
    print()
    print(f"{'':3} {'what':<58} {'seconds':>9}  ratio", flush=True)
    for workload, what, seconds, note in rows:
        print(f"{workload:3} {what:<58} {seconds:9.3f}  {note}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, for a CPU check")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: t,nnsight,w2,w2peer,patch")
    parser.add_argument("--engine-process", action="store_true",
                        help="only X: the trace with the engine core in its own process, packed against pickled")
    parser.add_argument("--patch-positions", type=int, default=None,
                        help="P: patch this many last positions (default 16; --tiny: 6)")
    parser.add_argument("--trace-route", action="store_true",
                        help="P: time the same patches run as one trace invoke each (the route before the bulk path) "
                             "in the same rounds, for the ratio between the routes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if not args.tiny:
            import torch  # noqa: F401  (CUDA before vLLM in a child, as in gpu_workloads)
        run = {"nnsight": raw_nnsight, "w2": tapped_w2, "w2peer": raw_nnsight_w2, "xproc": engine_process}[args.child]
        times = run(Path(args.folder), args.tiny, args.rounds)
        print("CHILD " + json.dumps(times), flush=True)
        return
    skip = set(filter(None, args.skip.split(",")))
    started = time.perf_counter()

    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    settings = shape(args.tiny)
    if args.patch_positions is not None:
        settings["patch_positions"] = args.patch_positions
    folder = build_folder(Path(tempfile.mkdtemp(prefix="gpu-trace-")), args.tiny)
    import nnsight
    import vllm

    import streamscope
    from streamscope.vllm import trace_transport

    print(f"gpu_trace.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  "
          f"{'tiny' if args.tiny else 'Llama-3-8B shape'}  {settings['dtype']}  rounds={args.rounds}")
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"device {device_name}; vllm {vllm.__version__}, torch {torch.__version__}, nnsight {nnsight.__version__}, "
          f"python {platform.python_version()}", flush=True)
    rows: list = []
    if args.engine_process:
        measured = child("xproc", folder, args.tiny, args.rounds)
        if measured is not None:
            report(engine_process_rows(measured, (TINY if args.tiny else FULL)["num_hidden_layers"]))
        print(f"\nwhole run {time.perf_counter() - started:.0f} s", flush=True)
        return

    # Raw nnsight first, in a child, while no engine of this process holds the GPU.
    peer = None if "nnsight" in skip or "t" in skip else child("nnsight", folder, args.tiny, args.rounds)

    model = streamscope.load(folder, engine="vllm", **kwargs_for(settings, args.tiny))
    llm = model.vllm_entrypoint
    if "t" not in skip:
        prompts = token_prompts(settings["t_prompts"], (settings["t_length"], settings["t_length"]), 3)
        before = trace_transport.transport_counts()
        times = timed_together({"bare": bare_w1(llm, prompts), "trace": t_trace(model, prompts)}, args.rounds)
        bare, traced = times["bare"], times["trace"]
        rows += [("T", f"vLLM bare, {len(prompts)} prompts x {settings['t_length']} tokens", bare, ""),
                 ("T", f"trace, {len(prompts)} invokes x every block's layer_output", traced,
                  f"{traced / bare:.2f}x bare (target 3); {transport_since(before)}")]
        if peer is not None:
            rows += [("T", "raw nnsight, the same trace (its own engine)", peer["nnsight"],
                      f"{peer['nnsight'] / peer['bare']:.2f}x its bare ({peer['bare']:.3f} s); "
                      f"streamscope {peer['nnsight'] / traced:.1f}x faster")]
        report(rows)

    if "patch" not in skip:
        generator = torch.Generator().manual_seed(4)
        length = settings["patch_tokens"]
        clean_ids = [0] + torch.randint(3, 512, (length - 1,), generator=generator).tolist()
        corrupted_ids = list(clean_ids)
        corrupted_ids[length // 2] = 3 + (corrupted_ids[length // 2] - 3 + 7) % 509
        tokenizer = model.tokenizer
        clean, corrupted = tokenizer.decode(clean_ids[1:]), tokenizer.decode(corrupted_ids[1:])
        clean_tokens = tokenizer(clean)["input_ids"]
        corrupted_tokens = tokenizer(corrupted)["input_ids"]
        if len(clean_tokens) != len(corrupted_tokens):  # the decoded text re-tokenized otherwise: patch token ids
            corrupted = clean
        positions = list(range(len(clean_tokens) - settings["patch_positions"], len(clean_tokens)))
        count = model.num_layers * len(positions) + 2
        forwards = [tokenizer(corrupted)["input_ids"]] * count

        routes = {"set_each": 0, "run_each": 0}
        per_call: dict = {}

        def patch(label="patch"):
            start = dict(routes)
            streamscope.patch(model, clean, corrupted, lambda logits: logits[5] - logits[6], positions=positions,
                              progress=False)
            per_call[label] = {name: routes[name] - start[name] for name in routes}  # what one call ran, by route

        def traced_patch():
            # The route every patch took before the bulk path: one trace invoke per patch.
            kind = type(model.engine)
            settable = kind.settable
            kind.settable = lambda self, value, block: "the trace route, for the benchmark"
            try:
                patch("traced")
            finally:
                kind.settable = settable

        counted = {name: getattr(type(model.engine), name) for name in routes}

        def counting(name):
            def method(self, prompt, items):
                routes[name] += len(items)
                return counted[name](self, prompt, items)
            return method

        for name in routes:
            setattr(type(model.engine), name, counting(name))
        workloads = {"forwards": bare_w1(llm, forwards), "patch": patch}
        if args.trace_route:
            workloads["traced"] = traced_patch
        before = trace_transport.transport_counts()
        times = timed_together(workloads, args.rounds)
        for name, method in counted.items():
            setattr(type(model.engine), name, method)
        rows += [("P", f"{count} plain forwards of {len(clean_tokens)} tokens, one generate", times["forwards"], ""),
                 ("P", f"patch: layer_output, {model.num_layers} blocks x {len(positions)} positions",
                  times["patch"], f"{times['patch'] / times['forwards']:.2f}x the forwards (target 2); "
                  f"{transport_since(before)}; a call's patches: {per_call['patch']['set_each']} bulk requests, "
                  f"{per_call['patch']['run_each']} trace invokes")]
        if args.trace_route:
            rows += [("P", "the same patches, a trace invoke each (the old route)", times["traced"],
                      f"{times['traced'] / times['forwards']:.2f}x the forwards; "
                      f"{times['traced'] / times['patch']:.1f}x the bulk route")]
        report(rows)
    model.close()

    if "w2" not in skip:
        measured = child("w2", folder, args.tiny, args.rounds)
        if measured is not None:
            generated = settings["w2_prompts"] * settings["w2_tokens"]
            bare = measured["bare"]
            rows += [("W2", "tapped engine (graphs), bare generation", bare, f"{generated / bare:,.0f} tok/s"),
                     ("W2", "the steer in a trace, an invoke per prompt", measured["trace"],
                      f"{measured['trace'] / bare:.2f}x bare (target 2); {measured['transport']}"),
                     ("W2", "the same steer, bulk path (generate(steer=))", measured["steered"],
                      f"{measured['steered'] / bare:.3f}x bare")]
            if "placed" in measured:
                again = measured["variants bare"]
                rows += [("W2", "bare again, for the rows below", again, ""),
                         ("W2", "the trace, the vector on the device beforehand", measured["placed"],
                          f"{measured['placed'] / again:.2f}x bare"),
                         ("W2", "the same, and the writes' NaN/inf check off", measured["unchecked"],
                          f"{measured['unchecked'] / again:.2f}x bare"),
                         ("W2", "the vector placed, each write-back made at once", measured["at once"],
                          f"{measured['at once'] / again:.2f}x bare")]
        peer_w2 = None if "w2peer" in skip else child("w2peer", folder, args.tiny, args.rounds)
        if peer_w2 is not None:
            rows += [("W2", "raw nnsight: bare generation, its own engine (eager)", peer_w2["bare"], ""),
                     ("W2", "raw nnsight: the same steer in its trace (hidden half += vector)", peer_w2["trace"],
                      f"{peer_w2['trace'] / peer_w2['bare']:.2f}x its bare")]
    report(rows)
    print(f"\nwhole run {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
