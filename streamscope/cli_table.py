"""The `streamscope` command's commands as a table: each one's name, help and arguments, and where it runs.

Nothing here imports torch, transformers, nnsight or an engine, and `streamscope.cli` builds its parser from
`COMMANDS` alone: ``streamscope --help``, a command's ``--help`` and the refusal of a wrong argument cost an
interpreter's start, not the libraries'. The module a command runs in (`Command.runs`) is imported when that
command runs (`implementation`), and it imports what it needs at its top.
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional


#: Every PATH's help: the names `streamscope.load` takes.
PATH_HELP = "a checkpoint folder, smollm2, a .gguf file or a hub repository id"
#: The help of an argument of block, position or head indices (`indices`), with what they choose filled in.
INDICES = "the {} (default: all): indices and ranges, 0,2,5-8; negative from the end"


@dataclass(frozen=True)
class Command:
    """One command of ``streamscope``.

    `runs` names the function that runs it, ``"module:function"``: called with the parsed
    `argparse.Namespace` (PATH resolved as `streamscope.load` takes it), it returns the exit status. `declare`
    adds the command's arguments after PATH (None: PATH alone); `engine` gives it ``--engine`` (the engines of
    `streamscope.engine_registry`, transformers by default). A command that `forwards` takes no PATH here:
    its function gets every word after the command's name, for a parser of its own (`serve`: vLLM's).
    """

    name: str
    help: str
    runs: str
    declare: Optional[Callable[[argparse.ArgumentParser], None]] = None
    engine: bool = True
    forwards: bool = False


def implementation(runs: str) -> Any:
    """What ``"module:attribute"`` names, its module imported now (with everything the module imports)."""
    module, colon, attribute = runs.partition(":")
    if not (module and colon and attribute):
        raise ValueError(f"{runs!r}: name an attribute of a module as 'package.module:attribute'")
    return getattr(importlib.import_module(module), attribute)


# ---------------------------------------------------------------- the arguments' types


def indices(text: str) -> list[int]:
    """``"0,2,5-8"`` as [0, 2, 5, 6, 7, 8]; ``"-1"`` is the last."""
    found: list[int] = []
    for part in text.split(","):
        part = part.strip()
        start, dash, end = part[1:].partition("-")
        try:
            if dash:
                found.extend(range(int(part[0] + start), int(end) + 1))
            else:
                found.append(int(part))
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"{text!r}: give indices and ranges such as 0,2,5-8") from None
    return found


def token(text: str) -> Any:
    """An answer token as `streamscope.patch` takes it: an id where `text` is an integer, else the text."""
    return int(text) if text.lstrip("-").isdigit() else text


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
    """``all`` (None: every block) or block indices ``4,8,-1``."""
    if text == "all":
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: use all or block indices like 4,8,-1.") from None


# ---------------------------------------------------------------- each command's arguments after PATH


def _check(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--engines", default="transformers,vllm", help="comma-separated (default: both)")
    sub.add_argument("--prompt", default="The Eiffel Tower is in Paris, and the quick brown fox")
    sub.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                     help="the engines' dtype (default float32); outside float32 on a CPU each value's tolerance "
                          "is measured: twice transformers' own distance at that precision")


def _lens(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("prompt")
    sub.add_argument("--png", help="write the heatmap to this file")
    sub.add_argument("--top-k", type=int, default=3)
    sub.add_argument("--position", type=int, default=-1)
    sub.add_argument("--value", default="layer_output", help="the block value read (default: layer_output)")
    sub.add_argument("--layers", type=indices, help=INDICES.format("blocks to read"))
    sub.add_argument("--positions", type=indices, help=INDICES.format("positions the heatmap shows"))


def _patch(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--clean", required=True)
    sub.add_argument("--corrupted", required=True)
    sub.add_argument("--answer", required=True, type=token, help="the clean answer token (text or id)")
    sub.add_argument("--wrong", required=True, type=token, help="the corrupted answer token (text or id)")
    sub.add_argument("--value", default="layer_output",
                     help="layer_output, layer_input, layer_mid, attention_output, mlp_output, mlp.neurons, "
                          "head_outputs or head_results")
    sub.add_argument("--png", help="write the heatmap to this file")
    sub.add_argument("--layers", type=indices, help=INDICES.format("blocks to patch"))
    sub.add_argument("--positions", type=indices, help=INDICES.format("positions to patch"))


def _attention(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("prompt")
    sub.add_argument("--layer", type=int, default=0)
    sub.add_argument("--png", required=True)
    sub.add_argument("--heads", type=indices, help=INDICES.format("heads to draw"))
    sub.add_argument("--drop-first", action="store_true",
                     help="leave out the first (sink) token, so the scale shows the rest")
    sub.add_argument("--log-scale", action="store_true", help="colour by the logarithm of the weight")


def harvest_arguments(sub: argparse.ArgumentParser) -> None:
    """``streamscope harvest``'s arguments after PATH (`streamscope.scale.command.command_harvest` reads them)."""
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
    sub.add_argument("--shard-size", type=int, default=None,
                     help="prompts per shard (default: as many as hold 1 GiB of rows, at most 1024)")
    sub.add_argument("--format", default="safetensors", choices=("safetensors", "parquet"),
                     help="the shards: safetensors (load_harvest reads them) or parquet (one row a token)")
    sub.add_argument("--num-cpus", type=float, default=1, help="Ray CPUs each replica holds")
    sub.add_argument("--num-gpus", type=float, default=None, help="Ray GPUs each replica holds (default: its ranks)")
    sub.add_argument("--address", default=None, help="the Ray cluster (auto, ray://host:10001); default: local")


#: The commands, in the order ``streamscope --help`` lists them.
COMMANDS: dict[str, Command] = {command.name: command for command in (
    Command("map", "print the support table: every value each block serves, or why not",
            "streamscope.cli:command_map"),
    Command("check", "compare every served value on each engine with transformers' own forward; exit 1 when any "
            "exceeds its tolerance", "streamscope.cli:command_check", _check, engine=False),
    Command("lens", "the logit lens: every block's stream through the model's own head",
            "streamscope.cli:command_lens", _lens),
    Command("patch", "activation patching from a clean into a corrupted prompt", "streamscope.cli:command_patch",
            _patch),
    Command("attention", "plot a block's attention pattern, one panel per head", "streamscope.cli:command_attention",
            _attention),
    Command("harvest", "harvest a dataset's values on Ray replicas into a resumable folder of shards",
            "streamscope.scale.command:command_harvest", harvest_arguments, engine=False),
    # Its module is the first of the package's that `streamscope serve` imports, so the server's anyio loads before
    # nnsight does (streamscope/serve/__init__.py says why).
    Command("serve", "serve the model over HTTP: vLLM's OpenAI-compatible server, steerable and harvestable by name "
            "(`streamscope serve --help` lists its options, vLLM's among them)", "streamscope.serve.server:main",
            engine=False, forwards=True),
)}
