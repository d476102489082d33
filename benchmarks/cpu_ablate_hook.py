"""The host cost of one ablation hook call on vLLM's fused halves, for two checkouts side by side in one run.

`gpu_directions.py`'s ablation runs one hook per block per step on the
engine's host thread: at the Llama-3-8B shape with CUDA graphs that call is
what the ablation adds to bare generation. This drives the bulk path's own
code for it without an engine: an `Applier` with an ablation at each of
`--blocks` blocks' ``layer_output`` (vLLM's `Summed` halves: hidden and
residual, ``[rows, hidden]``), each step taking its spans (`Applier.step`)
and then every block's tap (`Applier.apply_at`, what a replayed graph calls),
in inference mode as a worker runs. For each checkout (`--tree NAME=PATH`,
run in its own process, the checkouts alternating round by round) it prints:

  ops/call      tensor operations one hook call dispatches (counted: exact, whatever the CPU's load)
  kernels/call  those of them that launch a kernel on a GPU (a view such as a slice launches none)
  us/call       host time of one hook call (median; its tensor work included, as the CPU runs it)
  rows us/step  host time of `Applier.step` (the rows every steer edits, found once per step)

for two shapes of step: every row steered with no padding (eager steps, and
graphs whose batch size equals the step's), and with padding rows past the
step's tokens (a graph recorded for a larger batch). The tensors are small
by default (`--hidden 256`), so the time is the host's work, not the CPU's
arithmetic: on a GPU the arithmetic runs on the device.

    python benchmarks/cpu_ablate_hook.py --tree before=/tmp/before --tree after=$PWD
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VIEWS = {"slice", "view", "as_strided", "select", "alias", "_reshape_alias", "expand", "unsqueeze", "t"}


def worker(rows: int, hidden: int, blocks: int, steps: int, padding: int) -> dict:
    """One checkout's figures (the `streamscope` on sys.path), as a dict."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from streamscope.bulk.apply import Applier, Span, steer_plans
    from streamscope.bulk.spec import Site, Steer
    from streamscope.values import OUTPUT
    from streamscope.vllm.blocks import Summed

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    direction = torch.randn(hidden)
    descriptor = Summed(None, OUTPUT)
    sites = [Site("layer_output", block, None, descriptor, torch.nn.Identity(), OUTPUT,  # type: ignore[arg-type]
                  f"model.layers.{block}.output") for block in range(blocks)]
    steers = [(Steer("layer_output", block, direction, mode="ablate"), site) for block, site in enumerate(sites)]
    length = 16
    keys = list(range(rows))
    plans = steer_plans(steers, keys, [length] * rows, torch.float32, "cpu")
    applier = Applier([], {}, plans, "cpu").install()
    hidden_half = torch.randn(rows + padding, hidden) * 0.1
    residual = torch.randn(rows + padding, hidden)
    halves = (hidden_half, residual)
    locations = [site.location for site in sites]
    calls: list[float] = []
    spans_time: list[float] = []
    with torch.inference_mode():
        for step in range(steps):
            spans = [Span(key, key, 1, length + step) for key in keys]
            start = time.perf_counter()
            applier.step(spans)
            spans_time.append(time.perf_counter() - start)
            for location in locations:
                start = time.perf_counter()
                applier.apply_at(location, halves)
                calls.append(time.perf_counter() - start)
        counter = Counter()
        with counter:
            applier.apply_at(locations[0], halves)
    if applier.error is not None:
        raise applier.error
    kernels = [op for op in counter.ops if op not in VIEWS]
    return {"ops": len(counter.ops), "kernels": len(kernels), "names": counter.ops,
            "us": statistics.median(calls) * 1e6, "rows_us": statistics.median(spans_time) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout (repeat)")
    parser.add_argument("--rows", type=int, default=256, help="steered rows a step (decode: one a request)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # padding rows, in a child
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.rows, args.hidden, args.blocks, args.steps, args.worker)))
        return
    trees = dict(item.split("=", 1) for item in args.tree) or {"this": os.getcwd()}
    results: dict = {(name, padding): [] for name in trees for padding in (0, 8)}
    for _ in range(args.rounds):
        for padding in (0, 8):
            for name, path in trees.items():
                command = [sys.executable, __file__, "--worker", str(padding), "--rows", str(args.rows),
                           "--hidden", str(args.hidden), "--blocks", str(args.blocks), "--steps", str(args.steps)]
                environment = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
                output = subprocess.run(command, env=environment, check=True, capture_output=True, text=True).stdout
                results[(name, padding)].append(json.loads(output.strip().splitlines()[-1]))
    print(f"{args.blocks} ablation hooks a step, {args.rows} rows x {args.hidden}, float32, {args.rounds} rounds "
          f"(checkouts alternating), medians:")
    print("| tree | padding rows | ops/call | kernels/call | us/call | rows us/step | ops |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (name, padding), runs in results.items():
        first = runs[0]
        print(f"| {name} | {padding} | {first['ops']} | {first['kernels']} | "
              f"{statistics.median(run['us'] for run in runs):.1f} | "
              f"{statistics.median(run['rows_us'] for run in runs):.1f} | {' '.join(first['names'])} |")


if __name__ == "__main__":
    main()
