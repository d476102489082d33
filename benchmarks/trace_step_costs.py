"""W2's steer written in a trace: what one invoke costs per step, counted exactly and timed, for trees side by side.

The trace of `gpu_workloads.traced_w2` (an invoke per prompt, each adding a
vector to a block's ``layer_output`` at every step of its generation) runs on a
tiny engine in this process at two lengths, `--steps` and twice that; the
difference between them, over the invokes, is the cost of one invoke-step,
free of what a trace costs once (pickling, start-up, collection):

  host us        wall time per invoke-step over the bare generation's (medians of `--rounds`, then over the children
                 of `--repeats`; noise on a shared CPU)
  tensor ops     torch ops dispatched per invoke-step (a `TorchDispatchMode` counts them; exact): on the GPU each
                 one that is not a view is a kernel launch, and ``_local_scalar_dense`` is a wait for the device
    of them in   the ops run on an invoke's worker greenlet (streamscope's read and write-back, the user's edit)
    views        ops that only make a view (no kernel)
  python calls   Python function calls per invoke-step (cProfile; exact), by where the function lives

With ``--trees name=path,...`` each tree (a streamscope checkout: `git archive` of another commit will do) runs in
its own child process, round by round in turn, with this file's code, and the table puts them side by side:

    PYTHONPATH=$PWD python benchmarks/trace_step_costs.py                       # this tree
    python benchmarks/trace_step_costs.py --trees before=/tmp/main,after=$PWD   # two trees, one run
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_workloads; streamscope comes from PYTHONPATH


def count_ops(run) -> dict:
    """The torch ops `run()` dispatches, by name: ``all`` (every op), ``worker`` (those on a trace worker's
    greenlet), ``views`` (every op that only makes a view)."""
    from greenlet import getcurrent
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict = {"all": collections.Counter(), "worker": collections.Counter(), "views": collections.Counter()}

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            counts["all"][name] += 1
            if getattr(getcurrent(), "mediator", None) is not None:
                counts["worker"][name] += 1
            if func.is_view:
                counts["views"][name] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        run()
    return counts


def count_calls(run) -> dict:
    """Python function calls `run()` makes, by where the function lives."""
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    groups: collections.Counter = collections.Counter()
    for (filename, _, _), (_, calls, _, _, _) in pstats.Stats(profile).stats.items():
        if "streamscope/" in filename or "streamscope\\" in filename:
            group = "streamscope"
        elif "/nnsight/" in filename or "/greenlet/" in filename:
            group = "nnsight"
        elif "/torch/" in filename:
            group = "torch (Python)"
        elif "/vllm/" in filename:
            group = "vllm"
        else:
            group = "other"  # builtins (C functions) and the standard library
        groups[group] += calls
    return dict(groups)


def measure(args) -> dict:
    """One tree's figures, in this process."""
    import torch
    from vllm.platforms import current_platform

    import streamscope
    from gpu_workloads import TINY, bare_w2, build_folder, engine_kwargs, sizes, token_prompts, traced_w2

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    settings = sizes(True)
    block = settings["steer_block"]
    folder = build_folder(Path(tempfile.mkdtemp(prefix="trace-step-costs-")), True)
    model = streamscope.load(folder, engine="vllm", taps=[f"layers.{block}.layer_output"],
                             **engine_kwargs(settings, True))
    prompts = token_prompts(args.invokes, settings["w2_lengths"], 2)
    vector = torch.randn(TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    short, long = args.steps, 2 * args.steps
    runs = {("trace", short): traced_w2(model, prompts, short, block, vector),
            ("trace", long): traced_w2(model, prompts, long, block, vector),
            ("bare", short): bare_w2(model.vllm_entrypoint, prompts, short),
            ("bare", long): bare_w2(model.vllm_entrypoint, prompts, long)}
    for run in runs.values():
        run()  # warm-up
    invoke_steps = args.invokes * (long - short)

    def per_step(long_value: float, short_value: float) -> float:
        return (long_value - short_value) / invoke_steps

    ops = {key: count_ops(run) for key, run in runs.items() if key[0] == "trace"}
    bare_ops = {key: count_ops(run) for key, run in runs.items() if key[0] == "bare"}
    figures: dict = {
        "ops": per_step(sum(ops["trace", long]["all"].values()) - sum(bare_ops["bare", long]["all"].values()),
                        sum(ops["trace", short]["all"].values()) - sum(bare_ops["bare", short]["all"].values())),
        "worker ops": per_step(sum(ops["trace", long]["worker"].values()), sum(ops["trace", short]["worker"].values())),
        "views": per_step(sum(ops["trace", long]["views"].values()) - sum(bare_ops["bare", long]["views"].values()),
                          sum(ops["trace", short]["views"].values()) - sum(bare_ops["bare", short]["views"].values())),
    }
    worker_long, worker_short = ops["trace", long]["worker"], ops["trace", short]["worker"]
    figures["worker op names"] = {name: per_step(worker_long[name], worker_short[name])
                                  for name in sorted(set(worker_long) | set(worker_short))
                                  if worker_long[name] != worker_short[name]}
    calls = {key: count_calls(run) for key, run in runs.items()}
    for group in sorted({group for value in calls.values() for group in value}):
        figures[f"calls: {group}"] = per_step(
            calls["trace", long].get(group, 0) - calls["bare", long].get(group, 0),
            calls["trace", short].get(group, 0) - calls["bare", short].get(group, 0))
    times: dict = collections.defaultdict(list)
    for _ in range(args.rounds):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    medians = {key: statistics.median(values) for key, values in times.items()}
    figures["host us"] = 1e6 * per_step(medians["trace", long] - medians["bare", long],
                                        medians["trace", short] - medians["bare", short])
    figures["bare ms"] = 1e3 * medians["bare", long]
    figures["trace ms"] = 1e3 * medians["trace", long]
    model.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--invokes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="the short run's steps (the long run takes twice)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="--trees: each tree's child this many times, in turn")
    parser.add_argument("--trees", help="name=path,...: each tree in a child process, side by side")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or not args.trees:
        figures = measure(args)
        if args.child:
            print("CHILD " + json.dumps(figures), flush=True)
            return
        results = {"this tree": [figures]}
    else:
        trees = dict(item.split("=", 1) for item in args.trees.split(","))
        results = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, path in trees.items():
                command = [sys.executable, __file__, "--child", "--invokes", str(args.invokes), "--steps",
                           str(args.steps), "--rounds", str(args.rounds)]
                environment = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
                run = subprocess.run(command, capture_output=True, text=True, env=environment)
                lines = [line for line in run.stdout.splitlines() if line.startswith("CHILD ")]
                if run.returncode != 0 or not lines:
                    sys.exit(f"the {name} tree failed:\n{run.stderr[-3000:]}")
                results[name].append(json.loads(lines[-1][len("CHILD "):]))
    print(f"\nW2 in a trace, tiny Llama, {args.invokes} invokes, {args.steps} and {2 * args.steps} steps: "
          f"per invoke-step")
    names = list(results)
    keys = [key for key in results[names[0]][0] if key != "worker op names"]
    print(f"  {'':<26}" + "".join(f"{name:>16}" for name in names))
    for key in keys:
        # Counts are exact (every child finds the same); times are the median over the children.
        print(f"  {key:<26}" + "".join(f"{statistics.median(run[key] for run in results[name]):>16.2f}"
                                       for name in names))
    for name in names:
        print(f"  worker ops, {name}: " + ", ".join(
            f"{op} {count:g}" for op, count in results[name][0]["worker op names"].items()))


if __name__ == "__main__":
    main()
