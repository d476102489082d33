"""The host time of the graph ops' plan of one step (`GraphBackend.step`), for checkouts side by side.

Every step of an engine with the graph ops starts with the plan's fill from the step's spans
(`streamscope.vllm.graph_plan.GraphPlan.step`), on the host, before the step's graph replays: in process, for a
bulk run's requests; on a server, for each live request. This drives it without an engine: a `GraphBackend`
over stand-in sites (`--blocks` blocks), `--requests` live requests each with the same operation at every block
(what a bulk run's ablation, or the server's every-block steer, enters), and each step's spans written out by
hand. For each checkout (`--tree NAME=PATH`, each in its own process, the checkouts alternating round by round)
it prints the median host time of one step, in microseconds, for three steps:

  decode     every request one row, a steady batch (the same rows as the step before)
  prefill    `--requests / 8` requests of 64 prompt rows, then the decode step after it
  mixed      the decode rows and one request's 256 prompt rows, alternating with the plain decode step

and an operation of each kind the graph ops run, `--operation` (``ablate``: an ablation, every position but the
first; ``add``: a steer at every position).

    python benchmarks/cpu_graph_step.py --tree before=/tmp/before --tree after=$PWD
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import checkouts

STEPS = ("decode", "prefill", "mixed")


def worker(requests: int, blocks: int, hidden: int, steps: int, operation: str) -> dict[str, float]:
    """One checkout's median microseconds a step, by kind of step (the `streamscope` on sys.path)."""
    import torch

    from streamscope.bulk.operations import prepare
    from streamscope.bulk.requests import Live, Span, SteerEntry
    from streamscope.vllm.graph_backend import GraphBackend, GraphOps
    from streamscope.vllm.graph_plan import GraphPlan

    modules = [torch.nn.Identity() for _ in range(blocks)]
    sites = {f"layers.{number}.layer_output": SimpleNamespace(
        module=module, where="output", descriptor=None, key=(id(module), "output"), value="layer_output",
        location=f"model.layers.{number}.output") for number, module in enumerate(modules)}
    plan = GraphPlan(list(sites), 2, 8192, hidden, torch.float32, "cpu", slots=256)
    names = {(id(site.module), site.where, id(site.descriptor)): name for name, site in sites.items()}
    backend = GraphBackend(GraphOps(plan, names, None, order={name: number for number, name in enumerate(sites)}))
    vector = prepare(operation, torch.randn(hidden), 1.0, 0.5, False, torch.float32, "cpu")
    skip_first = operation == "ablate"
    for number in range(requests):
        steers = [SteerEntry(site, vector, None, None, True, 64, 0, skip_first=skip_first) for site in sites.values()]
        backend.enter(number, Live(steers))
    decode = [Span(number, number, 1, 100) for number in range(requests)]
    prefill = [Span(number, 64 * number, 64, 0) for number in range(requests // 8)]
    mixed = decode + [Span(requests, requests, 256, 0)]
    backend.enter(requests, Live([SteerEntry(site, vector, None, None, True, 256, 0, skip_first=skip_first)
                                  for site in sites.values()]))
    times: dict[str, list[float]] = {kind: [] for kind in STEPS}
    for step in range(steps):
        for kind, spans in (("decode", decode), ("prefill", prefill), ("mixed", mixed)):
            shifted = [Span(key, start, count, first + step if count == 1 else first)
                       for key, start, count, first in spans]
            backend.step([Span(key, start, count, first + step) for key, start, count, first in decode])
            start = time.perf_counter()
            backend.step(shifted)
            times[kind].append(time.perf_counter() - start)
    assert not plan.idle, "the step marked no row"
    return {kind: statistics.median(values) * 1e6 for kind, values in times.items()}


def main() -> None:
    parser = checkouts.parser(__doc__.splitlines()[0], steps=200)
    parser.add_argument("--operation", choices=("ablate", "add"), default="ablate")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one checkout, in a child
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.requests, args.blocks, args.hidden, args.steps, args.operation)))
        return
    trees = checkouts.trees(args)
    results: dict = {(name, kind): [] for name in trees for kind in STEPS}
    for _ in range(args.rounds):
        for name, path in trees.items():
            medians = checkouts.in_checkout(path, __file__, [
                "--worker", "--requests", str(args.requests), "--blocks", str(args.blocks), "--hidden",
                str(args.hidden), "--steps", str(args.steps), "--operation", args.operation])
            for kind, value in medians.items():
                results[(name, kind)].append(value)
    print(f"the graph ops' plan of a step, {args.requests} requests with an {args.operation} at each of "
          f"{args.blocks} blocks, {args.rounds} rounds (checkouts alternating), median us a step:")
    checkouts.print_table(STEPS, results, list(trees))


if __name__ == "__main__":
    main()
