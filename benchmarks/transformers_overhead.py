"""What streamscope's reads cost over raw nnsight on transformers, side by side in one run.

Builds a random-weight Llama checkpoint folder (config, safetensors, a tokenizer
trained here), loads it once with `streamscope.load` (which *is* nnsight's
TransformersModel), and times on that one model object, interleaved, the same
input every time:

  plain-hf      the bare Hugging Face module's forward, no nnsight
  plain-trace   an nnsight trace that reads nothing
  raw-out       raw nnsight, ``model.model.layers[i].output.save()`` for every block
  ss-out        streamscope, ``model.layers[i].layer_output.save()`` for every block
  raw-six       raw nnsight at the six module sites the boundaries sit on (block
                input, input_layernorm output, post_attention_layernorm input and
                output, mlp input, block output) for every block
  ss-six        streamscope, all six boundaries of every block (``Layer.ORDER``)
  raw-out+clone, raw-six+clone
                raw nnsight with ``.clone()`` before ``.save()``: streamscope's
                contract serves a private copy, so these say how much of any gap
                is that copy and how much is the rest of the machinery

The verdict compares ss-out/raw-out and ss-six/raw-six against a bound (5%).

``--check-split`` also reads the six boundaries of every block plus the root
values (token_embeddings, final_norm_output, logits) with streamscope on the
single-device model and on a split one, and compares every value:

  offload       the checkpoint loaded with a ``device_map`` that puts the second half
                of the blocks, the final norm and the head on the CPU (transformers
                hands it to accelerate, which keeps those weights in CPU memory and
                runs those modules on the GPU);
  cpu-compute   the second half of the blocks, the norm and the head of the
                single-device model moved to the CPU and run there (runs last).

    python benchmarks/transformers_overhead.py                     # CPU, 8 x 1024, seq 256
    python benchmarks/transformers_overhead.py --layers 32 --hidden 4096 --heads 32 \\
        --kv-heads 8 --intermediate 14336 --vocab 128256 --seq 512 --batch 8 \\
        --dtype bfloat16 --device cuda --check-split
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import streamscope  # noqa: E402
from streamscope.testing.tokenizer import save_tokenizer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_VOCAB = 512  # the tokenizer trained here; input ids are drawn below it


# -- the checkpoint ----------------------------------------------------------------------------


def build_checkpoint(path: Path, args: argparse.Namespace) -> Path:
    """A random-weight Llama folder at `path`, built on `args.init_device` and saved as safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    stamp = path / "benchmark-shape.json"
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate",
                                           "vocab", "checkpoint_dtype", "seed")}
    if stamp.exists() and json.loads(stamp.read_text()) == shape:
        print(f"# checkpoint: reusing {path}", flush=True)
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(8192, args.seq),
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    with torch.device(args.init_device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.checkpoint_dtype])
    with torch.no_grad():  # random, not the initial 1.0: a norm read before/after its weight differs
        generator = torch.Generator(device=args.init_device).manual_seed(args.seed + 1)
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator,
                                                 device=parameter.device, dtype=parameter.dtype))
    if args.init_device != "cpu":
        torch.cuda.synchronize()
    built = time.perf_counter()
    model.save_pretrained(str(path), max_shard_size="5GB")
    save_tokenizer(path, vocab_size=TOKENIZER_VOCAB)
    del model
    stamp.write_text(json.dumps(shape))
    params = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"# checkpoint: built in {built - started:.1f}s on {args.init_device}, saved "
          f"{params / 2**30:.2f} GiB in {time.perf_counter() - built:.1f}s to {path}", flush=True)
    return path


# -- the variants ------------------------------------------------------------------------------
#
# Each reads the same input, runs under the same grad mode, and returns what it saved, so
# the time covers the trace, the reads and the saves. The raw ones read through nnsight's own
# `.input`/`.output` on the same model object streamscope serves from.


def plain_hf(model, ids, n):
    return model._module(ids, use_cache=False).logits


def plain_trace(model, ids, n):
    with model.trace(ids, use_cache=False):
        pass
    return None


