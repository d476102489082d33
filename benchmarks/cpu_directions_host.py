"""The host work issue 21's steers and SAE runs add per step, per hook and per call, on this CPU.

The GPU figures of `gpu_directions.py` hinge on work that does not depend on
the accelerator: what the client sends the engine's workers per run, the
bookkeeping per step, and the Python and tensor operations per hook call. On
a tiny Llama shape (`gpu_workloads.TINY`, with `--layers` blocks) and an
engine in this process, this prints, for a generation with an ablation at
every block:

  steps           engine steps of the run
  rows ms/step    host time of the per-step row bookkeeping (all steers)
  hook us/call    host time of one hook call (its tensor work included: on a CPU it runs there)
  ops/hook        tensor operations one hook call dispatches (counted, so not subject to the CPU's load)

and for a harvest with an SAE of width 16 x hidden, and a generation with a
feature of it clamped: the bytes of each run's plan, first run and later.
Run it against two checkouts (PYTHONPATH) to compare them; the wall times
are noisy on a shared CPU, the op counts and bytes are exact.

    PYTHONPATH=$PWD python benchmarks/cpu_directions_host.py --layers 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_workloads as workloads  # noqa: E402  (its folder, tiny shape and prompts)


class OpCounter:
    """Counts the tensor operations dispatched while it is on (a TorchDispatchMode)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self.mode = Mode


def instrumented(run, counting: bool) -> dict:
    """Run `run` with the Applier's per-step bookkeeping and hook calls timed (and their ops counted)."""
    from streamscope.bulk import apply

    spent = {"rows": [], "hooks": []}
    ops = OpCounter()
    original_step, original_apply = apply.Applier.step, apply.Applier._apply_all

    def step(self, spans):
        start = time.perf_counter()
        try:
            return original_step(self, spans)
        finally:
            spent["rows"].append(time.perf_counter() - start)

    def apply_all(self, work, raw):
        start = time.perf_counter()
        try:
            if counting:
                with ops.mode():
                    return original_apply(self, work, raw)
            return original_apply(self, work, raw)
        finally:
            spent["hooks"].append(time.perf_counter() - start)

    apply.Applier.step, apply.Applier._apply_all = step, apply_all
    try:
        run()
    finally:
        apply.Applier.step, apply.Applier._apply_all = original_step, original_apply
    return {"steps": len(spent["rows"]), "rows_ms": statistics.median(spent["rows"]) * 1e3,
            "hook_us": statistics.median(spent["hooks"]) * 1e6, "ops": ops.count / max(1, len(spent["hooks"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    import streamscope
    from gpu_directions import random_sae

    workloads.TINY["num_hidden_layers"] = args.layers
    settings = workloads.sizes(True)
    with tempfile.TemporaryDirectory() as folder:
        workloads.build_folder(Path(folder), True)
        model = streamscope.load(folder, engine="vllm", **workloads.engine_kwargs(settings, True))
        try:
            torch.manual_seed(0)
            direction = torch.randn(model.hidden_size)
            ablations = [streamscope.Steer("layer_output", layer, direction, mode="ablate")
                         for layer in range(model.num_layers)]
            prompts = workloads.token_prompts(args.prompts, (8, 32), 2)
            sampling = {"max_tokens": args.tokens, "temperature": 1.0, "seed": 0, "ignore_eos": True,
                        "progress": False}

            def ablate():
                return model.generate(prompts, steer=ablations, **sampling)

            ablate()  # warm-up
            runs = [instrumented(ablate, counting=False) for _ in range(args.rounds)]
            counted = instrumented(ablate, counting=True)
            print(f"ablate at every block ({args.layers} blocks, {args.prompts} prompts x {args.tokens} tokens): "
                  f"steps {runs[0]['steps']}, rows {statistics.median(r['rows_ms'] for r in runs):.3f} ms/step, "
                  f"hook {statistics.median(r['hook_us'] for r in runs):.0f} us/call, "
                  f"ops/hook {counted['ops']:.1f}")

            sae = random_sae(model.hidden_size, 16 * model.hidden_size, "layer_output", 1, "cpu")
            sizes: list[int] = []
            entry = model.vllm_entrypoint
            original = entry.collective_rpc

            def spy(method, *rest, **kwargs):
                if method == "streamscope_bulk_begin":
                    sizes.append(len(kwargs["args"][0]))
                return original(method, *rest, **kwargs)

            entry.collective_rpc = spy
            try:
                for _ in range(2):
                    model.harvest(prompts, sae=sae, positions="last", top_k=8, progress=False)
                for _ in range(2):
                    model.generate(prompts[:8], steer=[sae.clamp(0, 4.0)], **sampling)
            finally:
                del entry.collective_rpc
            weights = sum(tensor.numel() * 4 for tensor in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec))
            print(f"SAE {sae.d_in} -> {sae.d_sae} ({weights / 2**20:.1f} MiB): plan bytes, harvest "
                  f"{sizes[0]:,} then {sizes[1]:,}; clamp {sizes[2]:,} then {sizes[3]:,}")
        finally:
            model.close()


if __name__ == "__main__":
    main()
