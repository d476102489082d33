"""The graph ops on a GPU (issue 39): captured into a CUDA graph, refilled, replayed; compiled; their idle cost.

Runs where streamscope's dependencies are not installed (a bare GPU machine with torch): it loads
``streamscope/vllm/graph_ops.py``, ``graph_plan.py`` and ``bulk/operations.py`` from this checkout by path, with a
stand-in for ``bulk.apply.Span``. From the checkout's root::

    python3 scripts/graph_ops_gpu_check.py

It prints each check's result and exits non-zero where a replay's bits differ from the eager call's on the same
buffers, or an unmarked row changed. See docs/graph-ops.md.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any, NamedTuple

import torch

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "streamscope")
DEVICE = "cuda"


class Span(NamedTuple):
    """`streamscope.bulk.apply.Span`, whose module needs the rest of streamscope."""

    key: Any
    start: int
    count: int
    first: int


def load(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, os.path.join(PACKAGE, path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


for package in ("streamscope", "streamscope.bulk", "streamscope.vllm"):
    stand_in = types.ModuleType(package)
    stand_in.__path__ = []  # type: ignore[attr-defined]
    sys.modules[package] = stand_in
apply = types.ModuleType("streamscope.bulk.apply")
apply.Span = Span  # type: ignore[attr-defined]
sys.modules["streamscope.bulk.apply"] = apply
operations = load("streamscope.bulk.operations", "bulk/operations.py")
ops = load("streamscope.vllm.graph_ops", "vllm/graph_ops.py")
plans = load("streamscope.vllm.graph_plan", "vllm/graph_plan.py")


def operation(mode: str, norm_match: bool, dtype: torch.dtype, width: int, seed: int) -> Any:
    vector = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    return operations.prepare(mode, vector, 0.8, 2.0, norm_match, dtype, DEVICE)


def scenarios(dtype: torch.dtype, width: int) -> list[tuple[str, dict, list[Span]]]:
    rule, steer = plans.RowRule, plans.PlannedSteer
    return [
        ("three requests", {
            "a": [steer(["s0", "s1"], operation("ablate", False, dtype, width, 1), rule.of(range(1, 40), 40), "a")],
            "b": [steer(["s0"], operation("add", False, dtype, width, 2), rule.of([0, 3, 5], 10), "b")],
            "c": [steer(["s1"], operation("clamp", True, dtype, width, 3), rule.of(range(20), 20), "c")]},
         [Span("a", 0, 40, 0), Span("b", 40, 10, 0), Span(None, 50, 30, 0), Span("c", 80, 20, 0)]),
        ("decode, norm-matched set", {
            "d": [steer(["s0"], operation("set", True, dtype, width, 4), rule.of([0], 4), "d")]},
         [Span("d", 0, 1, 7), Span(None, 1, 1, 9)]),
        ("idle", {}, [Span(None, 0, 200, 0)]),
    ]


def check_capture(dtype: torch.dtype, width: int = 4096, rows: int = 256) -> bool:
    """Both ops at two sites captured once; each scenario refills the buffers and replays: the replay's bits are
    an eager call's on the same buffers, and rows no slot marks are untouched."""
    plan = plans.GraphPlan(["s0", "s1"], 1, 512, width, dtype, DEVICE, slots=8, harvest_sites=["s0", "s1"])
    hidden = torch.zeros(rows, width, dtype=dtype, device=DEVICE)
    residual = torch.zeros_like(hidden)

    def body(hidden: torch.Tensor, residual: torch.Tensor) -> None:
        ops.edit_stream(hidden, residual, plan.slots_of("s0"), *plan.bank.buffers)
        ops.harvest_stream(plan.harvest_buffer("s0"), hidden, residual, plan.sources)
        ops.edit_stream(residual, None, plan.slots_of("s1"), *plan.bank.buffers)
        ops.harvest_stream(plan.harvest_buffer("s1"), residual, None, plan.sources)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body(hidden, residual)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(hidden, residual)
    good = True
    for name, steers, spans in scenarios(dtype, width):
        first = {span.key: span.first for span in spans}
        for key, planned in steers.items():  # a prefill harvests some of its positions; a decode step none
            plan.enter(key, planned, harvest_positions=range(0, 60, 7) if first[key] == 0 else ())
        plan.step(spans)
        source_hidden = torch.randn(rows, width, device=DEVICE).to(dtype)
        source_residual = torch.randn(rows, width, device=DEVICE).to(dtype)
        hidden.copy_(source_hidden)
        residual.copy_(source_residual)
        plan.harvested.zero_()
        graph.replay()
        replayed = (hidden.clone(), residual.clone(), plan.harvested.clone())
        eager_hidden, eager_residual = source_hidden.clone(), source_residual.clone()
        plan.harvested.zero_()
        body(eager_hidden, eager_residual)
        same = (torch.equal(replayed[0], eager_hidden) and torch.equal(replayed[1], eager_residual)
                and torch.equal(replayed[2], plan.harvested))
        marked = (plan.index[:rows, :2] >= 0).any(-1)
        untouched = (torch.equal(replayed[0][~marked], source_hidden[~marked])
                     and torch.equal(replayed[1][~marked], source_residual[~marked]))
        print(f"{dtype} {name}: replay == eager bits {same}; unmarked rows untouched {untouched}; "
              f"marked rows {int(marked.sum())}", flush=True)
        good = good and same and untouched
        for key in steers:
            plan.leave(key)
    return good