def raw_out(model, ids, n):
    saved = {}
    with model.trace(ids, use_cache=False):
        for i in range(n):
            saved[i] = model.model.layers[i].output.save()
    return saved


def raw_out_clone(model, ids, n):
    saved = {}
    with model.trace(ids, use_cache=False):
        for i in range(n):
            saved[i] = model.model.layers[i].output.clone().save()
    return saved


def ss_out(model, ids, n):
    saved = {}
    with model.trace(ids, use_cache=False):
        for i in range(n):
            saved[i] = model.layers[i].layer_output.save()
    return saved


def raw_six(model, ids, n):
    saved = {}
    with model.trace(ids, use_cache=False):
        for i in range(n):
            block = model.model.layers[i]
            saved[i, 0] = block.input.save()
            saved[i, 1] = block.input_layernorm.output.save()
            saved[i, 2] = block.post_attention_layernorm.input.save()
            saved[i, 3] = block.post_attention_layernorm.output.save()
            saved[i, 4] = block.mlp.input.save()
            saved[i, 5] = block.output.save()
    return saved


def raw_six_clone(model, ids, n):
    saved = {}
    with model.trace(ids, use_cache=False):
        for i in range(n):
            block = model.model.layers[i]
            saved[i, 0] = block.input.clone().save()
            saved[i, 1] = block.input_layernorm.output.clone().save()
            saved[i, 2] = block.post_attention_layernorm.input.clone().save()
            saved[i, 3] = block.post_attention_layernorm.output.clone().save()
            saved[i, 4] = block.mlp.input.clone().save()
            saved[i, 5] = block.output.clone().save()
    return saved


def ss_six(model, ids, n):
    saved = {}
    with model.trace(ids, use_cache=False):
        for i in range(n):
            block = model.layers[i]
            saved[i, 0] = block.layer_input.save()
            saved[i, 1] = block.attention_norm_output.save()
            saved[i, 2] = block.layer_mid.save()
            saved[i, 3] = block.mlp_norm_output.save()
            saved[i, 4] = block.mlp_input.save()
            saved[i, 5] = block.layer_output.save()
    return saved


VARIANTS: dict[str, Callable] = {
    "plain-hf": plain_hf,
    "plain-trace": plain_trace,
    "raw-out": raw_out,
    "ss-out": ss_out,
    "raw-six": raw_six,
    "ss-six": ss_six,
    "raw-out+clone": raw_out_clone,
    "raw-six+clone": raw_six_clone,
}
READS = {"raw-out": 1, "ss-out": 1, "raw-out+clone": 1, "raw-six": 6, "ss-six": 6, "raw-six+clone": 6}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_same_reads(model, ids, n) -> None:
    """streamscope's reads equal raw nnsight's at the same sites, bit for bit (else the timing compares nothing)."""
    pairs = [(raw_out(model, ids, n), ss_out(model, ids, n)), (raw_six(model, ids, n), ss_six(model, ids, n))]
    for raw, served in pairs:
        assert raw.keys() == served.keys()
        for key in raw:
            if not torch.equal(raw[key], served[key]):
                raise SystemExit(f"streamscope and raw nnsight disagree at {key}")
    print(f"# check: streamscope's layer_output and six boundaries equal raw nnsight's at the same sites "
          f"({n} + {6 * n} tensors, torch.equal)", flush=True)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def bench(model, ids, args) -> dict[str, dict[str, list[float]]]:
    """{clock: {variant: seconds per run}}: wall time, and the process's CPU time on the CPU.

    On a shared CPU the process's CPU time (all its threads; with ``--threads 1`` the
    one thread that runs the model) ignores the time other processes hold the cores,
    which wall time does not.
    """
    n = args.layers
    names = [name for name in VARIANTS if name in args.variants]
    clocks = ["wall"] if args.device.startswith("cuda") else ["wall", "cpu"]
    times = {clock: {name: [] for name in names} for clock in clocks}
    for rep in range(args.warmup + args.reps):
        # Rotate the order every round (ABC, BCA, CAB, ...): no variant always runs first or
        # right after the same neighbour.
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            sync(args.device)
            starts = [CLOCKS[clock]() for clock in clocks]
            result = VARIANTS[name](model, ids, n)
            sync(args.device)
            ends = [CLOCKS[clock]() for clock in clocks]
            del result
            if rep >= args.warmup:
                for clock, start, end in zip(clocks, starts, ends):
                    times[clock][name].append(end - start)
        if rep == args.warmup - 1:
            print(f"# warmup done ({args.warmup} rounds)", flush=True)
        elif rep >= args.warmup and (rep - args.warmup + 1) % 5 == 0:
            print(f"# {rep - args.warmup + 1}/{args.reps} rounds", flush=True)
    return times


