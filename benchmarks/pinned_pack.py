"""The graph plan's pack of a step's index lanes into pinned memory (`GraphPlan._pack`), alone, on the device's host.

On the H200 host (2026-12-07) a bulk run's prefill step spent about 10 ms in `_pack` under cProfile: 32 lanes of
8,192 rows (1 MiB) gathered from the host index into a pinned staging buffer, where this CPU takes 0.02-0.2 ms into
pageable memory. This times the same gather by each way the plan could do it, into pinned and into pageable
memory, and the host-to-device copy after it, so that the cause (the gather, the pinned pages, the host) is
measured where it happens. It needs torch and numpy only (no vLLM, no streamscope), so it runs on a fresh device
machine before any wheel is carried:

    python3 benchmarks/pinned_pack.py            # on the device machine (its image has torch)
    python3 benchmarks/pinned_pack.py --rows 4000
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def timed(function, repeat: int) -> float:
    """Median milliseconds of `function` over `repeat` calls, after one."""
    function()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--columns", type=int, default=392, help="the index's columns (the 8B shape's: 384 lanes, "
                                                                   "8 harvest sites)")
    parser.add_argument("--rows", type=int, default=8192, help="the step's rows (max_num_batched_tokens)")
    parser.add_argument("--lanes", type=int, default=32, help="the lanes a step packs (an edit at every block)")
    parser.add_argument("--repeat", type=int, default=50)
    options = parser.parse_args()
    columns, rows, count = options.columns, options.rows, options.lanes
    host = np.full((columns, rows), -1, dtype=np.int32)
    lanes = list(range(0, 12 * count, 12)) if 12 * count <= columns else list(range(count))
    spaced = slice(lanes[0], lanes[-1] + 1, lanes[1] - lanes[0])
    cuda = torch.cuda.is_available()
    buffers = {"pageable": torch.empty(columns * rows, dtype=torch.int32)}
    if cuda:
        buffers["pinned"] = torch.empty(columns * rows, dtype=torch.int32, pin_memory=True)
    print(f"pack of {count} lanes x {rows} rows ({count * rows * 4 / 2**20:.2f} MiB) of a [{columns}, {rows}] int32 "
          f"index, medians of {options.repeat} (ms):")
    for name, buffer in buffers.items():
        out = buffer.numpy()[:count * rows].reshape(count, rows)
        ways = {
            "np.take (raise)": lambda: np.take(host[:, :rows], lanes, axis=0, out=out),
            "np.take (clip)": lambda: np.take(host[:, :rows], lanes, axis=0, out=out, mode="clip"),
            "strided slice": lambda: out.__setitem__(slice(None), host[spaced, :rows]),
            "fill (memset)": lambda: out.fill(-1),
        }
        for way, function in ways.items():
            print(f"  {name:9s} {way:16s} {timed(function, options.repeat):8.3f}")
    if cuda:
        device = torch.empty(columns * rows, dtype=torch.int32, device="cuda")
        for name, buffer in buffers.items():
            def copy() -> None:
                device[:count * rows].copy_(buffer[:count * rows], non_blocking=True)
                torch.cuda.synchronize()
            print(f"  {name:9s} {'to the device':16s} {timed(copy, options.repeat):8.3f}")
        print(f"  device: {torch.cuda.get_device_name()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
