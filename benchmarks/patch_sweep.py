"""A patching sweep over HTTP (``streamscope.patch(client, ...)``, the server's ``POST patch``) against in process.

Issue 42's bound: every block x 16 positions of ``layer_output`` patched over HTTP within 1.5x of the in-process
`streamscope.patch` on an engine of the same checkpoint and settings. One `streamscope serve` server and one
in-process vLLM engine (its own process too: ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` as a server's), both up for the
whole run; each round times the two in turn (medians of ``--rounds`` after a warm-up of each), and checks that the
effects agree. The server's sweep also runs ``--repeats`` unpatched requests of each prompt for its noise floor
(in process: one of each); ``--repeats 1`` compares like with like.

    python benchmarks/patch_sweep.py                               # tiny, on this CPU
    python benchmarks/patch_sweep.py --shape llama3-8b             # the H200: Llama-3-8B's shape, dummy weights
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

from serve_load import Server, checkpoint, engine_options  # noqa: E402

KEY = "bench-key"


def pair(tokenizer, tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """A clean prompt of `tokens` random ids and its corrupted copy (one id changed in the middle)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    vocab = min(len(tokenizer), 50_000)
    clean = [tokenizer.bos_token_id or 0] + torch.randint(3, vocab, (tokens - 1,), generator=generator).tolist()
    corrupted = list(clean)
    corrupted[tokens // 2] = 3 + (corrupted[tokens // 2] - 3 + 7) % (vocab - 3)
    return clean, corrupted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--positions", type=int, default=16, help="the last N positions are patched")
    parser.add_argument("--repeats", type=int, default=3, help="the server's noise-floor repeats")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    import streamscope

    folder = Path(tempfile.mkdtemp(prefix="patch-sweep-"))
    path, options = checkpoint(args.shape, folder)
    gpu = torch.cuda.is_available()
    share = ["--gpu-memory-utilization", "0.4"] if gpu else []
    # eager hooks, as the in-process engine it is compared with (a GPU server's default is the graph ops)
    server = Server([sys.executable, "-m", "streamscope", "serve", str(path), "--api-key", KEY, "--graph-ops", "off",
                     *options, *share],
                    folder / "server.log")
    settings = engine_options(options, 0.4 if gpu else None)
    try:
        server.wait_up(time.monotonic() + 900)
        model = streamscope.load(str(path), engine="vllm", **settings)
        client = streamscope.Client(server.url, api_key=KEY)
        clean, corrupted = pair(model.tokenizer, args.tokens, 0)
        clean_text, corrupted_text = model.tokenizer.decode(clean[1:]), model.tokenizer.decode(corrupted[1:])
        if len(model.tokenizer(clean_text)["input_ids"]) != len(model.tokenizer(corrupted_text)["input_ids"]):
            corrupted_text = clean_text
        length = len(model.tokenizer(clean_text)["input_ids"])
        positions = list(range(max(0, length - args.positions), length))
        sweep = {"answer": 5, "wrong": 6, "layers": None, "positions": positions}
        runs = {"in process": lambda: streamscope.patch(model, clean_text, corrupted_text, progress=False, **sweep),
                "over HTTP": lambda: client.patch_sweep(clean_text, corrupted_text, repeats=args.repeats, **sweep)}
        results = {name: run() for name, run in runs.items()}  # warm-up, and the check
        gap = float((results["over HTTP"].effects - results["in process"].effects).abs().max())
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_index in range(args.rounds):
            for name in (list(runs) if round_index % 2 == 0 else list(runs)[::-1]):
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(values) for name, values in times.items()}
        ratio = medians["over HTTP"] / medians["in process"]
        patches = model.num_layers * len(positions)
        print(f"\npatch sweep, {args.shape}: {model.num_layers} blocks x {len(positions)} positions = {patches} "
              f"patches of layer_output, {length}-token prompts, {args.rounds} rounds")
        for name, median in medians.items():
            print(f"  {name:<11} {median:8.3f} s   ({patches / median:8.1f} patches/s)")
        print(f"  over HTTP / in process: {ratio:.2f}x  (bound 1.5x: {'met' if ratio <= 1.5 else 'not met'})")
        print(f"  largest |effect difference| {gap:.3g}; the server's noise floor "
              f"{results['over HTTP'].noise:.3g} over {args.repeats} repeats")
        model.close()
    finally:
        server.close()


if __name__ == "__main__":
    main()
