#!/usr/bin/env python3
"""How vLLM's fused mixture-of-experts kernel rounds in float32 on a GPU, and which oracle measures it: a probe.

The GPU suite holds a float32 vLLM engine to twice the distance a TF32
forward of transformers keeps from its float32 forward (tests/precision.py).
Qwen3-MoE's `mlp.mlp_output` on block 1 came out 3.33e-3 against 3.09e-3
(tests/GPU.md).

`--part model` (the default), per mixture-of-experts family (routing pinned,
as the suite pins it) and block: the relative error of `mlp.mlp_output`
against the exact forward (float32, TF32 off, eager experts) of

  grouped (TF32 off)  transformers' default experts implementation, TF32 off
  grouped             the same, TF32 on (cuBLAS)
  eager               experts as one matmul per expert, TF32 on
  truncated           experts with operands truncated to TF32 (tests/moe_oracle.py), TF32 on elsewhere
  vllm                a float32 vLLM engine, read through streamscope

with the whole checkpoint's measured tolerance taking each as the TF32
forward. Found on the H200 (2026-12-01): `grouped` and `eager` agree to the
digit, so the default implementation was not what left the experts' rounding
out; vLLM's error (3.3e-3) is 2.5 times theirs (1.3e-3).

`--part kernel` runs vLLM's fused MoE kernel (`fused_experts`) alone in
float32 on random inputs (every expert taking every token), beside torch
emulations of the experts whose matmul operands are first cut to TF32's
10-bit mantissa, toward zero (what a tensor core does with the low bits of a
float32 it is handed) and to nearest, and torch with cuBLAS TF32: each against
float64. Found: the kernel matches truncation to 7e-7..9e-5 and sits at
2.1-2.3e-3 from float64, where rounding to nearest and cuBLAS keep 4-7e-4.

Usage (GPU, vLLM 0.22; about a minute each):
    python3 scripts/probe_moe_tf32.py --out $OUT [--part kernel]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))  # the suite's oracle modules import each other by bare names (after vllm)

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
FAMILIES = ("qwen3_moe", "mixtral", "llama4_text")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--part", default="model", choices=("model", "kernel"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "probe_moe.log").open("w")

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    import torch
    from transformers import AutoTokenizer

    import streamscope
    from streamscope.testing import build_checkpoint
    import matrix
    import moe_oracle
    import precision
    from access import relative_error

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    @contextlib.contextmanager
    def tf32():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    say(f"torch {torch.__version__}, device {args.device}")
    if args.part == "kernel":
        kernel(say)
        return
    for family in args.families.split(","):
        try:
            path = build_checkpoint(family, args.out / "ckpt" / family, **precision.every_expert(family))
            ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids.to(args.device)

            def reference(experts: str, context=contextlib.nullcontext):
                # Llama 4's experts are one batched matmul, with no implementation to choose
                chosen = None if family == "llama4_text" else experts
                return matrix.Reference(path, family, ids, device=args.device, context=context, experts=chosen)

            exact = reference("eager")
            blocks = [block for block in range(len(exact.stream["mlp_output"]))]
            rows = {"grouped (TF32 off)": reference("grouped_mm"), "grouped": reference("grouped_mm", tf32),
                    "eager": reference("eager", tf32), "truncated": reference(moe_oracle.TRUNCATED_TF32, tf32)}
            say(f"\n== {family}: mlp.mlp_output relative error against float32 eager experts, TF32 off")
            for label, low in rows.items():
                errors = [relative_error(low.stream["mlp_output"][b], exact.stream["mlp_output"][b]) for b in blocks]
                tolerance = matrix.Tolerances.measured(low, exact, precision.MEASURED_FACTOR).relative
                say(f"  {label:20s} " + " ".join(f"{e:.2e}" for e in errors) + f"   tolerance {tolerance:.2e}")
            del rows
            model = streamscope.load(path, engine="vllm", dtype="float32", gpu_memory_utilization=0.2,
                                     kv_cache_memory_bytes=1 << 30, enforce_eager=True)
            try:
                read = matrix.read(model, [("mlp.mlp_output", block) for block in blocks], PROMPT,
                                   temperature=0.0, max_tokens=1)
                errors = [relative_error(read["mlp.mlp_output", b].to(args.device), exact.stream["mlp_output"][b])
                          for b in blocks]
                say(f"  {'vllm':20s} " + " ".join(f"{e:.2e}" for e in errors))
            finally:
                model.close()
        except Exception:  # the probe goes on to the next family
            say(traceback.format_exc())
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None


def kernel(say) -> None:
    import torch
    import torch.nn.functional as F
    from access import relative_error
    from moe_oracle import truncated_to_tf32
    from vllm.model_executor.layers.fused_moe import fused_experts

    def nearest_tf32(tensor: torch.Tensor) -> torch.Tensor:  # ties away: add half of the dropped unit first
        return truncated_to_tf32((tensor.contiguous().view(torch.int32) + (1 << 12)).view(torch.float32))

    def experts(x, w1, w2, weights, rounding):
        out = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
        for e in range(w1.shape[0]):
            gate_up = rounding(x) @ rounding(w1[e]).T
            gate, up = gate_up.chunk(2, dim=-1)
            out += (rounding(F.silu(gate) * up) @ rounding(w2[e]).T) * weights[:, e:e + 1]
        return out

    for hidden, intermediate, count, tokens in ((64, 128, 4, 12), (64, 96, 4, 12), (256, 512, 8, 64), (1024, 2048, 8, 64)):
        torch.manual_seed(0)
        x = torch.randn(tokens, hidden, device="cuda")
        w1 = torch.randn(count, 2 * intermediate, hidden, device="cuda") / hidden ** 0.5
        w2 = torch.randn(count, hidden, intermediate, device="cuda") / intermediate ** 0.5
        weights = torch.softmax(torch.randn(tokens, count, device="cuda"), dim=-1)
        ids = torch.arange(count, device="cuda", dtype=torch.int32).expand(tokens, count).contiguous()
        exact = experts(x.double(), w1.double(), w2.double(), weights.double(), lambda t: t)
        rows = {"vllm fused_experts": fused_experts(x, w1, w2, weights, ids),
                "torch float32": experts(x, w1, w2, weights, lambda t: t),
                "tf32 truncated": experts(x, w1, w2, weights, truncated_to_tf32),
                "tf32 nearest": experts(x, w1, w2, weights, nearest_tf32)}
        torch.backends.cuda.matmul.allow_tf32 = True
        rows["cuBLAS tf32"] = experts(x, w1, w2, weights, lambda t: t)
        torch.backends.cuda.matmul.allow_tf32 = False
        say(f"\n== fused MoE, hidden {hidden}, intermediate {intermediate}, {count} experts, {tokens} tokens:"
            " relative error against float64")
        for label, value in rows.items():
            say(f"  {label:20s} {relative_error(value, exact):.2e}")
        for label in ("tf32 truncated", "tf32 nearest", "cuBLAS tf32"):
            say(f"  vllm against {label:15s} {relative_error(rows['vllm fused_experts'], rows[label]):.2e}")


if __name__ == "__main__":
    main()