def report(times: dict[str, list[float]], args, bound: float, clock: str = "wall") -> dict[str, Any]:
    med = {name: statistics.median(values) for name, values in times.items()}
    base = med.get("plain-hf") or med.get("plain-trace")
    print()
    print(f"[{clock} time]")
    print(f"{'variant':<15}{'median ms':>11}{'min ms':>10}{'q1-q3 ms':>19}{'x plain-hf':>12}{'reads':>7}")
    for name, values in times.items():
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        reads = READS.get(name, 0) * args.layers
        print(f"{name:<15}{med[name] * 1e3:>11.2f}{min(values) * 1e3:>10.2f}"
              f"{f'{q[0] * 1e3:.2f}-{q[2] * 1e3:.2f}':>19}{med[name] / base:>12.4f}{reads:>7}")
    ratios = {}
    print()
    for served, raw in (("ss-out", "raw-out"), ("ss-six", "raw-six"), ("ss-out", "raw-out+clone"),
                        ("ss-six", "raw-six+clone"), ("raw-out", "plain-trace"), ("raw-six", "plain-trace"),
                        ("plain-trace", "plain-hf")):
        if served in med and raw in med:
            ratio = med[served] / med[raw]
            ratios[f"{served}/{raw}"] = ratio
            extra = ""
            if served.startswith("ss-") and raw in READS:
                per_read = (med[served] - med[raw]) / (READS[raw] * args.layers)
                verdict = "PASS" if ratio <= 1 + bound else "FAIL"
                extra = f"   {per_read * 1e6:+8.1f} us per read" + (
                    f"   [{verdict}: bound {1 + bound:.2f}]" if "+clone" not in raw else "   (diagnostic)")
            print(f"ratio {served + '/' + raw:<26}{ratio:8.4f}{extra}")
    return {"median_s": med, "ratios": ratios, "reps": len(next(iter(times.values())))}


# -- the device-map check ----------------------------------------------------------------------


def split_device_map(layers: int, gpu: str = "cuda:0") -> dict[str, Any]:
    """The first half of the blocks (and the embeddings) on `gpu`, the second half, norm and head on the CPU."""
    half = layers // 2
    device_map: dict[str, Any] = {"model.embed_tokens": gpu, "model.rotary_emb": gpu}
    for i in range(layers):
        device_map[f"model.layers.{i}"] = gpu if i < half else "cpu"
    device_map.update({"model.norm": "cpu", "lm_head": "cpu"})
    return device_map


def read_everything(model, ids, n) -> dict[Any, torch.Tensor]:
    saved = {}
    with model.trace(ids, use_cache=False):
        saved["token_embeddings"] = model.token_embeddings.save()
        for i in range(n):
            block = model.layers[i]
            for name in block.ORDER:
                saved[i, name] = getattr(block, name).save()
        saved["final_norm_output"] = model.final_norm_output.save()
        saved["logits"] = model.logits.save()
    return saved


