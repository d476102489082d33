"""The SAE-training harvest at a model's physical limit: 6 blocks' layer_output at every position, against bare vLLM.

One engine, one run, rounds alternating (issue 43):

  bare      vLLM prefill of the prompts (one generated token each), no streamscope work
  harvest   `model.harvest(prompts, "layer_output", layers=<6 blocks>, positions="all", out=<folder>)`: the
            safetensors shards `load_harvest` reads, written as the engine runs

then, once each, what binds where the harvest falls short, each measured alone:

  disk      the same shards written from host memory by the harvest's own writer (`ShardWriter`, a background
            thread): bytes/s, and the seconds its caller blocked; beside it clone + `save_file` (the writer before)
  host      the same bytes copied device -> pinned host memory: bytes/s
  parquet   `streamscope.scale.harvest(..., replicas=1, format="parquet")`: the tables SAE trainers read
            (a Ray actor holds the engine, so the in-process engine is closed first)
  saelens   `streamscope.sae.train` on the same engine: one block's rows written as SAELens's cached
            activations and read back by SAELens's own `ActivationsStore` in a short training run; then the
            Parquet tables read with pyarrow as `docs/scale.md` shows, and a few SAE steps on them in torch

Shapes: ``--shape 8b`` (Llama-3-8B, bfloat16), ``--shape 70b`` (Llama-3-70B; ``--fp8`` gives its config vLLM's
``fp8`` quantization method, so the dummy weights are made in the FP8 format a real FP8 checkpoint loads in), and
``--tiny`` for this CPU. The checkpoint folder holds a config and a tokenizer of the model's whole vocabulary
and no weights (``load_format="dummy"``).

    python benchmarks/harvest_scale.py --tiny --rounds 2                      # a CPU check, ~1 minute
    python benchmarks/harvest_scale.py --disk-only --prompts 64 --length 256  # the writer alone, no engine
    python benchmarks/harvest_scale.py --shape 70b --fp8 --prompts 512 --length 1024 --rounds 3 --out /tmp/h

On the lent H200 (vLLM 0.22) an FP8 engine needs ``python3 scripts/humming_stub.py /tmp/site`` first: vLLM's
quantization registry imports the ``humming`` kernel package, which the carried wheels lack (see that script).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The engine in this process: the harvested rows are handed over as they are, not pickled through a socket.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "vocab_size": 128256},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
}
#: Activault's figure: 10 billion tokens x 6 layers of Llama-3.3-70B in 3.5 days on one 8-GPU H100 node.
ACTIVAULT_TOKENS_PER_GPU = 10e9 / (3.5 * 86400) / 8


def build_folder(folder: Path, shape: str, fp8: bool) -> Path:
    """A Llama checkpoint folder of `shape`: config (FP8 weights where asked) and a whole-vocabulary tokenizer."""
    from transformers import LlamaConfig

    from streamscope.testing.tokenizer import save_tokenizer, word_tokenizer

    sizes = SHAPES[shape]
    config = LlamaConfig(**sizes, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if fp8:
        # The config a serialized FP8 checkpoint carries (vLLM's Fp8Config): weights stored in float8_e4m3fn with
        # per-tensor scales, activations quantized dynamically.
        config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    config.save_pretrained(str(folder))
    if sizes["vocab_size"] <= 512:
        save_tokenizer(folder, vocab_size=sizes["vocab_size"])
    else:
        word_tokenizer(sizes["vocab_size"]).save_pretrained(str(folder))
    return folder


def token_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids (seeded)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return [[0] + torch.randint(3, vocab, (length - 1,), generator=generator).tolist() for _ in range(count)]


def harvested_layers(blocks: int, count: int = 6) -> list[int]:
    """`count` blocks spread over the model, the first and last left out (where SAEs are rarely trained)."""
    step = blocks / (count + 1)
    return sorted({round(step * (index + 1)) for index in range(count)})


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def device_memory() -> str:
    import torch

    if not torch.cuda.is_available():
        return "n/a (no GPU)"
    free, total = torch.cuda.mem_get_info()
    return f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use"


def alternate(functions: dict[str, Callable[[], Any]], rounds: int, after: Callable[[str], None]) -> dict:
    """Each function's wall times over `rounds` rounds, the functions alternating, after one warm-up each."""
    for name, function in functions.items():
        function()
        after(name)
    times: dict[str, list[float]] = {name: [] for name in functions}
    for round_index in range(rounds):
        order = list(functions) if round_index % 2 == 0 else list(reversed(functions))
        for name in order:
            start = time.perf_counter()
            functions[name]()
            times[name].append(time.perf_counter() - start)
            after(name)
            print(f"  round {round_index + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    return times


def disk_alone(out: Path, shard: Any, spec: Any, copies: int) -> dict[str, float]:
    """The disk alone: `copies` of one in-memory shard (as large as the engine's) written two ways, the same bytes.

    ``writer``: bytes/s of the harvest's own writer (`ShardWriter`: a background thread writing each tensor from
    its memory), timed from the first `write` to `close` returning (every shard on disk, the index written);
    ``blocked``: the seconds its caller (the engine's thread, in a harvest) spent inside `write`, the rest being
    free to run the next chunk; ``save_file``: bytes/s of what the writer replaced, each shard's tensors cloned and
    written by safetensors' `save_file` in the caller's thread.
    """
    from safetensors.torch import save_file

    from streamscope.bulk.results import ShardWriter
    from streamscope.bulk.safetensors_io import write_safetensors

    folder = out / "disk-alone"
    shutil.rmtree(folder, ignore_errors=True)
    # one untimed shard each way first: whichever ran first would otherwise pay the page cache's first allocations
    # (on this CPU the writer timed first read 0.40 GiB/s, and 4.2 GiB/s once warm, save_file 1.7 and 2.9)
    folder.mkdir(parents=True)
    tensors = {f"{value}/{prompt}": tensor for value, per_prompt in shard.values.items()
               for prompt, tensor in zip(shard.prompts, per_prompt)}
    write_safetensors(tensors, folder / "warm-writer.safetensors")
    save_file({name: tensor.clone() for name, tensor in tensors.items()}, str(folder / "warm-save-file.safetensors"))
    shutil.rmtree(folder)
    writer = ShardWriter(folder, spec, copies * len(shard.prompts))
    blocked = 0.0
    start = time.perf_counter()
    for _ in range(copies):
        entered = time.perf_counter()
        writer.write(shard)
        blocked += time.perf_counter() - entered
    writer.close()
    seconds = time.perf_counter() - start
    written = folder_bytes(folder)
    shutil.rmtree(folder, ignore_errors=True)

    folder.mkdir(parents=True)
    start = time.perf_counter()
    for number in range(copies):
        tensors = {f"{value}/{prompt}": tensor.clone() for value, per_prompt in shard.values.items()
                   for prompt, tensor in zip(shard.prompts, per_prompt)}
        save_file(tensors, str(folder / f"shard-{number:05d}.safetensors"))
    cloned_seconds = time.perf_counter() - start
    cloned = folder_bytes(folder)
    shutil.rmtree(folder, ignore_errors=True)
    return {"writer": written / seconds, "blocked": blocked, "save_file": cloned / cloned_seconds,
            "bytes": float(written)}


def print_disk_alone(rates: dict[str, float], copies: int, harvest_s: float | None = None) -> None:
    share = f" of the harvest's {harvest_s:.2f} s" if harvest_s is not None else ""
    print(f"  the disk alone, {rates['bytes'] / 2**30:.2f} GiB in {copies} shards from host memory:")
    print(f"    the harvest's writer (background thread, no copy): {rates['writer'] / 2**30:.2f} GiB/s, "
          f"{rates['bytes'] / rates['writer']:.2f} s{share}; its caller blocked {rates['blocked']:.2f} s")
    print(f"    clone + safetensors save_file in the caller (the writer before): {rates['save_file'] / 2**30:.2f} "
          f"GiB/s, {rates['bytes'] / rates['save_file']:.2f} s, all of it blocking")


def disk_only(args: argparse.Namespace, shape: str) -> None:
    """The disk part alone, with no engine: synthetic shards of the harvest's size (a CPU timing of the writer)."""
    import torch

    from streamscope.bulk.results import assemble
    from streamscope.bulk.spec import HarvestSpec

    sizes = SHAPES[shape]
    layers = harvested_layers(sizes["num_hidden_layers"])
    dtype = torch.float32 if args.tiny else torch.bfloat16
    positions = [list(range(args.length))] * args.shard_size
    spec = HarvestSpec(values=["layer_output"], layers=layers, positions=positions)
    buffers = [torch.randn(len(layers), args.length, sizes["hidden_size"]).to(dtype) for _ in range(args.shard_size)]
    shard = assemble(spec, buffers, list(range(args.shard_size)))
    out = Path(args.out or tempfile.mkdtemp(prefix="harvest-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    copies = max(1, args.prompts // args.shard_size)
    print(f"harvest_scale.py --disk-only  {shape} shape, {dtype}; {args.shard_size} prompts x {args.length} tokens "
          f"a shard, layer_output of {len(layers)} blocks; out {out}")
    print_disk_alone(disk_alone(out, shard, spec, copies), copies)


def host_alone(total_bytes: int) -> float:
    """Bytes/s of device -> pinned host copies of `total_bytes`, in 256 MiB pieces (CPU: a host memcpy)."""
    import torch

    piece = min(total_bytes, 256 * 2**20) // 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    source = torch.empty(piece, dtype=torch.bfloat16, device=device)
    target = torch.empty(piece, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    pieces = max(1, total_bytes // (piece * 2))
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(pieces):
        target.copy_(source, non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return pieces * piece * 2 / (time.perf_counter() - start)


def sae_steps_on_parquet(folder: Path, value: str, steps: int = 20) -> tuple[float, float, float]:
    """A few steps of a ReLU SAE on the Parquet tables, read as docs/scale.md shows: the first and the last step's
    loss, and the rows' mean square (what a loss compares with)."""
    import pyarrow.parquet
    import torch

    index = json.loads((folder / "index.json").read_text())
    table = pyarrow.parquet.read_table(folder / index["shards"][0]["file"], columns=[value])
    column = table[value].combine_chunks()
    rows = torch.from_numpy(column.flatten().to_numpy().reshape(len(column), -1).copy()).float()
    hidden = rows.shape[1]
    encoder = torch.nn.Linear(hidden, 4 * hidden)
    decoder = torch.nn.Linear(4 * hidden, hidden)
    optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=1e-3)
    losses = []
    for step in range(steps):
        batch = rows[(step * 256) % len(rows):][:256]
        features = torch.relu(encoder(batch))
        loss = (decoder(features) - batch).pow(2).mean() + 1e-3 * features.abs().sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses[0], losses[-1], float(rows.pow(2).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("8b", "70b"), default="8b")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape in float32, for a CPU check")
    parser.add_argument("--fp8", action="store_true", help="FP8 weights (vLLM's fp8 method), dummy values")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-size", type=int, default=None,
                        help="prompts a shard (default: the library's, shards of at most 1 GiB of rows, what a user "
                             "gets: the last shard, written after the engine's last step, is the harvest's tail)")
    parser.add_argument("--out", default=None, help="where the harvests are written (a fast local disk)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: rounds (bare against the harvest; disk and host need it),"
                             " disk,host,parquet,saelens (a call of its own at 70B: --skip rounds,saelens)")
    parser.add_argument("--disk-only", action="store_true", help="only the disk part, on synthetic shards")
    parser.add_argument("--memory-fraction", type=float, default=0.9,
                        help="vLLM's gpu_memory_utilization (0.95 holds the 70B shape in FP8 on an 80 GB H100)")
    parser.add_argument("--batched-tokens", type=int, default=16384, help="vLLM's max_num_batched_tokens")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    requested_shard_size = args.shard_size  # None: the harvests cut their shards by bytes, as a user's do
    args.requested_shard_size = requested_shard_size
    if args.shard_size is None:
        from streamscope.bulk.results import SHARD_BYTES, SHARD_PROMPTS

        sizes = SHAPES["tiny" if args.tiny else args.shape]
        prompt_bytes = len(harvested_layers(sizes["num_hidden_layers"])) * min(args.length, 64 if args.tiny else
                                                                              args.length) * sizes["hidden_size"] * 2
        args.shard_size = max(1, min(SHARD_PROMPTS, SHARD_BYTES // prompt_bytes))  # the parts that need a count
    shape = "tiny" if args.tiny else args.shape
    if args.tiny:
        args.prompts, args.length = min(args.prompts, 16), min(args.length, 64)
    if args.disk_only:
        disk_only(args, shape)
        return

    import torch
    import vllm


    out = Path(args.out or tempfile.mkdtemp(prefix="harvest-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    folder = build_folder(Path(tempfile.mkdtemp(prefix=f"harvest-{shape}-")), shape, args.fp8)
    sizes = SHAPES[shape]
    layers = harvested_layers(sizes["num_hidden_layers"])
    prompts = token_prompts(args.prompts, args.length, sizes["vocab_size"])
    dtype = "float32" if args.tiny else "bfloat16"
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"harvest_scale.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  {shape} shape"
          f"{' FP8 weights' if args.fp8 else ''}, {dtype}; {args.prompts} prompts x {args.length} tokens; "
          f"layer_output of blocks {layers} at every position; rounds={args.rounds}; shards of "
          f"{requested_shard_size or f'at most 1 GiB (about {args.shard_size} prompts)'}")
    print(f"device {device_name}; vllm {vllm.__version__}, torch {torch.__version__}, python "
          f"{platform.python_version()}; out {out}")

    options: dict[str, Any] = {"load_format": "dummy", "dtype": dtype, "seed": 0,
                               "max_model_len": args.length + 8}
    if torch.cuda.is_available():
        options.update(gpu_memory_utilization=args.memory_fraction, max_num_batched_tokens=args.batched_tokens)
    if "rounds" in skip:
        skip |= {"disk", "host"}  # each is read against the rounds' harvest
    if not {"rounds", "saelens"} <= skip:
        in_process(args, skip, folder, options, prompts, layers, sizes, out)
    if "parquet" not in skip:
        parquet_part(args, skip, folder, options, prompts, layers, requested_shard_size, out)


def in_process(args: argparse.Namespace, skip: set[str], folder: Path, options: dict[str, Any],
               prompts: list[list[int]], layers: list[int], sizes: dict[str, int], out: Path) -> None:
    """The rounds (bare prefill against the harvest to shards), then the disk and the host copies alone and SAELens
    on the in-process engine."""
    import streamscope

    requested_shard_size = args.requested_shard_size
    tokens = args.prompts * args.length
    model = streamscope.load(folder, engine="vllm", **options)
    print(f"engine loaded: device memory {device_memory()}", flush=True)
    llm = model.vllm_entrypoint
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    harvest_folder = out / "harvest"

    def bare() -> None:
        llm.generate(requests, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

    def harvest() -> None:
        model.harvest(prompts, "layer_output", layers=layers, positions="all", out=harvest_folder,
                      shard_size=requested_shard_size, progress=False)

    written: list[int] = []

    def after(name: str) -> None:
        if name == "harvest":
            written.append(folder_bytes(harvest_folder))
            shutil.rmtree(harvest_folder, ignore_errors=True)

    if "rounds" in skip:
        run_sae_lens(args, skip, model, prompts, layers, sizes, out)
        model.close()
        return
    times = alternate({"bare": bare, "harvest": harvest}, args.rounds, after)
    bare_s, harvest_s = statistics.median(times["bare"]), statistics.median(times["harvest"])
    gpus = 1
    print(f"\nprompt tokens/s a GPU (median of {args.rounds} rounds):")
    print(f"  bare vLLM prefill   {tokens / bare_s / gpus:12,.0f}")
    print(f"  streamscope harvest {tokens / harvest_s / gpus:12,.0f}   ratio to bare {bare_s / harvest_s:.3f}"
          f"   (Activault's per-GPU figure: {ACTIVAULT_TOKENS_PER_GPU:,.0f})")
    print(f"  written {written[-1] / 2**30:.2f} GiB a harvest: {written[-1] / harvest_s / 2**30:.2f} GiB/s while the "
          f"engine ran; device memory after {device_memory()}")

    if "disk" not in skip:
        from streamscope.bulk.results import load_harvest
        from streamscope.bulk.spec import HarvestSpec

        model.harvest(prompts[:args.shard_size], "layer_output", layers=layers, positions="all",
                      out=harvest_folder, shard_size=requested_shard_size, progress=False)
        shard = load_harvest(harvest_folder)
        spec = HarvestSpec(values=["layer_output"], layers=layers, positions="all")
        shutil.rmtree(harvest_folder, ignore_errors=True)
        copies = max(1, args.prompts // args.shard_size)
        print_disk_alone(disk_alone(out, shard, spec, copies), copies, harvest_s)
    if "host" not in skip:
        rate = host_alone(written[-1])
        print(f"  device -> host copies alone: {rate / 2**30:.2f} GiB/s: {written[-1] / rate:.2f} s of "
              f"{harvest_s:.2f} s")
    run_sae_lens(args, skip, model, prompts, layers, sizes, out)
    model.close()


def run_sae_lens(args: argparse.Namespace, skip: set[str], model: Any, prompts: list[list[int]], layers: list[int],
                 sizes: dict[str, int], out: Path) -> None:
    """`streamscope.sae.train` on the in-process engine: SAELens's own `ActivationsStore` reads the harvest."""
    if "saelens" not in skip:
        import torch

        import streamscope.sae

        start = time.perf_counter()
        # one shard's prompts (the tiny shape's shard holds more than it has) and a batch a quarter of their tokens
        count = min(args.shard_size, len(prompts))
        batch = min(4096, count * args.length // 4)
        hidden = sizes["hidden_size"]
        d_sae, steps, device = 4 * hidden, 20, None
        if torch.cuda.is_available() and torch.cuda.mem_get_info()[0] < sae_bytes(hidden, d_sae, batch):
            # the engine holds the card (the 70B engine on an 80 GB H100 leaves 0.5 GiB): the SAE trains on the
            # host, narrower and for fewer steps, what matters here being that SAELens's own store reads the rows
            d_sae, steps, device = hidden, 10, "cpu"
        sae = streamscope.sae.train(model, prompts[:count], f"blocks.{layers[0]}.hook_resid_post",
                                    out / "sae", d_sae=d_sae, steps=steps, progress=False, batch_size=batch,
                                    device=device)
        print(f"  SAELens (its ActivationsStore on streamscope's cache of block {layers[0]}): {steps} steps of "
              f"{batch} tokens in {time.perf_counter() - start:.1f} s with the harvest, an SAE of "
              f"{sae.W_enc.shape[1]} features on {device or ('cuda' if torch.cuda.is_available() else 'cpu')} in "
              f"{out / 'sae'}")


def sae_bytes(d_in: int, d_sae: int, batch: int) -> int:
    """About the device memory an SAE's training takes in float32: weights, their gradients and Adam's two
    moments (4 copies of both matrices), and a batch's features three times over (activations, their
    gradients, the decoder's input)."""
    return 4 * (4 * 2 * d_in * d_sae + 3 * batch * d_sae)


def parquet_part(args: argparse.Namespace, skip: set[str], folder: Path, options: dict[str, Any],
                 prompts: list[list[int]], layers: list[int], requested_shard_size: Optional[int], out: Path) -> None:
    """`streamscope.scale.harvest` with one Ray replica into Parquet, then a few SAE steps on its rows."""
    from streamscope.scale import harvest as scale_harvest

    engine_options = {key: value for key, value in options.items() if key != "seed"}
    parquet_folder = out / "parquet"
    shutil.rmtree(parquet_folder, ignore_errors=True)
    start = time.perf_counter()
    scale_harvest(prompts, folder, "layer_output", layers=layers, positions="all", out=parquet_folder,
                  replicas=1, engine_options=engine_options, progress=False, format="parquet",
                  shard_size=requested_shard_size)  # None: the library's, shards of at most 1 GiB
    seconds = time.perf_counter() - start
    records = [json.loads(path.read_text()) for path in parquet_folder.glob("shard-*.json")]
    harvesting = sum(record["seconds"] for record in records)  # each shard's engine run, before its table's write
    print(f"  streamscope.scale.harvest, 1 replica, Parquet: {seconds:.2f} s with the replica's start, "
          f"{folder_bytes(parquet_folder) / 2**30:.2f} GiB in {len(records)} shards; the replica's harvests "
          f"{harvesting:.2f} s of it, the rest its start and the tables' writes")
    first, last, scale = sae_steps_on_parquet(parquet_folder, f"layer_output/{layers[0]}")
    print(f"  an SAE trained 20 steps on the Parquet rows of block {layers[0]}: loss {first:.3e} at the first step, "
          f"{last:.3e} at the last (the rows' mean square {scale:.3e}: dummy weights make small activations)")


if __name__ == "__main__":
    main()
