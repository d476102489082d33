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
    python benchmarks/moments.py --in-process --transformers --second        # both engines in process, tiny

``--transformers`` adds the transformers engine in process (the tiny checkpoint only: it has weights), and
``--second`` times second moments too (``hidden x hidden`` float64 a label, added a prompt at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import Server, checkpoint, engine_options  # noqa: E402

KEY = "bench-key"
WARMUP = 2_000  # prompts a warm-up runs


def prompts_of(count: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of 16-64 random token ids (seeded)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (count,), generator=generator).tolist()
    return [[0] + torch.randint(3, min(vocab, 50_000), (length - 1,), generator=generator).tolist()
            for length in lengths]


def timed(runs: dict, rounds: int, warmups: dict | None = None) -> dict[str, float]:
    """Median wall seconds of each run, measured in turn round by round (the order flipped every round).

    Each run is first warmed up once: by its entry in `warmups` where given (the same call on fewer prompts, so
    100,000 prompts are not run twice for a warm-up), else by itself.
    """
    for name, run in runs.items():  # each run said as it ends, so a run cut short by a time limit says how far it got
        start = time.perf_counter()
        (warmups or runs)[name]()
        print(f"  warm-up {name}: {time.perf_counter() - start:.2f} s", flush=True)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds):
        for name in (list(runs) if index % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
            print(f"  round {index + 1} {name}: {times[name][-1]:.2f} s", flush=True)
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


def by_rows(harvest, labels: list[str]):
    """The difference of the two labels' mean rows of a bare harvest (float64): what the moments' direction is."""
    import torch

    rows = harvest.stacked("layer_output")[:, 0, -1].double()
    mask = torch.tensor([label == "a" for label in labels])
    return rows[mask].mean(0) - rows[~mask].mean(0)


def agreement(moments, harvest, labels: list[str], block: int) -> float:
    """The largest relative difference of the direction from the moments and the one from the harvest's rows."""
    from streamscope.directions import from_moments

    direction = from_moments(moments, "a", "b")[block].vector.double()
    expected = by_rows(harvest, labels)
    return float((direction - expected).norm() / expected.norm())


def own_work(model, run, rounds: int) -> tuple[float, float]:
    """Median seconds a `run` of `model.statistics` spends outside its harvests (reducing, adding), and inside.

    On a busy host two whole runs differ by more than the moments' own work; this splits each run, so it is
    what statistics adds to the harvest it reduces, measured in the same run.
    """
    spent: list[float] = []
    cls = type(model)
    harvest = cls.harvest

    def counted(*args, **kwargs):
        start = time.perf_counter()
        try:
            return harvest(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    cls.harvest = counted
    outside, inside = [], []
    try:
        for _ in range(rounds):
            spent.clear()
            start = time.perf_counter()
            run()
            total = time.perf_counter() - start
            inside.append(sum(spent))
            outside.append(total - sum(spent))
    finally:
        cls.harvest = harvest
    return statistics.median(outside), statistics.median(inside)


def in_process(title: str, model, prompts: list, labels: list[str], block: int, rounds: int, second: bool,
               split_rounds: int) -> None:
    """`model.statistics` against `model.harvest` of the same rows, timed in turn (and with second moments)."""
    held: dict = {}

    def runs(prompts: list, labels: list[str]) -> dict:
        local = {"bare harvest": lambda: held.update(rows=model.harvest(prompts, "layer_output", layers=[block],
                                                                        progress=False)),
                 "moments": lambda: held.update(moments=model.statistics(prompts, labels, layers=[block],
                                                                         reduce="last", progress=False))}
        if second:  # what a principal component needs: hidden x hidden float64 a label, added a prompt at a time
            local["+ second"] = lambda: held.update(second=model.statistics(prompts, labels, layers=[block],
                                                                            reduce="last", second=True,
                                                                            progress=False))
        return local

    local = runs(prompts, labels)
    medians = timed(local, rounds, runs(prompts[:WARMUP], labels[:WARMUP]))
    report(title, medians, held["moments"].nbytes(),
           sum(t.numel() * t.element_size() for t in held["rows"]["layer_output"]),
           agreement(held["moments"], held["rows"], labels, block))
    if second:
        print(f"  with second moments / bare harvest: {medians['+ second'] / medians['bare harvest']:.3f}x")
    for name in [name for name in local if name != "bare harvest"] if split_rounds else []:
        outside, inside = own_work(model, local[name], split_rounds)
        print(f"  {name}: its own work outside its harvest {outside * 1e3:.1f} ms a run, {outside / inside:.2%} of "
              f"the harvest inside it ({inside:.3f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--block", type=int, default=None, help="the block (default: the middle one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help="also model.statistics against model.harvest")
    parser.add_argument("--transformers", action="store_true",
                        help="also the transformers engine in process (tiny: its checkpoint has weights)")
    parser.add_argument("--second", action="store_true", help="in process, also time second moments")
    parser.add_argument("--no-http", action="store_true",
                        help="in process only: no server (over HTTP the bare harvest downloads every prompt's row)")
    parser.add_argument("--split-rounds", type=int, default=None,
                        help="runs that split statistics' own work from its harvest (default --rounds; 0: none)")
    args = parser.parse_args()
    if args.transformers and args.shape != "tiny":
        parser.error("--transformers loads the checkpoint's weights: the llama3-8b shape has none (dummy weights "
                     "on vLLM only); use --shape tiny.")
    import torch

    import streamscope

    folder = Path(tempfile.mkdtemp(prefix="moments-"))
    path, options = checkpoint(args.shape, folder)
    gpu = torch.cuda.is_available()
    split_rounds = args.rounds if args.split_rounds is None else args.split_rounds
    config = json.loads((path / "config.json").read_text())
    block = config["num_hidden_layers"] // 2 if args.block is None else args.block
    prompts = prompts_of(args.prompts, config["vocab_size"], 0)
    labels = ["a" if index % 2 else "b" for index in range(len(prompts))]
    print(f"moments.py, {args.shape}: {args.prompts} prompts, layer_output of block {block} (torch "
          f"{torch.__version__})", flush=True)
    if not args.no_http:
        over_http(args, path, options, gpu, prompts, labels, block)
    if args.in_process or args.no_http:
        memory = (0.85 if args.no_http else 0.4) if gpu else None
        started = time.monotonic()
        model = streamscope.load(str(path), engine="vllm", **engine_options(options, memory))
        print(f"the engine up in {time.monotonic() - started:.0f} s", flush=True)
        in_process(f"in process (vLLM), {args.shape}: the same", model, prompts, labels, block, args.rounds,
                   args.second, split_rounds)
        model.close()
    if args.transformers:
        model = streamscope.load(str(path), **({"device_map": "cuda"} if gpu else {}))
        in_process(f"in process (transformers), {args.shape}: the same", model, prompts, labels, block,
                   args.rounds, args.second, split_rounds)


def over_http(args, path: Path, options: list[str], gpu: bool, prompts: list, labels: list[str], block: int) -> None:
    """`Client.statistics` (the server reduces and sends the moments) against `Client.harvest` of every row."""
    import streamscope

    share = ["--gpu-memory-utilization", "0.4" if args.in_process else "0.85"] if gpu else []
    # eager hooks, as the in-process engine it is compared with (a GPU server's default is the graph ops)
    server = Server([sys.executable, "-m", "streamscope", "serve", str(path), "--api-key", KEY, "--graph-ops", "off",
                     *options, *share],
                    path.parent / "server.log")
    try:
        started = time.monotonic()
        server.wait_up(started + 900)
        print(f"the server up in {time.monotonic() - started:.0f} s", flush=True)
        client = streamscope.Client(server.url, api_key=KEY, concurrency=64)
        held: dict = {}

        def runs(prompts: list, labels: list[str]) -> dict:
            return {"bare harvest": lambda: held.update(rows=client.harvest(prompts, "layer_output", layers=[block])),
                    "moments": lambda: held.update(moments=client.statistics(prompts, labels, layers=[block],
                                                                             reduce="last"))}

        medians = timed(runs(prompts, labels), args.rounds, runs(prompts[:WARMUP], labels[:WARMUP]))
        response = client._route("POST", "statistics", json={"prompts": prompts, "labels": labels, "layers": [block],
                                                            "reduce": "last"})
        rows = held["rows"]["layer_output"]
        row_bytes = sum(tensor.numel() * tensor.element_size() for tensor in rows)
        report(f"over HTTP, {args.shape}: {len(prompts)} prompts, layer_output of block {block}", medians,
               len(response.content), row_bytes, agreement(held["moments"], held["rows"], labels, block))
    finally:
        server.close()


if __name__ == "__main__":
    main()
