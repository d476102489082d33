"""The `streamscope` command: support tables, checks, logit lenses, patching and attention plots from a shell.

    streamscope map PATH
    streamscope check PATH --engines transformers,vllm
    streamscope lens PATH "The capital of France is" --png lens.png
    streamscope patch PATH --clean "..." --corrupted "..." --answer " Paris" --wrong " Rome" --png patch.png
    streamscope attention PATH "prompt" --layer 3 --png pattern.png
    streamscope harvest PATH DATASET --values layer_output --layers 8 --out acts/ --replicas 2
    streamscope serve PATH [--taps ...] [any vllm serve option]     (vLLM's OpenAI-compatible server, steerable)

PATH is a checkpoint folder, ``smollm2`` for SmolLM2-135M-Instruct (fetched and converted once), a .gguf file
(converted once) or a hub repository id: every name streamscope.load takes.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Optional, Sequence

import transformers

import streamscope

# First of the package's modules: `streamscope serve` runs in this process, and its server's anyio must load before
# nnsight does (streamscope/serve/__init__.py says why); the commands below import nnsight.
from . import serve  # noqa: F401  isort: skip
from .check import check
from .engine_registry import MODULES, prepare_process
from .models import UNRESOLVED, resolve
from .scale.command import add_arguments, command_harvest
from .testing.oracle import UnknownFamily
from .workflows.logit_lens import lens
from .workflows.patching import patch
from .workflows.plot import attention


def _load(path: str, engine: str) -> Any:
    prepare_process(engine)  # vLLM: one engine in this process
    return streamscope.load(path, engine=engine)


def _quiet() -> None:
    warnings.filterwarnings("ignore")

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def command_map(arguments: argparse.Namespace) -> int:
    model = _load(arguments.path, arguments.engine)
    print(model.support())
    print(f"\n{model.num_layers} blocks, hidden {model.hidden_size}, vocabulary {model.vocab_size}")
    return 0


def command_check(arguments: argparse.Namespace) -> int:
    engines = tuple(engine.strip() for engine in arguments.engines.split(",") if engine.strip())
    unknown = [engine for engine in engines if engine not in MODULES]
    if unknown:
        print(f"unknown engine {', '.join(unknown)}: choose from {', '.join(MODULES)}", file=sys.stderr)
        return 2
    for engine in engines:
        prepare_process(engine)

    try:
        report = check(arguments.path, engines, prompt=arguments.prompt, dtype=arguments.dtype)
    except UnknownFamily as refused:
        print(f"streamscope check: {refused}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.passed else 1


def command_lens(arguments: argparse.Namespace) -> int:
    model = _load(arguments.path, arguments.engine)
    result = lens(model, arguments.prompt, value=arguments.value, top_k=max(arguments.top_k, 1),
                  layers=arguments.layers)
    print(result.table(position=arguments.position, k=arguments.top_k))
    if arguments.png:
        print(f"wrote {result.plot(arguments.png, positions=arguments.positions)}")
    return 0


def command_patch(arguments: argparse.Namespace) -> int:
    model = _load(arguments.path, arguments.engine)
    result = patch(model, arguments.clean, arguments.corrupted, answer=arguments.answer, wrong=arguments.wrong,
                   value=arguments.value, layers=arguments.layers, positions=arguments.positions)
    print(result)
    if arguments.png:
        print(f"wrote {result.plot(arguments.png)}")
    return 0


def command_attention(arguments: argparse.Namespace) -> int:
    model = _load(arguments.path, arguments.engine)
    cache = model.cache(arguments.prompt, values=["self_attn.pattern"], layers=[arguments.layer], logits=False)
    tokens = [model.tokenizer.decode([int(token)]) for token in cache.tokens[0]]
    pattern = cache[f"layers.{arguments.layer}.self_attn.pattern"]
    written = attention(pattern, tokens, arguments.png, block=arguments.layer % model.num_layers, heads=arguments.heads,
                        drop_first=arguments.drop_first, log_scale=arguments.log_scale)
    print(f"wrote {written}")
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="streamscope", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, function: Any, engine: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("path", help="a checkpoint folder, smollm2, a .gguf file or a hub repository id")
        if engine:
            sub.add_argument("--engine", default="transformers", choices=tuple(MODULES))
        sub.set_defaults(function=function)
        return sub

    command("map", "print the support table: every value each block serves, or why not", command_map)
    check = command("check", "compare every served value on each engine with transformers' own forward; "
                    "exit 1 when any exceeds its tolerance", command_check, engine=False)
    check.add_argument("--engines", default="transformers,vllm", help="comma-separated (default: both)")
    check.add_argument("--prompt", default="The Eiffel Tower is in Paris, and the quick brown fox")
    check.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                       help="the engines' dtype (default float32); outside float32 on a CPU each value's tolerance "
                            "is measured: twice transformers' own distance at that precision")
    lens = command("lens", "the logit lens: every block's stream through the model's own head", command_lens)
    lens.add_argument("prompt")
    lens.add_argument("--png", help="write the heatmap to this file")
    lens.add_argument("--top-k", type=int, default=3)
    lens.add_argument("--position", type=int, default=-1)
    lens.add_argument("--value", default="layer_output", help="the block value read (default: layer_output)")
    lens.add_argument("--layers", type=_indices, help=INDICES.format("blocks to read"))
    lens.add_argument("--positions", type=_indices, help=INDICES.format("positions the heatmap shows"))
    patch = command("patch", "activation patching from a clean into a corrupted prompt", command_patch)
    patch.add_argument("--clean", required=True)
    patch.add_argument("--corrupted", required=True)
    patch.add_argument("--answer", required=True, help="the clean answer token (text or id)")
    patch.add_argument("--wrong", required=True, help="the corrupted answer token (text or id)")
    patch.add_argument("--value", default="layer_output",
                       help="layer_output, layer_input, layer_mid, attention_output, mlp_output, mlp.neurons, "
                            "head_outputs or head_results")
    patch.add_argument("--png", help="write the heatmap to this file")
    patch.add_argument("--layers", type=_indices, help=INDICES.format("blocks to patch"))
    patch.add_argument("--positions", type=_indices, help=INDICES.format("positions to patch"))
    attention = command("attention", "plot a block's attention pattern, one panel per head", command_attention)
    attention.add_argument("prompt")
    attention.add_argument("--layer", type=int, default=0)
    attention.add_argument("--png", required=True)
    attention.add_argument("--heads", type=_indices, help=INDICES.format("heads to draw"))
    attention.add_argument("--drop-first", action="store_true",
                           help="leave out the first (sink) token, so the scale shows the rest")
    attention.add_argument("--log-scale", action="store_true", help="colour by the logarithm of the weight")

    add_arguments(command("harvest", "harvest a dataset's values on Ray replicas into a resumable folder of shards",
                          command_harvest, engine=False))
    # Listed here for --help; `main` hands `serve` and everything after it to vLLM's own parser.
    serve_help = ("serve the model over HTTP: vLLM's OpenAI-compatible server, steerable and harvestable by name "
                  "(`streamscope serve --help` lists its options, vLLM's among them)")
    commands.add_parser("serve", help=serve_help, description=serve_help, add_help=False)
    return root


INDICES = "the {} (default: all): indices and ranges, 0,2,5-8; negative from the end"


def _indices(text: str) -> list[int]:
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


def _token(text: str) -> Any:
    return int(text) if text.lstrip("-").isdigit() else text


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # every vllm serve option is its own: vLLM's parser reads the rest
        return command_serve(argv[1:])
    arguments = parser().parse_args(argv)
    for name in ("answer", "wrong"):
        if hasattr(arguments, name):
            setattr(arguments, name, _token(getattr(arguments, name)))

    try:  # every command's PATH, once, as streamscope.load takes it (serve's in its own main)
        arguments.path = str(resolve(arguments.path))
    except UNRESOLVED as refused:
        print(f"streamscope {arguments.command}: {refused}", file=sys.stderr)
        return 2
    _quiet()
    return arguments.function(arguments)


def command_serve(argv: Sequence[str]) -> int:
    """``streamscope serve PATH [options]``: vLLM's parser reads every option (`streamscope.serve.server.main`)."""
    from .serve.server import main as serve_main  # imports vLLM: only for this command

    return serve_main(list(argv))


if __name__ == "__main__":
    sys.exit(main())
