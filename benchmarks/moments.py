"""A direction by running moments (``model.statistics``, ``Client.statistics``) against a bare harvest of its rows.

Issue 42's bound: a difference-of-means direction from ``--prompts`` prompts (100,000 on the H200) by running
moments within 1.05x of a bare harvest's time (the same prompts' ``layer_output`` at the last position of
``--block``), transferring under 1 MB. Over HTTP the server harvests, reduces and adds the rows and sends the
moments (``POST /v1/streamscope/statistics``), against `Client.harvest` downloading every row; in process
(``--in-process``) `model.statistics` against `model.harvest`. Each round times the pair in turn (medians of
``--rounds`` after a warm-up of each), checks that the directions agree, and counts the bytes that cross HTTP
(the response bodies: the moments' safetensors file; the harvest files' tensors).

    python benchmarks/moments.py                                            # tiny, on this CPU
    python benchmarks/moments.py --shape llama3-8b --prompts 100000         # the H200, dummy weights
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import Server, checkpoint  # noqa: E402

KEY = "bench-key"


def prompts_of(count: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of 16-64 random token ids (seeded)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (count,), generator=generator).tolist()
    return [[0] + torch.randint(3, min(vocab, 50_000), (length - 1,), generator=generator).tolist()
            for length in lengths]


def timed(runs: dict, rounds: int) -> dict[str, float]:
    """Median wall seconds of each run, measured in turn round by round (the order flipped every round)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds):
        for name in (list(runs) if index % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def report(title: str, medians: dict[str, float], moment_bytes: int, row_bytes: int, agree: float) -> None:
    ratio = medians["moments"] / medians["bare harvest"]
    print(f"\n{title}")
    for name, median in medians.items():
        print(f"  {name:<13} {median:8.3f} s")
    print(f"  moments / bare harvest: {ratio:.3f}x  (bound 1.05x: {'met' if ratio <= 1.05 else 'not met'})")
    print(f"  bytes: moments {moment_bytes:,}  rows {row_bytes:,}  ({row_bytes / max(moment_bytes, 1):.0f}x fewer; "
          f"under 1 MB: {'yes' if moment_bytes < 2**20 else 'no'})")
    print(f"  largest relative difference of the two directions: {agree:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--block", type=int, default=None, help="the block (default: the middle one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help="also model.statistics against model.harvest")
    args = parser.parse_args()
    import torch

    import streamscope
    from streamscope.directions import from_moments

    folder = Path(tempfile.mkdtemp(prefix="moments-"))
    path, options = checkpoint(args.shape, folder)
    gpu = torch.cuda.is_available()
    share = ["--gpu-memory-utilization", "0.4" if args.in_process else "0.85"] if gpu else []
    server = Server([sys.executable, "-m", "streamscope", "serve", str(path), "--api-key", KEY, *options, *share],
                    folder / "server.log")
    try:
        server.wait_up(time.monotonic() + 900)
        client = streamscope.Client(server.url, api_key=KEY, concurrency=64)
        block = client.num_layers // 2 if args.block is None else args.block
        prompts = prompts_of(args.prompts, client.vocab_size, 0)
        labels = ["a" if index % 2 else "b" for index in range(len(prompts))]

        def by_rows(harvest) -> torch.Tensor:
            rows = harvest.stacked("layer_output")[:, 0, -1].double()
            mask = torch.tensor([label == "a" for label in labels])
            return rows[mask].mean(0) - rows[~mask].mean(0)

        held: dict = {}
        runs = {"bare harvest": lambda: held.update(rows=client.harvest(prompts, "layer_output", layers=[block])),
                "moments": lambda: held.update(moments=client.statistics(prompts, labels, layers=[block],
                                                                         reduce="last"))}
        medians = timed(runs, args.rounds)
        direction = from_moments(held["moments"], "a", "b")[block].vector.double()
        expected = by_rows(held["rows"])
        agree = float((direction - expected).norm() / expected.norm())
        response = client._route("POST", "statistics", json={"prompts": prompts, "labels": labels, "layers": [block],
                                                            "reduce": "last"})
        rows = held["rows"]["layer_output"]
        row_bytes = sum(tensor.numel() * tensor.element_size() for tensor in rows)
        report(f"over HTTP, {args.shape}: {len(prompts)} prompts, layer_output of block {block}", medians,
               len(response.content), row_bytes, agree)
        if args.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            engine_options = {"dtype": options[options.index("--dtype") + 1],
                              "max_model_len": int(options[options.index("--max-model-len") + 1])}
            if "--load-format" in options:
                engine_options["load_format"] = "dummy"
            if gpu:
                engine_options["gpu_memory_utilization"] = 0.4
            model = streamscope.load(str(path), engine="vllm", **engine_options)
            local = {"bare harvest": lambda: held.update(rows=model.harvest(prompts, "layer_output", layers=[block],
                                                                            progress=False)),
                     "moments": lambda: held.update(moments=model.statistics(prompts, labels, layers=[block],
                                                                             reduce="last", progress=False))}
            medians = timed(local, args.rounds)
            direction = from_moments(held["moments"], "a", "b")[block].vector.double()
            expected = by_rows(held["rows"])
            report(f"in process, {args.shape}: the same", medians, held["moments"].nbytes(),
                   sum(t.numel() * t.element_size() for t in held["rows"]["layer_output"]),
                   float((direction - expected).norm() / expected.norm()))
            model.close()
    finally:
        server.close()


if __name__ == "__main__":
    main()