def compare(reference: dict, other: dict, label: str, half: int) -> dict[str, Any]:
    """Every value of `other` against `reference`: bit-equal or not, and the largest differences."""
    max_abs, max_rel, max_norm_rel, worst, unequal = 0.0, 0.0, 0.0, None, []
    devices = set()
    for key, ref in reference.items():
        value = other[key]
        devices.add(str(value.device))
        value = value.cpu()
        if torch.equal(ref, value):
            continue
        unequal.append(key)
        a, b = ref.float(), value.float()
        diff = (a - b).abs().max().item()
        rel = diff / max(a.abs().max().item(), 1e-30)
        max_abs = max(max_abs, diff)
        max_norm_rel = max(max_norm_rel, ((a - b).norm() / a.norm().clamp_min(1e-30)).item())
        if rel >= max_rel:
            max_rel, worst = rel, key
    first_half_equal = not any(isinstance(key, tuple) and key[0] < half for key in unequal)
    print(f"# split [{label}]: {len(reference) - len(unequal)}/{len(reference)} values bit-equal to the "
          f"single-device run; max |diff| {max_abs:.3g}, max |diff|/max|value| {max_rel:.3g}, "
          f"max ||diff||/||value|| {max_norm_rel:.3g}"
          f"{f' (at {worst})' if worst is not None else ''}; read on {sorted(devices)}", flush=True)
    if unequal:
        print(f"# split [{label}]: every value of the blocks before the split point bit-equal: "
              f"{first_half_equal}; first unequal: {unequal[0]}", flush=True)
    return {"values": len(reference), "bit_equal": len(reference) - len(unequal), "max_abs": max_abs,
            "max_rel": max_rel, "max_norm_rel": max_norm_rel, "worst_at": str(worst), "first_unequal": str(unequal[0]) if unequal else None,
            "devices": sorted(devices), "first_half_bit_equal": first_half_equal}


def _to(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _to(item, device) for key, item in value.items()}
    return value