def check_operations(width: int = 4096) -> None:
    """float32 on the GPU (TF32 off): every mode, plain and norm-matched, on fused halves, against `Operation`."""
    worst = 0.0
    for number, (mode, norm_match) in enumerate((m, n) for m in ("add", "set", "ablate", "clamp") for n in (0, 1)):
        op = operation(mode, bool(norm_match), torch.float32, width, 10 + number)
        bank = plans.SlotBank(1, width, torch.float32, DEVICE)
        bank.acquire("k", op)
        hidden = torch.randn(64, width, device=DEVICE) * 3
        residual = torch.randn(64, width, device=DEVICE) * 5
        edited = hidden.clone()
        ops.edit_stream(edited, residual, torch.zeros(64, dtype=torch.int32, device=DEVICE), *bank.buffers)
        want = op(hidden + residual)
        worst = max(worst, float((edited + residual - want).abs().max() / want.abs().max()))
    print(f"float32, every mode on fused halves against Operation: worst relative difference {worst:.3g}", flush=True)


def check_compile(width: int = 1024) -> None:
    """torch.compile with the ops around a linear layer, default and with inductor's CUDA graphs."""
    plan = plans.GraphPlan(["s0"], 1, 64, width, torch.float32, DEVICE, slots=2, harvest_sites=["s0"])
    plan.enter("a", [plans.PlannedSteer(["s0"], operation("ablate", False, torch.float32, width, 20),
                                        plans.RowRule.of(range(8), 8), "x")], harvest_positions=[2, 5])
    plan.step([Span("a", 0, 8, 0), Span(None, 8, 8, 0)])
    linear = torch.nn.Linear(width, width, device=DEVICE)

    def forward(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        ops.edit_stream(hidden, residual, plan.slots_of("s0"), *plan.bank.buffers)
        out = linear(hidden + residual)
        ops.harvest_stream(plan.harvest_buffer("s0"), out, None, plan.sources)
        return out

    inputs = torch.randn(16, width, device=DEVICE)
    residual = torch.randn(16, width, device=DEVICE)
    with torch.no_grad():
        eager = forward(inputs.clone(), residual)
        harvested = plan.harvested.clone()
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            compiled = torch.compile(forward, fullgraph=True, mode=mode)
            for _ in range(3):
                out = compiled(inputs.clone(), residual)
            difference = float((out - eager).abs().max() / eager.abs().max())
            print(f"compile {mode}: relative difference to eager {difference:.3g}, harvest difference "
                  f"{float((plan.harvested - harvested).abs().max()):.3g}", flush=True)


def idle_cost(dtype: torch.dtype = torch.bfloat16, width: int = 4096, rows: int = 256, sites: int = 128,
              harvest: bool = False) -> None:
    """A captured graph of the ops at `sites` sites with no row marked: its replay time."""
    names = [f"s{number}" for number in range(sites)]
    plan = plans.GraphPlan(names, 1, 8192, width, dtype, DEVICE, slots=256,
                           harvest_sites=names if harvest else (), harvest_capacity=256)
    hidden = torch.randn(rows, width, device=DEVICE).to(dtype)
    residual = torch.randn_like(hidden)
    views = [plan.slots_of(name) for name in names]

    def body() -> None:
        for name, view in zip(names, views):
            ops.edit_stream(hidden, residual, view, *plan.bank.buffers)
            if harvest:
                ops.harvest_stream(plan.harvest_buffer(name), hidden, residual, plan.sources)

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    each = start.elapsed_time(end) / 20
    print(f"idle {'edit and harvest' if harvest else 'edit'} ops at {sites} sites, {rows} rows, {dtype}: "
          f"{each:.3f} ms a replay, {1000 * each / sites:.1f} us a site", flush=True)


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    captured = check_capture(torch.float32) and check_capture(torch.bfloat16)
    print("capture:", "ok" if captured else "FAILED", flush=True)
    check_operations()
    check_compile()
    idle_cost()
    idle_cost(harvest=True)
    idle_cost(rows=8192, sites=32)
    return 0 if captured else 1


if __name__ == "__main__":
    sys.exit(main())
