"""Issue 21's speed bounds on one run: ablation at every block, an SAE clamp, and an SAE harvest, against bare.

On a Llama-3-8B-shape checkpoint with dummy bfloat16 weights (the folder and
helpers of `gpu_workloads.py`), for an eager engine and for one started with
taps at every block's output (CUDA graphs replayed for decode steps), in
turn, one engine at a time, interleaved round by round (medians):

  bare        256 prompts x 128 sampled tokens, bare vLLM on the same engine
  ablate      the same with `Steer(mode="ablate")` at every block's layer_output
  sae_clamp   the same with one SAE feature (width 16 x hidden) clamped at block 16
  dense       `model.harvest` of block 16's layer_output at the last position, 1,024 prompts
  sae         `model.harvest(..., sae=...)` of the same SAE's top-64 features at the last position

and prints the ratios against the bounds: ablate <= 1.15 x bare with graphs,
sae <= 1.2 x dense. `--only ablate` (bare and ablate), `--only clamp` (bare and
sae_clamp) or `--only harvest` (dense and sae) measures one pair, and
`--engines tapped` (or `eager`) one engine, to spend less device time.
`--tiny` runs it at a tiny shape on the CPU (a check that it runs, not a
measurement). Record figures in benchmarks/RESULTS.md.

    python benchmarks/gpu_directions.py              # on the H200
    python benchmarks/gpu_directions.py --only ablate --engines tapped   # the ablation's bound alone
    python benchmarks/gpu_directions.py --tiny --rounds 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_workloads as workloads  # noqa: E402  (its folder, sizes, prompts and timing)


def random_sae(width: int, features: int, value: str, layer: int, device: str):
    import torch

    from streamscope.sae import SAE

    generator = torch.Generator().manual_seed(0)
    return SAE(torch.randn(width, features, generator=generator) / width ** 0.5, torch.zeros(features),
               torch.randn(features, width, generator=generator) / features ** 0.5, torch.zeros(width),
               value, layer).to(torch.float32, device)


#: --only's pairs: the workloads each measures.
PAIRS = {"all": ("bare", "ablate", "sae_clamp", "dense", "sae"), "ablate": ("bare", "ablate"),
         "clamp": ("bare", "sae_clamp"), "harvest": ("dense", "sae")}


def measure(folder: Path, tiny: bool, rounds: int, tapped: bool, only: str = "all", profile: bool = False) -> dict:
    import torch

    import streamscope

    settings = workloads.sizes(tiny)
    block = settings["steer_block"]
    taps = {"taps": ["layers.*.layer_output"]} if tapped else {}
    model = streamscope.load(folder, engine="vllm", **taps, **workloads.engine_kwargs(settings, tiny))
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        wanted = PAIRS[only]
        sae = (random_sae(model.hidden_size, 16 * model.hidden_size, "layer_output", block, device)
               if {"sae_clamp", "sae"} & set(wanted) else None)  # 2 GiB at the full shape: made where measured
        torch.manual_seed(0)
        direction = torch.randn(model.hidden_size)
        ablations = [streamscope.Steer("layer_output", layer, direction, mode="ablate")
                     for layer in range(model.num_layers)]
        prompts = workloads.token_prompts(settings["w2_prompts"], settings["w2_lengths"], 2)
        harvest_prompts = workloads.token_prompts(settings["w1_prompts"], settings["w1_lengths"], 1)
        count = settings["w2_tokens"]
        sampling = {"max_tokens": count, "temperature": 1.0, "seed": 0, "ignore_eos": True, "progress": False}
        workloads_by_name = {
            "bare": workloads.bare_w2(model.vllm_entrypoint, prompts, count),
            "ablate": lambda: model.generate(prompts, steer=ablations, **sampling),
            "sae_clamp": lambda: model.generate(prompts, steer=[sae.clamp(0, 4.0)], **sampling),
            "dense": lambda: model.harvest(harvest_prompts, "layer_output", layers=[block], progress=False),
            "sae": lambda: model.harvest(harvest_prompts, sae=sae, positions="last", top_k=64, progress=False),
        }
        times = workloads.timed_together({name: workloads_by_name[name] for name in wanted}, rounds)
        if profile:
            where_the_time_goes({name: workloads_by_name[name] for name in wanted})
        return times
    finally:
        model.close()


def where_the_time_goes(runs: dict) -> None:
    """One more run of each workload under cProfile (the engine is in this process): own time by group and the
    top functions (`profile_trace.table`), so a workload's extra time over bare can be placed."""
    from profile_trace import profiled, table

    for name, run in runs.items():
        profile, wall = profiled(run)
        print(f"\n{name} under cProfile: {wall:.3f} s", flush=True)
        table(profile, wall, 25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=list(PAIRS), default="all", help="one pair of workloads")
    parser.add_argument("--engines", choices=["both", "eager", "tapped"], default="both")
    parser.add_argument("--profile", action="store_true", help="then each workload once more under cProfile")
    args = parser.parse_args()
    engines = {"both": (False, True), "eager": (False,), "tapped": (True,)}[args.engines]
    with tempfile.TemporaryDirectory() as folder:
        workloads.build_folder(Path(folder), args.tiny)
        for tapped in engines:
            times = measure(Path(folder), args.tiny, args.rounds, tapped, args.only, args.profile)
            name = "tapped (graphs)" if tapped else "eager"
            print(f"{name}: " + ", ".join(f"{key} {value:.3f}s" for key, value in times.items()))
            if "ablate" in times:
                print(f"  ablate at every block / bare: {times['ablate'] / times['bare']:.3f}"
                      + (" (bound 1.15 with graphs)" if tapped else ""))
            if "sae_clamp" in times:
                print(f"  SAE clamp at one block / bare: {times['sae_clamp'] / times['bare']:.3f}")
            if "sae" in times:
                print(f"  SAE harvest (16x, top-64, last position) / dense last-position harvest: "
                      f"{times['sae'] / times['dense']:.3f} (bound 1.2)")


if __name__ == "__main__":
    main()