def run_half_on_cpu(model, n: int) -> None:
    """Move the second half of the blocks, the final norm and the head of `model` to the CPU, to run there.

    A forward pre-hook on each moved module brings its inputs to the CPU. PyTorch runs
    hooks before the module's forward, which is where nnsight's controller sits, so nnsight
    sees (and streamscope serves) each value on the device the module computes on.
    """
    def to_cpu(module, args, kwargs):
        return _to(args, "cpu"), _to(kwargs, "cpu")

    hf = model._module
    for module in [*[hf.model.layers[i] for i in range(n // 2, n)], hf.model.norm, hf.lm_head]:
        module.to("cpu")
        module.register_forward_pre_hook(to_cpu, with_kwargs=True)


def check_split(path: Path, single, ids, args, dtype) -> dict[str, Any]:
    """Every value of a split model against the single-device `single` model, on the same input.

    offload:      `streamscope.load(path, device_map={...})`, half the blocks, the norm and
                  the head given to the CPU. transformers hands the map to accelerate, which
                  keeps those weights in CPU memory and runs those modules on the GPU.
    cpu-compute:  the second half really computes on the CPU (`run_half_on_cpu`, applied to
                  `single` itself once its references are taken, so it runs last).
    """
    n, half = args.layers, args.layers // 2
    batches = {"offload": args.check_batch, "cpu-compute": args.cpu_compute_batch}
    references = {}
    for mode in args.split_modes:
        rows = batches[mode]
        if rows not in references:
            references[rows] = {k: v.cpu() for k, v in read_everything(single, ids[:rows], n).items()}
    results: dict[str, Any] = {}
    for mode in sorted(args.split_modes, key=lambda mode: mode == "cpu-compute"):
        rows = batches[mode]
        started = time.perf_counter()
        if mode == "offload":
            split = streamscope.load(path, dtype=dtype, device_map=split_device_map(n))
            hf_map = getattr(split._module, "hf_device_map", {})
            print(f"# split [offload]: loaded in {time.perf_counter() - started:.1f}s; hf_device_map sends "
                  f"{sum(1 for d in hf_map.values() if str(d) == 'cpu')} modules to the CPU; block {n - 1}'s "
                  f"parameters read {next(split._module.model.layers[n - 1].parameters()).device} (meta: held "
                  f"by accelerate in CPU memory, brought to the GPU for each call)", flush=True)
        elif mode == "cpu-compute":
            split = single
            run_half_on_cpu(split, n)
            print(f"# split [cpu-compute]: moved blocks {half}..{n - 1}, norm and head to the CPU in "
                  f"{time.perf_counter() - started:.1f}s", flush=True)
        else:
            raise SystemExit(f"unknown split mode {mode}")
        sync(args.device)
        started = time.perf_counter()
        values = read_everything(split, ids[:rows], n)
        sync(args.device)
        ran = time.perf_counter() - started
        print(f"# split [{mode}]: one trace reading all {len(values)} values, batch {rows} x {ids.shape[1]}, "
              f"took {ran:.2f}s", flush=True)
        results[mode] = compare(references[rows], values, mode, half)
        results[mode].update(trace_s=ran, batch=rows)
        del split, values
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return results


# -- main --------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    text = f"{os.cpu_count()} cores, {cpu}"
    if torch.cuda.is_available():
        text += f"; {torch.cuda.get_device_name(0)}"
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--checkpoint-dtype", choices=sorted(DTYPES), default=None,
                        help="dtype the checkpoint is saved in (default --dtype; the model is loaded in --dtype)")
    parser.add_argument("--device", default="cpu", help="where the single-device model runs: cpu or cuda")
    parser.add_argument("--device-map", default=None,
                        help="device_map for the timed model (default: the --device); e.g. 'cuda' or 'split'")
    parser.add_argument("--init-device", default=None, help="where the random weights are built (default --device)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="folder to build the checkpoint in (default: a temp dir)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--bound", type=float, default=0.05)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--grad", action="store_true", help="run with autograd on (default: under torch.no_grad)")
    parser.add_argument("--no-bench", action="store_true", help="skip the timing (e.g. only --check-split)")
    parser.add_argument("--check-split", action="store_true", help="compare every value against a device_map split run")
    parser.add_argument("--split-modes", default="offload", help="comma-separated: offload (device_map), cpu-compute (the CPU half runs on the CPU)")
    parser.add_argument("--check-batch", type=int, default=None, help="batch rows for the offload split (default --batch)")
    parser.add_argument("--cpu-compute-batch", type=int, default=1, help="batch rows for the cpu-compute split")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.split_modes = [v.strip() for v in args.split_modes.split(",") if v.strip()]
    args.init_device = args.init_device or args.device
    args.checkpoint_dtype = args.checkpoint_dtype or args.dtype
    args.check_batch = args.check_batch or args.batch
    dtype = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"# {datetime.datetime.now().astimezone().isoformat(timespec='seconds')} on {machine()}")
    print(f"# python {platform.python_version()}, torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}, nnsight {__import__('nnsight').__version__}")
    print(f"# command: {' '.join(sys.argv)}")
    print(f"# shape: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} kv, "
          f"intermediate {args.intermediate}, vocab {args.vocab}, batch {args.batch} x seq {args.seq}, "
          f"{args.dtype} on {args.device} (checkpoint saved in {args.checkpoint_dtype}); torch threads {torch.get_num_threads()}; "
          f"{'grad on' if args.grad else 'no_grad'}", flush=True)

    with contextlib.ExitStack() as stack:
        if args.checkpoint is None:
            args.checkpoint = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ss-bench-")))
        path = build_checkpoint(args.checkpoint, args)

        started = time.perf_counter()
        device_map = args.device_map or (None if args.device == "cpu" else args.device)
        if device_map == "split":
            device_map = split_device_map(args.layers)
        load_kwargs = {"dtype": dtype}
        if device_map is not None:
            load_kwargs["device_map"] = device_map
        model = streamscope.load(path, **load_kwargs)
        print(f"# loaded in {time.perf_counter() - started:.1f}s; parameters on "
              f"{next(model._module.parameters()).device}", flush=True)

        generator = torch.Generator().manual_seed(args.seed + 2)
        ids = torch.randint(3, TOKENIZER_VOCAB, (args.batch, args.seq), generator=generator)
        ids = ids.to(next(model._module.parameters()).device)
        results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(),
                                   "torch": torch.__version__}
        grad = contextlib.nullcontext() if args.grad else torch.no_grad()
        with grad:
            check_same_reads(model, ids, args.layers)
            if not args.no_bench:
                times = bench(model, ids, args)
                results["bench"] = {}
                for clock, by_variant in times.items():
                    results["bench"][clock] = report(by_variant, args, args.bound, clock)
                    results["bench"][clock]["times_s"] = by_variant
            if args.check_split:
                results["split"] = check_split(path, model, ids, args, dtype)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
