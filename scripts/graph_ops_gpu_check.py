"""The graph ops on a GPU (issue 39): captured into a CUDA graph, refilled, replayed; compiled; their idle cost.

It imports streamscope where streamscope's dependencies are installed (the lent machine after its install), and
runs where they are not too (a bare GPU machine with torch and triton): it then loads
``streamscope/vllm/graph_kernels.py``, ``graph_ops.py``, ``row_rules.py``, ``graph_plan.py`` and
``bulk/operations.py`` from this checkout by path, with stand-ins for what they import of the rest. From the checkout's root::

    python3 scripts/graph_ops_gpu_check.py

The ops run their Triton kernels on CUDA (`graph_ops`' default); every check and timing runs with the kernels and
again with the torch body (``graph_ops.use_body("torch")``), in the same process, so the two are compared on one
GPU. It prints each check's result and exits non-zero where a replay's bits differ from the eager call's on the
same buffers, an unmarked row changed, or the kernels' plain add or set differ from the torch body's bits. See
docs/graph-ops.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
import types
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "streamscope")
DEVICE = "cuda"


def load(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, os.path.join(PACKAGE, path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stand_ins() -> None:
    """Empty packages, and `bulk.apply.Span` and `bulk.steer.steer_positions`, whose modules need the rest of
    streamscope; the checks below never plan a steer from a `Steer`, so that stand-in refuses."""

    class Span(NamedTuple):
        key: Any
        start: int
        count: int
        first: int

    def steer_positions(*_: Any) -> Any:
        raise RuntimeError("graph_ops_gpu_check plans rows with RowRule.of; steer_positions needs streamscope")

    for package in ("streamscope", "streamscope.bulk", "streamscope.vllm"):
        stand_in = types.ModuleType(package)
        stand_in.__path__ = []  # type: ignore[attr-defined]
        sys.modules[package] = stand_in
    for name, attribute, value in (("apply", "Span", Span), ("steer", "steer_positions", steer_positions)):
        module = types.ModuleType(f"streamscope.bulk.{name}")
        setattr(module, attribute, value)
        sys.modules[module.__name__] = module


try:  # where streamscope's dependencies are installed (the lent machine after install.sh)
    from streamscope.bulk import operations
    from streamscope.bulk.apply import Span
    from streamscope.vllm import graph_kernels as kernels, graph_ops as ops, graph_plan as plans, row_rules as rules
except ImportError:
    stand_ins()
    Span = sys.modules["streamscope.bulk.apply"].Span
    operations = load("streamscope.bulk.operations", "bulk/operations.py")
    ops = load("streamscope.vllm.graph_ops", "vllm/graph_ops.py")  # before the kernels, which import it
    kernels = load("streamscope.vllm.graph_kernels", "vllm/graph_kernels.py")  # (graph_ops imports it on first use)
    rules = load("streamscope.vllm.row_rules", "vllm/row_rules.py")
    plans = load("streamscope.vllm.graph_plan", "vllm/graph_plan.py")
BODIES = ("triton", "torch")


@contextlib.contextmanager
def body(name: str) -> Iterator[None]:
    """The ops run `name`'s body inside: a graph captured inside keeps that body's kernels."""
    previous = ops.use_body(name)
    try:
        yield
    finally:
        ops.use_body(previous)


@contextlib.contextmanager
def dependent(on: bool) -> Iterator[None]:
    """The edit kernels launch as programmatic dependents inside (`graph_kernels.DEPENDENT_LAUNCH`)."""
    previous, kernels.DEPENDENT_LAUNCH = kernels.DEPENDENT_LAUNCH, on
    try:
        yield
    finally:
        kernels.DEPENDENT_LAUNCH = previous


#: How far an op's float32 edit may stand from `Operation`'s (relative to the stream's largest entry): the same
#: float32 arithmetic in another order, as tests/precision.py's CPU_FLOAT32 states it.
FLOAT32_ORDER = 1e-5


@contextlib.contextmanager
def switch_off() -> Iterator[None]:
    """Every op runs inside, whatever the last plan's step set (`graph_ops.IDLE`): an idle step left on by an
    earlier check would make each op return at once, and a comparison of two calls compare nothing."""
    previous = ops.IDLE.step, ops.IDLE.lean, ops.IDLE.columns
    ops.IDLE.step, ops.IDLE.lean, ops.IDLE.columns = False, False, None
    try:
        yield
    finally:
        ops.IDLE.step, ops.IDLE.lean, ops.IDLE.columns = previous


def operation(mode: str, norm_match: bool, dtype: torch.dtype, width: int, seed: int) -> Any:
    vector = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    return operations.prepare(mode, vector, 0.8, 2.0, norm_match, dtype, DEVICE)


def scenarios(dtype: torch.dtype, width: int) -> list[tuple[str, dict, list[Span]]]:
    rule, steer = rules.RowRule, plans.PlannedSteer
    return [
        ("three requests", {
            "a": [steer(["s0", "s1"], operation("ablate", False, dtype, width, 1), rule.of(range(1, 40), 40), "a")],
            "b": [steer(["s0"], operation("add", False, dtype, width, 2), rule.of([0, 3, 5], 10), "b"),
                  steer(["s0"], operation("clamp", False, dtype, width, 5), rule.of([3, 4, 5], 10), "b")],
            "c": [steer(["s1"], operation("clamp", True, dtype, width, 3), rule.of(range(20), 20), "c")]},
         [Span("a", 0, 40, 0), Span("b", 40, 10, 0), Span(None, 50, 30, 0), Span("c", 80, 20, 0)]),
        ("decode, norm-matched set", {
            "d": [steer(["s0"], operation("set", True, dtype, width, 4), rule.of([0], 4), "d")]},
         [Span("d", 0, 1, 7), Span(None, 1, 1, 9)]),
        ("idle", {}, [Span(None, 0, 200, 0)]),
    ]


def replay_against(graph: torch.cuda.CUDAGraph, eager: Callable[[torch.Tensor, torch.Tensor], None], plan: Any,
                   hidden: torch.Tensor, residual: torch.Tensor) -> tuple[bool, bool, int]:
    """`graph` replayed on fresh random halves against `eager` called on copies of them, the plan as filled:
    whether the bits (halves and harvest buffers) are the same, whether rows no slot marks are untouched, and how
    many rows are marked."""
    rows, width = hidden.shape
    source_hidden = torch.randn(rows, width, device=DEVICE).to(hidden.dtype)
    source_residual = torch.randn(rows, width, device=DEVICE).to(hidden.dtype)
    hidden.copy_(source_hidden)
    residual.copy_(source_residual)
    plan.pool.zero_()
    graph.replay()
    replayed = (hidden.clone(), residual.clone(), plan.pool.clone())
    eager_hidden, eager_residual = source_hidden.clone(), source_residual.clone()
    plan.pool.zero_()
    eager(eager_hidden, eager_residual)
    same = (torch.equal(replayed[0], eager_hidden) and torch.equal(replayed[1], eager_residual)
            and torch.equal(replayed[2], plan.pool))
    marked = (plan.index[:rows, :len(plan.lane_of)] >= 0).any(-1)
    untouched = (torch.equal(replayed[0][~marked], source_hidden[~marked])
                 and torch.equal(replayed[1][~marked], source_residual[~marked]))
    return same, untouched, int(marked.sum())


def check_capture(dtype: torch.dtype, width: int = 4096, rows: int = 256) -> bool:
    """Both ops at two sites of two rounds captured once (a site's rounds in one launch; at s0 with its harvest);
    each scenario refills the buffers and replays: the replay's bits are an eager call's on the same buffers, and
    rows no slot marks are untouched."""
    plan = plans.GraphPlan(["s0", "s1"], 2, 512, width, dtype, DEVICE, slots=8, harvest_sites=["s0", "s1"])
    hidden = torch.zeros(rows, width, dtype=dtype, device=DEVICE)
    residual = torch.zeros_like(hidden)

    def body(hidden: torch.Tensor, residual: torch.Tensor) -> None:
        # the harvest ops as an engine calls them: the whole pool and the site's column of targets
        ops.edit_harvest_stream(hidden, residual, plan.rounds_of("s0"), *plan.bank.buffers, plan.pool,
                                plan.targets_of("s0"))  # the two ops below in one
        ops.edit_stream(residual, None, plan.rounds_of("s1"), *plan.bank.buffers)
        ops.harvest_stream(plan.pool, residual, None, plan.targets_of("s1"))

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
        same, untouched, marked = replay_against(graph, body, plan, hidden, residual)
        launch = ", dependent" if kernels.DEPENDENT_LAUNCH else ""
        print(f"{ops._body or 'default'} body{launch}, {dtype} {name}: replay == eager bits {same}; unmarked rows "
              f"untouched {untouched}; marked rows {marked}", flush=True)
        good = good and same and untouched
        for key in steers:
            plan.leave(key)
    return good


def check_idle_switch(dtype: torch.dtype = torch.float32, width: int = 4096, rows: int = 256) -> bool:
    """The ops' idle switch (`graph_ops.IDLE`) under real captures, a steer's rows marked: a graph captured while
    ``IDLE.step`` is set still holds the ops (its replay is the eager call's bits, the switch off); a graph captured
    under ``IDLE.capture()`` holds none (its replay leaves the marked rows as they were); an uncaptured call on an
    idle step leaves them too."""
    plan = plans.GraphPlan(["s0"], 1, 512, width, dtype, DEVICE, slots=8)
    hidden = torch.zeros(rows, width, dtype=dtype, device=DEVICE)
    residual = torch.zeros_like(hidden)
    scratch = torch.zeros(width, dtype=dtype, device=DEVICE)

    def body(hidden: torch.Tensor, residual: torch.Tensor) -> None:
        ops.edit_stream(hidden, residual, plan.rounds_of("s0"), *plan.bank.buffers)
        scratch.copy_(residual[0])  # a kernel of the model's own, so that no graph is empty

    ablate = operation("ablate", False, dtype, width, 1)
    plan.enter("a", [plans.PlannedSteer(["s0"], ablate, rules.RowRule.of(range(1, 40), 40), "a")])
    plan.step([Span("a", 0, 40, 0), Span(None, 40, 60, 0)])
    body(hidden, residual)  # warm-up, uncaptured
    torch.cuda.synchronize()
    graphs = {}
    for label, context in (("switch set", contextlib.nullcontext()), ("idle capture", ops.IDLE.capture())):
        ops.IDLE.step = True
        graphs[label] = torch.cuda.CUDAGraph()
        with context, torch.cuda.graph(graphs[label]):
            body(hidden, residual)
        ops.IDLE.step = False
    same, untouched, marked = replay_against(graphs["switch set"], body, plan, hidden, residual)
    hidden.normal_()
    before = hidden.clone()
    graphs["idle capture"].replay()
    idle_graph_empty = torch.equal(hidden, before)
    ops.IDLE.step = True
    body(hidden, residual)
    ops.IDLE.step = False
    skipped = torch.equal(hidden, before)
    print(f"idle switch, {dtype} ({marked} rows marked): captured with the switch set, replay == eager bits "
          f"{same} (the ops captured); the idle capture's replay leaves the rows {idle_graph_empty}; an uncaptured "
          f"idle call leaves them {skipped}", flush=True)
    return same and untouched and marked > 0 and idle_graph_empty and skipped


def check_lean_capture(dtype: torch.dtype = torch.float32, width: int = 4096, rows: int = 256) -> bool:
    """The lean set's capture under a real CUDA graph (`graph_ops.IDLE.capture(LEAN_SET, kept)`): two sites, the
    graph captured keeping s1's columns only. A step that steers and harvests s1 alone (the steps the lean set
    replays) replays to an eager call's bits with every op on; a step that steers s0 replays with s0's rows as they
    were (no op of s0 in the graph), which is why such a step replays vLLM's graphs instead."""
    plan = plans.GraphPlan(["s0", "s1"], 1, 512, width, dtype, DEVICE, slots=8, harvest_sites=["s0", "s1"])
    hidden = torch.zeros(rows, width, dtype=dtype, device=DEVICE)
    residual = torch.zeros_like(hidden)

    def body(hidden: torch.Tensor, residual: torch.Tensor) -> None:
        for site in ("s0", "s1"):
            ops.edit_harvest_stream(hidden, residual, plan.rounds_of(site), *plan.bank.buffers, plan.pool,
                                    plan.targets_of(site))

    add = operation("add", False, dtype, width, 1)
    plan.enter("lean", [plans.PlannedSteer(["s1"], add, rules.RowRule.of(range(40), 40), "v")],
               harvest_positions=list(range(0, 40, 5)), harvest_sites=["s1"])
    plan.step([Span("lean", 0, 40, 0), Span(None, 40, 60, 0)])
    body(hidden, residual)  # warm-up, uncaptured
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with ops.IDLE.capture(ops.LEAN_SET, plan.columns_of(["s1"])), torch.cuda.graph(graph):
        body(hidden, residual)
    saved = ops.IDLE.columns
    ops.IDLE.columns = None  # the eager call runs every op
    same, untouched, marked = replay_against(graph, body, plan, hidden, residual)
    plan.leave("lean")
    plan.enter("other", [plans.PlannedSteer(["s0"], add, rules.RowRule.of(range(20), 20), "v")])
    plan.step([Span("other", 0, 20, 0)])
    hidden.normal_()
    before = hidden.clone()
    graph.replay()
    s0_left = torch.equal(hidden, before)
    ops.IDLE.columns = saved
    plan.leave("other")
    print(f"lean capture, {dtype} ({marked} rows marked at s1): replay == eager bits {same}, unmarked rows "
          f"untouched {untouched}; a steer at s0 (not kept) leaves its rows as they were {s0_left}", flush=True)
    return same and untouched and marked > 0 and s0_left


def check_no_wait(dtype: torch.dtype = torch.bfloat16, width: int = 4096) -> bool:
    """A request's entry (its operations prepared from host vectors, their slots filled), a step's fill and its
    harvest's copy out, behind a queue of device work, with torch's sync debug mode at "error": any wait for the
    device raises. Prints how long the host took against how long the queued work ran."""
    plan = plans.GraphPlan(["s0", "s1"], 2, 512, width, dtype, DEVICE, slots=8, harvest_sites=["s0", "s1"])
    busy = torch.randn(4096, 4096, device=DEVICE)
    for warm in range(2):  # the first pass allocates the pinned staging buffers and the allocator's blocks
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(40):
            busy @ busy
        queued = time.perf_counter()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error" if warm else "default")
        try:
            # two steps, as a server's host runs at most one ahead: the fill's staging buffer of two steps ago is
            # free without a wait once the device reaches it
            for _, steers, spans in scenarios(dtype, width)[:2]:
                first = {span.key: span.first for span in spans}
                for key, planned in steers.items():
                    plan.enter(key, planned, harvest_positions=range(0, 60, 7) if first[key] == 0 else ())
                plan.copy_out(plan.step(spans))
                for key in steers:
                    plan.leave(key)
        except RuntimeError as error:
            print(f"no wait for the device: FAILED ({error})", flush=True)
            return False
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        host = time.perf_counter() - queued
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize()
    device = start.elapsed_time(end) / 1000
    waited = host > 0.5 * device
    print(f"no wait for the device: entries, fills and copies took the host {host * 1e3:.2f} ms behind "
          f"{device * 1e3:.1f} ms of queued work: {'FAILED' if waited else 'ok'}", flush=True)
    return not waited


def check_stretch_capture(dtype: torch.dtype, width: int = 4096, rows: int = 256) -> bool:
    """Three joined sites (`edit_stretch`: the first on the hidden half alone, the others on the fused stream, two
    rounds each, each harvested) captured in one launch; each scenario refills the buffers and replays: the
    replay's bits are the three sites' single ops called one after another, eagerly."""
    names = ["s0", "s1", "s2"]
    plan = plans.GraphPlan(names, 2, 512, width, dtype, DEVICE, slots=8, harvest_sites=names)
    hidden = torch.zeros(rows, width, dtype=dtype, device=DEVICE)
    residual = torch.zeros_like(hidden)
    lanes = [plan.lane_of[(name, 0)] for name in names]

    def joined(hidden: torch.Tensor, residual: torch.Tensor) -> None:
        ops.edit_stretch(hidden, residual, plan.index, *plan.bank.buffers, plan.pool, lanes, 2,
                         [plan.harvest_lane_of[name] for name in names], [False, True, True])

    def separate(hidden: torch.Tensor, residual: torch.Tensor) -> None:
        for name, fused in zip(names, (False, True, True)):
            ops.edit_harvest_stream(hidden, residual if fused else None, plan.rounds_of(name), *plan.bank.buffers,
                                    plan.pool, plan.targets_of(name))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        joined(hidden, residual)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        joined(hidden, residual)
    good = True
    for name, steers, spans in scenarios(dtype, width):
        first = {span.key: span.first for span in spans}
        for key, planned in steers.items():  # the scenarios' steers at s0 and s1, and each again at s2
            more = [plans.PlannedSteer(["s2"], steer.operation, steer.rule, (steer.share, "s2")) for steer in planned]
            plan.enter(key, planned + more, harvest_positions=range(0, 60, 7) if first[key] == 0 else ())
        plan.step(spans)
        same, _, marked = replay_against(graph, separate, plan, hidden, residual)
        print(f"joined sites, {ops._body or 'default'} body, {dtype} {name}: replay == the sites one by one "
              f"{same}; marked rows {marked}", flush=True)
        good = good and same
        for key in steers:
            plan.leave(key)
    return good


def stretch_ok(dtype: torch.dtype) -> bool:
    """`check_stretch_capture`, an error printed (a failed check, not the end of the script's other figures)."""
    try:
        return check_stretch_capture(dtype)
    except Exception as error:
        print(f"joined sites, {dtype}: FAILED with {type(error).__name__}: {error}", flush=True)
        return False


def check_operations(widths: tuple[int, ...] = (4096, 16384)) -> bool:
    """float32 on the GPU (TF32 off): every mode, plain and norm-matched, on fused halves, against `Operation`,
    by the running body: within `FLOAT32_ORDER`, and every marked row changed."""
    good = True
    for width in widths:
        worst, acted = 0.0, True
        for number, (mode, norm_match) in enumerate((m, n) for m in ("add", "set", "ablate", "clamp") for n in (0, 1)):
            op = operation(mode, bool(norm_match), torch.float32, width, 10 + number)
            bank = plans.SlotBank(1, width, torch.float32, DEVICE)
            bank.acquire("k", op)
            hidden = torch.randn(64, width, device=DEVICE) * 3
            residual = torch.randn(64, width, device=DEVICE) * 5
            edited = hidden.clone()
            with switch_off():
                ops.edit_stream(edited, residual, torch.zeros(64, dtype=torch.int32, device=DEVICE), *bank.buffers)
            want = op(hidden + residual)
            acted = acted and bool((edited != hidden).any(-1).all())
            worst = max(worst, float((edited + residual - want).abs().max() / want.abs().max()))
        passed = acted and worst <= FLOAT32_ORDER
        good = good and passed
        print(f"{ops._body or 'default'} body, float32, width {width}, every mode on fused halves against "
              f"Operation: worst relative difference {worst:.3g} (bound {FLOAT32_ORDER:g}), every row edited {acted}: "
              f"{'ok' if passed else 'FAILED'}", flush=True)
    return good


def check_compile(width: int = 1024) -> bool:
    """torch.compile with the ops around a linear layer, default and with inductor's CUDA graphs: the eager call's
    output within `FLOAT32_ORDER` and its harvest's bits, the pool cleared before each call; the eager call's edit
    changed the output."""
    plan = plans.GraphPlan(["s0"], 1, 64, width, torch.float32, DEVICE, slots=2, harvest_sites=["s0"])
    plan.enter("a", [plans.PlannedSteer(["s0"], operation("ablate", False, torch.float32, width, 20),
                                        rules.RowRule.of(range(8), 8), "x")], harvest_positions=[2, 5])
    plan.step([Span("a", 0, 8, 0), Span(None, 8, 8, 0)])
    linear = torch.nn.Linear(width, width, device=DEVICE)

    def forward(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        ops.edit_stream(hidden, residual, plan.slots_of("s0"), *plan.bank.buffers)
        out = linear(hidden + residual)
        ops.harvest_stream(plan.pool, out, None, plan.targets_of("s0"))
        return out

    inputs = torch.randn(16, width, device=DEVICE)
    residual = torch.randn(16, width, device=DEVICE)
    good = True
    with torch.no_grad():
        plain = linear(inputs + residual)
        plan.pool.zero_()
        eager = forward(inputs.clone(), residual)
        harvested = plan.pool.clone()
        acted = not torch.equal(eager[:8], plain[:8]) and torch.equal(eager[8:], plain[8:]) and bool(harvested.any())
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            compiled = torch.compile(forward, fullgraph=True, mode=mode)
            for _ in range(3):
                plan.pool.zero_()
                out = compiled(inputs.clone(), residual)
            difference = float((out - eager).abs().max() / eager.abs().max())
            same_harvest = torch.equal(plan.pool, harvested)
            passed = acted and difference <= FLOAT32_ORDER and same_harvest
            good = good and passed
            print(f"compile {mode}: relative difference to eager {difference:.3g} (bound {FLOAT32_ORDER:g}), the "
                  f"harvest's bits {same_harvest}, the eager edit acted {acted}: {'ok' if passed else 'FAILED'}",
                  flush=True)
    return good


def summed(half: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """The stream in float32: the hidden half, plus the residual half where there is one."""
    return half.float() if residual is None else half.float() + residual.float()


def run_body(name: str, *arguments: Any) -> torch.Tensor:
    """The hidden half after an edit call by one body (a copy of the arguments' stream)."""
    hidden = arguments[0].clone()
    with body(name):
        ops.edit_stream(hidden, *arguments[1:])
    return hidden


def check_bodies_agree(dtype: torch.dtype, widths: tuple[int, ...] = (4096, 5120, 16384), rows: int = 64) -> bool:
    """The kernels against the torch body on this GPU: every mode, plain and norm-matched, fused and whole; a
    plain add or set the same bits; unmarked rows (every other row) untouched by both."""
    good = True
    for width in widths:
        worst = 0.0
        for number, (mode, norm_match) in enumerate((m, n) for m in ("add", "set", "ablate", "clamp") for n in (0, 1)):
            bank = plans.SlotBank(1, width, dtype, DEVICE)
            bank.acquire("k", operation(mode, bool(norm_match), dtype, width, 30 + number))
            slots = torch.tensor([0, -1] * (rows // 2), dtype=torch.int32, device=DEVICE)
            for fused in (True, False):
                hidden = (torch.randn(rows, width, device=DEVICE) * 3).to(dtype)
                residual = (torch.randn(rows, width, device=DEVICE) * 5).to(dtype) if fused else None
                with switch_off():
                    kernel = run_body("triton", hidden, residual, slots, *bank.buffers)
                    torch_body = run_body("torch", hidden, residual, slots, *bank.buffers)
                untouched = torch.equal(kernel[1::2], hidden[1::2]) and torch.equal(torch_body[1::2], hidden[1::2])
                if not ((kernel[0::2] != hidden[0::2]).any(-1).all() and (torch_body[0::2] != hidden[0::2]).any(-1).all()):
                    print(f"  {dtype} width {width} {mode}: a marked row was left as it was", flush=True)
                    good = False
                difference = float((summed(kernel, residual) - summed(torch_body, residual)).abs().max()
                                   / summed(torch_body, residual).abs().max())
                worst = max(worst, difference)
                same_bits = torch.equal(kernel, torch_body)
                if mode in ("add", "set") and not norm_match and not same_bits:
                    print(f"  {dtype} width {width} {mode} {'fused' if fused else 'whole'}: bits differ "
                          f"({difference:.3g})", flush=True)
                    good = False
                if not untouched:
                    print(f"  {dtype} width {width} {mode}: an unmarked row changed", flush=True)
                    good = False
        print(f"kernels against the torch body, {dtype}, width {width}: worst relative difference {worst:.3g}",
              flush=True)
    return good


def replay_time(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """Milliseconds a replay of `graph`, after three warm replays."""
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def ops_time(name: str, dtype: torch.dtype = torch.bfloat16, width: int = 4096, rows: int = 256, sites: int = 128,
             harvest: bool = False, steered: int = 0, eager: bool = False, together: bool = False, rounds: int = 1,
             round_by_round: bool = False, neighbours: bool = False, ops_on: bool = True, joined: int = 1) -> float:
    """A captured graph of the edit ops (and harvest ops) at `sites` sites, run by body `name`, `steered` rows
    marked at every site (an ablation), the rest idle: milliseconds a replay. `together`: each site's edit and
    harvest as one `edit_harvest_stream`. `eager`: milliseconds the same calls take uncaptured, host time
    included (a step vLLM runs outside its captured sizes, a large prefill). `rounds`: edit rounds a site, one
    launch for them all (`round_by_round`: a launch a round, the last with the harvest, as before). `neighbours`:
    a small kernel of the model's own before each site (an add over the rows), as the ops sit between vLLM's
    kernels; `ops_on=False` times the neighbours alone. `joined`: sites a launch (`edit_stretch`, the first on
    the hidden half, the rest on the fused stream; `neighbours` then before each launch, not each site)."""
    names = [f"s{number}" for number in range(sites)]
    plan = plans.GraphPlan(names, rounds, max(rows, 256), width, dtype, DEVICE, slots=256,
                           harvest_sites=names if harvest else ())
    if steered:
        plan.enter("r", [plans.PlannedSteer(names, operation("ablate", False, dtype, width, 40),
                                            rules.RowRule.of([0], 1), "r")])
        spans = [Span("r", 0, steered, 1)] + ([Span(None, steered, rows - steered, 0)] if rows > steered else [])
        plan.step(spans)
    hidden = torch.randn(rows, width, device=DEVICE).to(dtype)
    residual = torch.randn_like(hidden)
    views = [plan.rounds_of(site) for site in names]
    other = torch.zeros_like(hidden)

    def run() -> None:
        if joined > 1:
            for start in range(0, sites, joined):
                group = names[start:start + joined]
                if neighbours:
                    other.add_(hidden)
                if ops_on:
                    ops.edit_stretch(hidden, residual, plan.index, *plan.bank.buffers, plan.pool,
                                     [plan.lane_of[(site, 0)] for site in group], rounds,
                                     [plan.harvest_lane_of[site] if harvest else -1 for site in group],
                                     [number > 0 for number in range(len(group))])
            return
        for site, view in zip(names, views):
            if neighbours:
                other.add_(hidden)
            if not ops_on:
                continue
            if round_by_round:
                for round_ in range(rounds - 1):
                    ops.edit_stream(hidden, residual, plan.slots_of(site, round_), *plan.bank.buffers)
                view = plan.slots_of(site, rounds - 1)
            if harvest and together:
                ops.edit_harvest_stream(hidden, residual, view, *plan.bank.buffers, plan.pool,
                                        plan.targets_of(site))
                continue
            ops.edit_stream(hidden, residual, view, *plan.bank.buffers)
            if harvest:
                ops.harvest_stream(plan.pool, hidden, residual, plan.targets_of(site))

    with body(name):
        run()  # compiles the kernels, off the capture
        torch.cuda.synchronize()
        if eager:
            started = time.perf_counter()
            for _ in range(10):
                run()
            torch.cuda.synchronize()
            return 1000 * (time.perf_counter() - started) / 10
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    return replay_time(graph)


def launch_floor(sites: int = 128) -> float:
    """A captured graph of `sites` one-element kernels: what a launch costs on this GPU, milliseconds a replay."""
    scratch = torch.zeros(1, device=DEVICE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(sites):
            scratch.add_(1)
    return replay_time(graph)


def idle_costs() -> None:
    """The ops' cost in a captured graph, the kernels against the torch body, bfloat16, hidden size 4096."""
    floor = launch_floor()
    print(f"launch floor: 128 one-element kernels {floor:.3f} ms a replay, {1000 * floor / 128:.2f} us each",
          flush=True)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("idle edit ops, 128 sites, 256 rows", {}),
        ("idle edit and harvest ops, 128 sites, 256 rows", {"harvest": True}),
        ("idle edit-harvest ops (one launch a site), 128 sites, 256 rows", {"harvest": True, "together": True}),
        ("idle edit ops, 128 sites, 8192 rows", {"rows": 8192}),
        ("edit ops, 128 sites, 256 rows, one row steered at every site", {"steered": 1}),
        ("edit ops, 128 sites, 256 rows, every row steered at every site", {"steered": 256}),
        ("uncaptured idle edit ops, 128 sites, 8192 rows", {"rows": 8192, "eager": True}),
    ]
    for label, options in cases:
        sites = 128
        times = {name: ops_time(name, **options) for name in BODIES}
        print(f"{label}: kernels {times['triton']:.3f} ms for the {sites} sites "
              f"({1000 * times['triton'] / sites:.2f} us a site), torch body {times['torch']:.3f} ms "
              f"({1000 * times['torch'] / sites:.1f} us a site): {times['torch'] / times['triton']:.1f}x", flush=True)


def launch_cuts() -> None:
    """What a site costs idle with the default options (2 rounds and a harvest), bfloat16, 256 rows, 128 sites:
    a launch a round (the last with the harvest) against one launch a site, each as programmatic dependents too;
    alone, and each op after a small kernel of its own (as between a model's kernels)."""
    sites = 128
    for neighbours in (False, True):
        base = ops_time("triton", harvest=True, together=True, rounds=2, neighbours=True, ops_on=False) \
            if neighbours else 0.0
        where = "between small kernels" if neighbours else "alone"
        for label, options in (("a launch a round", {"round_by_round": True}), ("one launch a site", {})):
            for on in (False, True):
                try:
                    with dependent(on):
                        took = ops_time("triton", harvest=True, together=True, rounds=2, neighbours=neighbours,
                                        **options) - base
                except Exception as error:
                    print(f"idle site, {where}, {label}, dependent launch {on}: could not launch "
                          f"({type(error).__name__}: {error})", flush=True)
                    continue
                print(f"idle site, 2 rounds and a harvest, {where}, {label}{', dependent launch' if on else ''}: "
                      f"{1000 * took / sites:.2f} us a site", flush=True)
        # three sites joined (a block's MLP output, its output and the next block's input): one launch for three
        base = ops_time("triton", harvest=True, rounds=2, neighbours=True, ops_on=False, joined=3) \
            if neighbours else 0.0
        for on in (False, True):
            try:
                with dependent(on):
                    took = ops_time("triton", harvest=True, rounds=2, neighbours=neighbours, joined=3) - base
            except Exception as error:
                print(f"idle joined sites, {where}, dependent launch {on}: could not launch "
                      f"({type(error).__name__}: {error})", flush=True)
                continue
            print(f"idle site, 2 rounds and a harvest, {where}, three sites a launch (edit_stretch)"
                  f"{', dependent launch' if on else ''}: {1000 * took / sites:.2f} us a site, "
                  f"{3000 * took / sites:.2f} us a launch", flush=True)


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    good = True
    for name in BODIES:
        with body(name):
            captured = check_capture(torch.float32) and check_capture(torch.bfloat16)
            captured = captured and stretch_ok(torch.float32) and stretch_ok(torch.bfloat16)
            print(f"capture, {name} body:", "ok" if captured else "FAILED", flush=True)
            good = check_operations() and good and captured
    agree = all([check_bodies_agree(torch.float32), check_bodies_agree(torch.bfloat16),
                 check_bodies_agree(torch.float16)])
    print("kernels against the torch body:", "ok" if agree else "FAILED", flush=True)
    try:
        with dependent(True):  # the kernels as programmatic dependents: the same bits
            captured = (check_capture(torch.float32) and check_capture(torch.bfloat16)
                        and stretch_ok(torch.bfloat16))
    except Exception as error:  # this Triton may lack the launch option: say so, and keep the other figures
        print(f"capture, dependent launch: could not launch ({type(error).__name__}: {error})", flush=True)
    else:
        print("capture, dependent launch:", "ok" if captured else "FAILED", flush=True)
        good = good and captured
    good = check_no_wait() and good
    good = check_idle_switch(torch.float32) and check_idle_switch(torch.bfloat16) and good
    good = check_lean_capture(torch.float32) and check_lean_capture(torch.bfloat16) and good
    good = check_compile() and good  # the default body on CUDA: the kernels
    launch_cuts()
    idle_costs()
    return 0 if good and agree else 1


if __name__ == "__main__":
    sys.exit(main())
