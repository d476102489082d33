"""The ``streamscope harvest`` command: a dataset's values over Ray replicas, into a resumable folder.

    streamscope harvest CHECKPOINT DATASET --values layer_output,mlp_output --layers 8,16 --positions all \\
        --out acts/ --replicas 8 --engine vllm --tensor-parallel-size 1

DATASET is a .jsonl or .parquet file or a datasets folder; ``--column`` names its text or token-id column.
Run the same command again to resume a stopped run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .ray import HarvestFailed, harvest


def positions_argument(text: str) -> Any:
    """``last``, ``all``, ``START:STOP[:STEP]`` (a slice) or ``0,1,-1`` (indices)."""
    if text in ("last", "all"):
        return text
    try:
        if ":" in text:
            parts = [int(part) if part else None for part in text.split(":")]
            return slice(*parts)
        return [int(part) for part in text.split(",")]
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"--positions {text!r}: use last, all, START:STOP or 0,1,-1.") from None


def layers_argument(text: str) -> Any:
    if text == "all":
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: use all or block indices like 4,8,-1.") from None


def add_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("dataset", help="a .jsonl or .parquet file, or a folder written by datasets' save_to_disk")
    sub.add_argument("--values", required=True, help="comma-separated value names (layer_output,mlp_output)")
    sub.add_argument("--layers", type=layers_argument, default=None, help="all (default) or block indices: 4,8,-1")
    sub.add_argument("--positions", type=positions_argument, default="last", help="last (default), all, 0:16 or 0,-1")
    sub.add_argument("--out", required=True, help="the run's folder (shared by every node); rerun to resume")
    sub.add_argument("--column", help="the text or token-id column (default: text)")
    sub.add_argument("--split", help="the split of a datasets folder with several")
    sub.add_argument("--replicas", type=int, default=1)
    sub.add_argument("--engine", default="vllm", choices=("vllm", "transformers"))
    sub.add_argument("--tensor-parallel-size", type=int, default=1, help="each replica's (vLLM)")
    sub.add_argument("--pipeline-parallel-size", type=int, default=1, help="each replica's (vLLM)")
    sub.add_argument("--engine-options", type=json.loads, default={},
                     help='more streamscope.load arguments as JSON: \'{"dtype": "bfloat16"}\'')
    sub.add_argument("--batch-size", type=int, default=None, help="prompts per padded batch (transformers)")
    sub.add_argument("--shard-size", type=int, default=1024, help="prompts per shard (default 1024)")
    sub.add_argument("--format", default="safetensors", choices=("safetensors", "parquet"),
                     help="the shards: safetensors (load_harvest reads them) or parquet (one row a token)")
    sub.add_argument("--num-cpus", type=float, default=1, help="Ray CPUs each replica holds")
    sub.add_argument("--num-gpus", type=float, default=None, help="Ray GPUs each replica holds (default: its ranks)")
    sub.add_argument("--address", default=None, help="the Ray cluster (auto, ray://host:10001); default: local")


def command_harvest(arguments: argparse.Namespace) -> int:
    options = dict(arguments.engine_options)
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):  # only where asked: vLLM's settings
        if getattr(arguments, name) != 1:
            options.setdefault(name, getattr(arguments, name))
    harvest_options = {} if arguments.batch_size is None else {"batch_size": arguments.batch_size}
    values = [value.strip() for value in arguments.values.split(",") if value.strip()]
    try:
        folder = harvest(arguments.dataset, arguments.path, values, arguments.layers, arguments.positions,
                         out=arguments.out, replicas=arguments.replicas, engine=arguments.engine,
                         engine_options=options, column=arguments.column, split=arguments.split,
                         shard_size=arguments.shard_size, harvest_options=harvest_options, num_cpus=arguments.num_cpus, num_gpus=arguments.num_gpus,
                         address=arguments.address, format=arguments.format)
    except HarvestFailed as error:
        print(error)
        return 1
    except (ValueError, TypeError, KeyError, IndexError, ImportError, OSError) as error:
        # Refused before any replica ran (a missing column, another run's folder, no cluster...): the reason alone.
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"streamscope harvest: {message}", file=sys.stderr)
        return 2
    index = json.loads((folder / "index.json").read_text())
    print(f"wrote {index['prompts']} prompts ({index['tokens']} tokens) in {len(index['shards'])} shards to {folder}")
    for failure in index["failures"]:
        print(f"  replica {failure['replica']} failed on shard {failure['shard']} (rerun by another): "
              f"{failure['error']}")
    return 0
