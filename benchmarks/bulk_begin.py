"""The begin of a bulk run: each request's entry into the applier and the graph plan, before the engine's first step.

W2's requests (256 prompts of 32-256 tokens) with an ablation at every block, on an engine with the graph ops: the
worker's begin (`streamscope.vllm.bulk._begin`: the run's steers checked, each request's entries made, its steers
divided between the ops and the hooks, its slots and table row taken) is timed where it runs, one `generate` of
one token after another, and printed as milliseconds a run and microseconds a request. On the H100 (2026-12-07)
the in-process ablation at every block was 0.31 s over streamscope's `generate` with no steer; this says how much
of it the begin is on this machine.

    python benchmarks/bulk_begin.py                       # the tiny 32-block shape, on the CPU
    python benchmarks/bulk_begin.py --shape llama3-8b     # the 8B shape, on a GPU

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its worker's begin is this process's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: The tiny shape: as many blocks as the 8B shape (the begin's work is per block and request), a narrow stream.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 32, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 512}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()

    import torch

    import gpu_workloads as workloads
    import streamscope
    import streamscope.vllm.bulk as bulk

    with tempfile.TemporaryDirectory() as folder:
        tiny = options.shape == "tiny"
        if tiny:
            from transformers import LlamaConfig

            from streamscope.testing.tokenizer import save_tokenizer

            LlamaConfig(**TINY, bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(folder)
            save_tokenizer(Path(folder), vocab_size=TINY["vocab_size"])
            kwargs = {"load_format": "dummy", "dtype": "float32", "max_model_len": 512}
        else:
            workloads.build_folder(Path(folder), False)
            kwargs = {**workloads.engine_kwargs(workloads.sizes(False), False), "enforce_eager": False}
        model = streamscope.load(folder, engine="vllm", graph_ops=True, **kwargs)
        times: list[float] = []
        begin = bulk._begin

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return begin(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - start)

        bulk._begin = timed
        try:
            direction = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0))
            ablations = [streamscope.Steer("layer_output", layer, direction, mode="ablate", positions="all")
                         for layer in range(model.num_layers)]
            rng = random.Random(0)
            prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(32, 257))]
                       for _ in range(options.prompts)]
            for _ in range(options.rounds + 1):  # the first warms up
                model.generate(prompts, steer=ablations, max_tokens=1, progress=False)
        finally:
            bulk._begin = begin
            model.close()
    rounds = times[-options.rounds:]
    middle = statistics.median(rounds)
    print(f"bulk_begin.py: {options.shape}, {options.prompts} requests x {len(ablations)} ablations (every block); "
          f"begin {middle * 1e3:.1f} ms a run (median of {options.rounds}; min {min(rounds) * 1e3:.1f}, max "
          f"{max(rounds) * 1e3:.1f}), {middle / options.prompts * 1e6:.0f} us a request")


if __name__ == "__main__":
    main()
