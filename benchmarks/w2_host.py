"""Where W2's steer written in a trace spends its time over bare generation, taken apart side by side in one run.

W2 (256 prompts x 128 sampled tokens, an invoke per prompt, a vector added to block 16's layer_output at every
step, on an engine tapped there) runs once per variant, the variants alternating round by round, each against
bare generation on the same engine (`gpu_workloads.timed_together`). Each variant removes one part of the trace's
work, so the difference to the full trace is what that part costs:

  bare        vLLM's generate, no trace
  full        the trace as `gpu_trace.py` times it, the vector on the device beforehand ("placed")
  unchecked   the writes' NaN/inf check off
  no edit     each invoke reads the value at every step and edits nothing (nnsight's hand-off and the read)
  inplace     the edit written `current += vector` rather than `current[:] += vector` (no copy back through
              `__setitem__`)

and prints each as a ratio to bare and as microseconds per invoke-step over bare. Then, on the same device, the
cost of the single ops a step's invoke runs (an add on a [1, hidden] tensor, a slice, entering
`inference_mode(False)`, a greenlet round trip), in a burst (the host's) and sustained, and with ``--spy SECONDS``, py-spy's sampled stacks of the full
trace (its binary on the path; its raw output under ``--out``), summarised by function.

    python benchmarks/w2_host.py --out /tmp/w2     # the H200 shape on a GPU
    python benchmarks/w2_host.py --tiny --out /tmp/w2   # the code path on this CPU
    python benchmarks/w2_host.py --tiny --prompts 64 --tokens 64 --rounds 5   # a CPU figure of the per-step work
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_workloads import (bare_w2, build_folder, engine_kwargs, sizes, timed_together, token_prompts,  # noqa: E402
                           traced_w2)


def with_setting(run, module, name: str, value):
    """`run` with `module.name` set to `value` while it runs."""
    def changed():
        before = getattr(module, name)
        setattr(module, name, value)
        try:
            run()
        finally:
            setattr(module, name, before)
    return changed


def op_costs(device: str, dtype, hidden: int, repeats: int = 20000) -> dict[str, tuple[float, float]]:
    """Microseconds per call of the single ops an invoke-step runs, on `device`: in a burst of 100 (the host's
    cost of a call), and sustained over `repeats` with the device waited for at the end (the slower of the
    host and the device)."""
    import torch
    from greenlet import greenlet, getcurrent

    def synchronize():
        if device != "cpu":
            torch.cuda.synchronize()

    a = torch.randn(8, hidden, device=device, dtype=dtype)
    b = torch.randn(8, hidden, device=device, dtype=dtype)
    row, vector = a[3:4], torch.randn(hidden, device=device, dtype=dtype)

    def add():
        row + b[3:4]

    def add_():
        row.add_(vector)

    def slice_iadd():
        row[:] += vector

    def narrow():
        a.narrow(0, 3, 1)

    def outside_inference():
        with torch.inference_mode(False):
            pass

    def row_sum():
        row.sum(dtype=torch.float32)

    def round_trip():
        worker.switch()

    def body():
        parent = getcurrent().parent
        while True:
            parent.switch()

    worker = greenlet(body)
    costs = {}
    with torch.inference_mode():
        for name, function in [("add of two [1, hidden] rows", add), ("add_ of a vector", add_),
                               ("view[:] += vector (add_ then copy_)", slice_iadd), ("narrow", narrow),
                               ("inference_mode(False) enter and exit", outside_inference),
                               ("sum to float32", row_sum), ("greenlet round trip", round_trip)]:
            for _ in range(200):
                function()
            synchronize()
            start = time.perf_counter()
            for _ in range(100):  # a burst the device's queue takes without pushing back: the host's cost
                function()
            burst = time.perf_counter() - start
            synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                function()
            synchronize()
            costs[name] = (burst / 100 * 1e6, (time.perf_counter() - start) / repeats * 1e6)
    return costs


def spy(run, seconds: float, out: Path) -> None:
    """py-spy's samples of `run`, repeated for `seconds`, summarised by function (own and inclusive share)."""
    binary = shutil.which("py-spy")
    if binary is None:
        print("py-spy: not on the path, no samples", flush=True)
        return
    raw = out / "w2-spy.txt"
    recorder = subprocess.Popen([binary, "record", "--pid", str(os.getpid()), "--rate", "250", "--duration",
                                 str(int(seconds)), "--format", "raw", "--output", str(raw), "--nonblocking"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(2)
    start = time.monotonic()
    while time.monotonic() - start < seconds + 1:
        run()
    output = recorder.communicate(timeout=120)[0].decode(errors="replace")
    if not raw.exists():
        print(f"py-spy wrote nothing: {output.strip()[-500:]}", flush=True)
        return
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        total += samples
        frames = [frame.split(":")[0] for frame in stack.split(";")]
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    print(f"\npy-spy, {total} samples of the full trace; inclusive share by function:")
    for frame, samples in inclusive.most_common(60):
        print(f"  {samples / total * 100:5.1f}%  {frame}")
    print("own share:")
    for frame, samples in own.most_common(40):
        print(f"  {samples / total * 100:5.1f}%  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spy", type=float, default=0.0, help="seconds of py-spy samples of the full trace")
    parser.add_argument("--prompts", type=int, help="this many prompts (invokes) instead of the shape's")
    parser.add_argument("--tokens", type=int, help="this many generated tokens (steps) instead of the shape's")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="w2-host-")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    import streamscope
    from streamscope import nonfinite, values

    settings = sizes(args.tiny)
    folder = build_folder(Path(tempfile.mkdtemp(prefix="w2-host-")), args.tiny)
    block = settings["steer_block"]
    kwargs = engine_kwargs(settings, args.tiny)
    if not args.tiny:
        kwargs["gpu_memory_utilization"] = 0.8
    model = streamscope.load(folder, engine="vllm", taps=[f"layers.{block}.layer_output"], **kwargs)
    prompts = token_prompts(args.prompts or settings["w2_prompts"], settings["w2_lengths"], 2)
    tokens = args.tokens or settings["w2_tokens"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, settings["dtype"])
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    if device == "cpu":
        nonfinite.READ_ON_THE_HOST = False  # the device's path: scans read in batches, not at the write
    full = traced_w2(model, prompts, tokens, block, vector)
    arms = {
        "bare": bare_w2(model.vllm_entrypoint, prompts, tokens),
        "full": full,
        "unchecked": with_setting(full, values, "WARN_NON_FINITE", False),
        "no edit": traced_w2(model, prompts, tokens, block, vector, edit="none"),
        "inplace": traced_w2(model, prompts, tokens, block, vector, edit="inplace"),
    }
    times = timed_together(arms, args.rounds)
    steps = len(prompts) * tokens
    bare = times["bare"]
    print(f"\nW2 on {device}: {len(prompts)} invokes x {tokens} steps, {args.rounds} rounds (medians)")
    for name, seconds in times.items():
        print(f"  {name:10s} {seconds:8.3f} s  {seconds / bare:5.2f}x bare  "
              f"{(seconds - bare) / steps * 1e6:7.1f} us an invoke-step over bare", flush=True)
    print(f"\nsingle ops on {device} ({dtype}, [1, {model.hidden_size}]), us a call: a burst of 100 (the host's "
          f"cost), then sustained (the host's or the device's, whichever is slower)")
    for name, (burst, sustained) in op_costs(device, dtype, model.hidden_size).items():
        print(f"  {burst:7.2f} {sustained:7.2f}  {name}", flush=True)
    if args.spy:
        spy(full, args.spy, args.out)
    model.close()


if __name__ == "__main__":
    main()
