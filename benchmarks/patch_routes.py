"""`streamscope.patch` on vLLM by its two routes, against the same number of plain forwards, in process CPU time.

The bulk route (each patch a request of one bulk run with its own ``set`` steer, `Engine.set_each`) and the trace
route (each patch a trace invoke, `Engine.run_each`, the route before issue 24), on gpu_workloads' tiny Llama
(or ``--full``: the Llama-3-8B shape, for a GPU), ``layer_output`` over every block and the last ``--positions``
positions of a ``--tokens``-token pair. Each round times the three in turn (medians of ``--rounds``). Figures are
this process's CPU time (the engine runs in it: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and wall time: on a CPU
shared with other jobs, CPU time is what the host work of a route costs, whatever else the machine runs.

    python benchmarks/patch_routes.py                  # tiny, on this CPU
    python benchmarks/patch_routes.py --full           # the H200's shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_workloads import bare_w1, build_folder, engine_kwargs, sizes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the Llama-3-8B shape (a GPU)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--positions", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tiny = not args.full
    import torch
    from vllm.platforms import current_platform

    import streamscope

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    settings = sizes(tiny)
    model = streamscope.load(build_folder(Path(tempfile.mkdtemp(prefix="patch-routes-")), tiny), engine="vllm",
                             **engine_kwargs(settings, tiny))
    generator = torch.Generator().manual_seed(4)
    clean_ids = [0] + torch.randint(3, 512, (args.tokens - 1,), generator=generator).tolist()
    corrupted_ids = list(clean_ids)
    corrupted_ids[args.tokens // 2] = 3 + (corrupted_ids[args.tokens // 2] - 3 + 7) % 509
    tokenizer = model.tokenizer
    clean, corrupted = tokenizer.decode(clean_ids[1:]), tokenizer.decode(corrupted_ids[1:])
    if len(tokenizer(clean)["input_ids"]) != len(tokenizer(corrupted)["input_ids"]):
        corrupted = clean
    length = len(tokenizer(clean)["input_ids"])
    positions = list(range(max(0, length - args.positions), length))
    count = model.num_layers * len(positions) + 2
    kind = type(model.engine)
    settable = kind.settable

    def patch() -> None:
        streamscope.patch(model, clean, corrupted, lambda logits: logits[5] - logits[6], positions=positions,
                          progress=False)

    def traced() -> None:
        kind.settable = lambda self, value, block: "the trace route, for the benchmark"
        try:
            patch()
        finally:
            kind.settable = settable

    runs = {"forwards": bare_w1(model.vllm_entrypoint, [tokenizer(corrupted)["input_ids"]] * count),
            "bulk": patch, "trace": traced}
    for run in runs.values():
        run()
    cpu: dict = {name: [] for name in runs}
    wall: dict = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            started, started_cpu = time.perf_counter(), time.process_time()
            run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            cpu[name].append(time.process_time() - started_cpu)
            wall[name].append(time.perf_counter() - started)
    print(f"patch_routes.py  {'tiny' if tiny else 'Llama-3-8B shape'}  {settings['dtype']}  "
          f"{model.num_layers} blocks x {len(positions)} positions of {length} tokens = {count - 2} patches; "
          f"torch threads {torch.get_num_threads()}; rounds {args.rounds}; {os.getloadavg()[0]:.1f} load")
    print(f"{'':10} {'cpu s':>8} {'ratio':>7} {'wall s':>8} {'ratio':>7}")
    for name in runs:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        print(f"{name:10} {c:8.3f} {c / statistics.median(cpu['forwards']):6.2f}x {w:8.3f} "
              f"{w / statistics.median(wall['forwards']):6.2f}x")
    model.close()


if __name__ == "__main__":
    main()
