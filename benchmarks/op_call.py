"""The host time of one graph-op call outside a CUDA graph, as streamscope registers the ops and as
`torch.library.custom_op` would.

Where no graph replays (every step of vLLM's CPU engine; a GPU prefill past the captured sizes), each block's
ops are called from Python at every forward, about a hundred calls a forward at the Llama-3-8B shape with the
default sites. `streamscope.vllm.graph_ops` defines them through torch.library's low-level API (`_op`); this
registers the same bodies again through `torch.library.custom_op` (under another namespace) and times both, call
by call, alternating, for `edit_stretch` (two stages, the 8B shape's index and bank) in three states of the
step: idle (`IDLE.step`: the op returns at once), marked elsewhere (the step marks columns of other sites:
returns after its checks), and marked (the op edits `--rows` rows). It prints medians in microseconds and the
ratio of each registration to the body called as a plain Python function (the floor).

    python benchmarks/op_call.py                    # this CPU (the torch body)
    python benchmarks/op_call.py --device cuda      # a GPU (the Triton kernel)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_call(call: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    """Microseconds a call, over `calls` calls after a few."""
    for _ in range(5):
        call()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=8, help="the stream's rows in a call")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()

    import torch

    from streamscope.bulk.operations import prepare
    from streamscope.vllm import graph_ops
    from streamscope.vllm.graph_plan import GraphPlan

    body = graph_ops._BODIES["edit_stretch"]
    plain = torch.library.custom_op("streamscope_bench::edit_stretch", mutates_args=("hidden", "pool"))(body)
    plain.register_fake(graph_ops._edit_stretch_fake)
    registered = {"graph_ops (low-level)": graph_ops.edit_stretch,
                  "torch.library.custom_op": torch.ops.streamscope_bench.edit_stretch.default, "body alone": body}

    device = torch.device(options.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sites = [f"s{number}" for number in range(192)]  # the 8B shape: 32 blocks x 6 sites
    plan = GraphPlan(sites, 2, 8192, options.hidden, torch.float32, device, slots=256, harvest_pool=0)
    hidden = torch.randn(options.rows, options.hidden, device=device)
    residual = torch.randn(options.rows, options.hidden, device=device)
    arguments = (hidden, residual, plan.index, *plan.bank.buffers, plan.pool, [0, 2], 2, [-1, -1], [False, True])
    index = plan._lanes  # lanes 0 and 2 (the call's stages) marked on every row, or lane 4 (another site) only
    states = {"idle": (True, None, None), "marked elsewhere": (False, 4, None), "marked": (False, None, 0)}
    plan.bank.acquire("v", prepare("add", torch.ones(options.hidden), 1.0, 0.5, False, torch.float32, device))
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for _ in range(options.rounds):
            for state, (idle, elsewhere, slot) in states.items():
                index.fill_(-1)
                if elsewhere is not None:
                    index[elsewhere, :options.rows] = 0
                if slot is not None:
                    index[0, :options.rows] = slot
                    index[2, :options.rows] = slot
                graph_ops.IDLE.step, graph_ops.IDLE.columns = idle, (
                    frozenset(plan._site_column[lane] for lane in ((elsewhere,) if elsewhere is not None else (0, 2))),
                    plan.columns)
                for name, op in registered.items():
                    times.setdefault((state, name), []).append(
                        per_call(lambda: op(*arguments), options.calls, sync))
    graph_ops.IDLE.step, graph_ops.IDLE.columns = False, None
    print(f"edit_stretch, two stages, {options.rows} rows x {options.hidden} on {device}, "
          f"median of {options.rounds} rounds of {options.calls} calls (us a call; ratio to the body alone):")
    for state in states:
        floor = statistics.median(times[(state, "body alone")])
        for name in registered:
            median = statistics.median(times[(state, name)])
            print(f"  {state:17s} {name:24s} {median:9.1f} us   {median / floor:6.2f}x")


if __name__ == "__main__":
    main()
