"""The host time of the server's plan of one decode step (`ServeState.observe`), for checkouts side by side.

Every step of ``streamscope serve`` starts with the worker's plan: which rows
of the step each live request's steers edit, at every hooked module call.
This drives that code without an engine: a `ServeState` built around stand-in
sites (`--blocks` blocks' ``layer_output``, vLLM's fused halves) and a
stand-in runner, `--requests` live requests each decoding one token, and the
scheduler's output of that step written out by hand. For each checkout
(`--tree NAME=PATH`, each in its own process, the checkouts alternating round
by round) it prints the median host time of one step's plan, in microseconds,
for four workloads:

  uniform      one vector at every block, every position (the uniform fast path)
  one-all      one vector at every block, the default positions (every one but the first)
  distinct-1   a distinct vector per request at one block, the default positions
  distinct-all a distinct vector per request at every block, the default positions

    python benchmarks/cpu_serve_plan.py --tree before=/tmp/before --tree after=$PWD
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import checkouts

WORKLOADS = ("uniform", "one-all", "distinct-1", "distinct-all")


def worker(workload: str, requests: int, blocks: int, hidden: int, steps: int) -> float:
    """One checkout's median plan time (microseconds) for `workload` (the `streamscope` on sys.path)."""
    import torch

    from streamscope.bulk.spec import Site
    from streamscope.serve import worker as serve
    from streamscope.values import OUTPUT
    from streamscope.vllm.blocks import Summed

    descriptor = Summed(None, OUTPUT)
    sites = [Site("layer_output", block, None, descriptor, torch.nn.Identity(), OUTPUT,  # type: ignore[arg-type]
                  f"model.layers.{block}.output") for block in range(blocks)]
    state = serve.ServeState.__new__(serve.ServeState)
    applier_init = getattr(serve, "RequestApplier", None)
    if applier_init is not None:
        applier_init.__init__(state, "cpu")
    else:  # a checkout from before the one applier: the attributes its `__init__` sets for the plan
        state.__dict__.update(live={}, planned=0, key_counts={}, signatures={}, representatives={}, hooks={},
                              locations={}, work={}, reads=[], last_shape=None, uniform=None, uniform_work=(-1, {}),
                              device=torch.device("cpu"))
    state.__dict__.setdefault("aborted", {})  # (`ServeState.__init__` sets it where a checkout has it)
    ids = [f"r{number}" for number in range(requests)]
    state.runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=ids),
                                   requests={name: SimpleNamespace(num_computed_tokens=40) for name in ids})
    shared = torch.randn(hidden)
    steered = sites if workload != "distinct-1" else sites[:1]
    for number, name in enumerate(ids):
        steers = []
        for site in steered:
            delta = shared if workload in ("uniform", "one-all") else torch.randn(hidden)
            entry = serve.SteerEntry(site, delta, "add", None, True, 20, 0, 0, skip_first=workload != "uniform")
            entry.group = (site.key, 0, (id(site), "add"))
            steers.append(entry)
        live = serve.Live(steers, every_row=all(entry.every_row for entry in steers))
        state.enter(name, live)
    if applier_init is None:  # its `observe` sets the uniform steers as requests arrive, which they did not here
        only = next(iter(state.signatures)) if len(state.signatures) == 1 else None
        state.uniform = None if only is None else state.representatives[only]
    output = SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set(),
                             num_scheduled_tokens={name: 1 for name in ids}, total_num_scheduled_tokens=requests)
    times = []
    for step in range(steps):
        for request in state.runner.requests.values():
            request.num_computed_tokens += 1
        start = time.perf_counter()
        state.observe(output)
        times.append(time.perf_counter() - start)
    assert state.work, "the step planned no work"
    return statistics.median(times) * 1e6


def main() -> None:
    parser = checkouts.parser(__doc__.splitlines()[0], steps=40)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a workload, in a child
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.requests, args.blocks, args.hidden, args.steps)))
        return
    trees = checkouts.trees(args)
    results: dict = {(name, workload): [] for name in trees for workload in WORKLOADS}
    for _ in range(args.rounds):
        for workload in WORKLOADS:
            for name, path in trees.items():
                results[(name, workload)].append(checkouts.in_checkout(path, __file__, [
                    "--worker", workload, "--requests", str(args.requests), "--blocks", str(args.blocks),
                    "--hidden", str(args.hidden), "--steps", str(args.steps)]))
    print(f"the plan of a decode step of {args.requests} requests, {args.blocks} blocks, {args.rounds} rounds "
          f"(checkouts alternating), median us per step:")
    checkouts.print_table(WORKLOADS, results, list(trees))


if __name__ == "__main__":
    main()
