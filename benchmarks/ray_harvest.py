"""W1 over Ray: one replica against two, side by side in one run (`streamscope.scale.harvest`).

W1 as benchmarks/gpu_workloads.py defines it: 1,024 prompts of 64-1,024 random tokens (seeded uniform) on the
Llama-3-8B shape (dummy bfloat16 weights, as there), every block's layer_output at the last position. Each
replica is a vLLM engine on one GPU in a Ray actor (``num_gpus=1``). Each run writes its own folder of shards;
the rate counted is the steady one, from the moment every replica has written a shard (every engine is up) to
the last shard's end (start-up is reported apart). Bound: two replicas >= 1.8x one replica's tokens/s.

    python benchmarks/ray_harvest.py                      # on a host with 2+ GPUs (the lent nvidia-h200-x2)
    python benchmarks/ray_harvest.py --gpus-per-replica 0.5   # on one GPU: both replicas share it
    python benchmarks/ray_harvest.py --tiny --engine transformers   # the same code at a tiny shape on this CPU

``--gpus-per-replica 0.5`` runs one replica, then two, each holding half of one GPU (its engine at
``gpu_memory_utilization`` 0.4): it checks the whole Ray path on the GPU engine (actors, shards, the steady
rate) on a one-GPU host, but it is **not** the 1.8x claim: two engines on one GPU share its compute, so their
ratio says how much a second engine fills the GPU's idle time (expect about 1x), not how replicas scale over
GPUs. Only a run with a GPU a replica (the default, 2+ GPUs) is recorded against the bound.

Prints a table and appends it to benchmarks/RESULTS.md with ``--record``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_workloads import build_folder, sizes, token_prompts  # noqa: E402


def run(prompts, folder: Path, out: Path, replicas: int, engine: str, tiny: bool, shard_size: int,
        gpus: float | None = None) -> dict:
    """One harvest of `prompts` on `replicas` engines (each holding `gpus` of a GPU); its wall time, steady tokens/s."""
    import streamscope.scale

    options = {} if engine == "transformers" else {"load_format": "dummy", "max_model_len": sizes(tiny)["max_model_len"],
                                                   "dtype": sizes(tiny)["dtype"]}
    if gpus is not None and gpus < 1 and engine == "vllm":
        options["gpu_memory_utilization"] = round(0.8 * gpus, 2)  # the engines that share a GPU fit side by side
    marks: list[tuple[float, int, int]] = []  # (time, tokens so far, replica) after each shard
    start = time.perf_counter()
    streamscope.scale.harvest(prompts, folder, ["layer_output"], None, "last", out=out, replicas=replicas,
                              engine=engine, engine_options=options, shard_size=shard_size, num_cpus=1, num_gpus=gpus,
                              progress=lambda event: marks.append((time.perf_counter(), event.tokens,
                                                                   event.record["replica"])))
    wall = time.perf_counter() - start
    # Steady: from the moment every replica has written a shard (every engine is up) to the last shard.
    seen: set[int] = set()
    for begin, (moment, tokens, replica) in enumerate(marks):
        seen.add(replica)
        if len(seen) == replicas:
            break
    first_time, first_tokens = marks[begin][0], marks[begin][1]
    last_time, last_tokens = marks[-1][0], marks[-1][1]
    steady = (last_tokens - first_tokens) / (last_time - first_time) if last_time > first_time else float("nan")
    return {"wall": wall, "startup": first_time - start, "steady": steady, "tokens": last_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape and few prompts (this CPU)")
    parser.add_argument("--engine", default="vllm", choices=("vllm", "transformers"))
    parser.add_argument("--shard-size", type=int, default=None, help="prompts per shard (default: 64; tiny 4)")
    parser.add_argument("--gpus-per-replica", type=float, default=None,
                        help="each replica's share of a GPU (default: one GPU; 0.5 runs both replicas on one GPU)")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    import ray
    import torch

    size = sizes(args.tiny)
    prompts = token_prompts(size["w1_prompts"], size["w1_lengths"], seed=1)
    shard_size = args.shard_size or (4 if args.tiny else 64)
    gpus = torch.cuda.device_count()
    share = args.gpus_per_replica
    if share is not None and not 0 < share <= 1:
        raise SystemExit(f"--gpus-per-replica {share}: give a share of one GPU, above 0 and at most 1.")
    if share is not None and gpus == 0:
        raise SystemExit("--gpus-per-replica shares a GPU: this host has none (drop it with --tiny on a CPU).")
    if not args.tiny and gpus * (1 / (share or 1)) < 2:
        raise SystemExit(f"two replicas of the Llama-3-8B shape at {share or 1} GPU each need "
                         f"{2 * (share or 1):g} GPUs; this host has {gpus}. On one GPU run --gpus-per-replica 0.5; "
                         f"on a CPU, --tiny.")
    shared = share is not None and share < 1
    ray.init(num_cpus=2 if args.tiny else None, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            folder = build_folder(Path(scratch) / "model", args.tiny)
            if args.engine == "transformers":  # transformers needs weights: random ones, saved once
                from transformers import AutoConfig, AutoModelForCausalLM

                AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
            one = run(prompts, folder, Path(scratch) / "one", 1, args.engine, args.tiny, shard_size, share)
            two = run(prompts, folder, Path(scratch) / "two", 2, args.engine, args.tiny, shard_size, share)
    finally:
        ray.shutdown()
    ratio = two["steady"] / one["steady"]
    shape = "tiny" if args.tiny else "Llama-3-8B shape"
    placement = f"{share:g} GPU a replica, both on one GPU" if shared else ("a GPU a replica" if gpus else "CPU")
    lines = [f"Ray harvest, W1 ({len(prompts)} prompts, {one['tokens']:,} tokens), {shape}, {args.engine}, {placement}, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "",
             "| replicas | wall s | start-up s | steady tok/s |",
             "| --- | --- | --- | --- |",
             f"| 1 | {one['wall']:.1f} | {one['startup']:.1f} | {one['steady']:,.0f} |",
             f"| 2 | {two['wall']:.1f} | {two['startup']:.1f} | {two['steady']:,.0f} |",
             "",
             f"two replicas: {ratio:.2f}x one replica's steady tokens/s " + (
                 "(not the >= 1.8 claim: two engines sharing one GPU's compute)" if shared else
                 f"(bound >= 1.8{'' if not args.tiny else '; not asked of a tiny run on a shared CPU'})")]
    if ratio != ratio:  # nan: a replica was up only for the last shard
        lines.append("no steady rate: a replica started only as the last shards finished; use more prompts or a "
                     "smaller --shard-size")
    print("\n".join(lines))
    if args.record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as results:
            results.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
