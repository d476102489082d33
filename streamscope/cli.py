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
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import streamscope

from .cli_table import COMMANDS, PATH_HELP, Command, implementation
from .engine_registry import MODULES, prepare_process

if TYPE_CHECKING:
    from .check import Report

# Nothing above imports torch, transformers, nnsight or an engine: the parser is `cli_table`'s, and each command's
# work reaches them when it runs, through the package's names loaded on first use (`streamscope.load`, `.lens`,
# `.patch`, `.plot`) or a module named here by its path (`implementation`).


def _load(path: str, engine: str) -> Any:
    prepare_process(engine)  # vLLM: one engine in this process
    return streamscope.load(path, engine=engine)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging = implementation("transformers.utils:logging")
    logging.set_verbosity_error()
    logging.disable_progress_bar()


def check(path: str, engines: Sequence[str], *, prompt: str, dtype: str) -> Report:
    """`streamscope.check.check`: every value each of `engines` serves of the checkpoint at `path`, against
    transformers' own forward. Its module (torch, both engines' families) loads when `streamscope check` runs."""
    compare: Callable[..., Report] = implementation("streamscope.check:check")
    return compare(path, engines, prompt=prompt, dtype=dtype)


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

    unknown_family = implementation("streamscope.testing.oracle:UnknownFamily")
    try:
        report = check(arguments.path, engines, prompt=arguments.prompt, dtype=arguments.dtype)
    except unknown_family as refused:
        print(f"streamscope check: {refused}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.passed else 1


def command_lens(arguments: argparse.Namespace) -> int:
    model = _load(arguments.path, arguments.engine)
    result = streamscope.lens(model, arguments.prompt, value=arguments.value, top_k=max(arguments.top_k, 1),
                              layers=arguments.layers)
    print(result.table(position=arguments.position, k=arguments.top_k))
    if arguments.png:
        print(f"wrote {result.plot(arguments.png, positions=arguments.positions)}")
    return 0


def command_patch(arguments: argparse.Namespace) -> int:
    model = _load(arguments.path, arguments.engine)
    result = streamscope.patch(model, arguments.clean, arguments.corrupted, answer=arguments.answer,
                               wrong=arguments.wrong, value=arguments.value, layers=arguments.layers,
                               positions=arguments.positions)
    print(result)
    if arguments.png:
        print(f"wrote {result.plot(arguments.png)}")
    return 0


def command_attention(arguments: argparse.Namespace) -> int:
    model = _load(arguments.path, arguments.engine)
    cache = model.cache(arguments.prompt, values=["self_attn.pattern"], layers=[arguments.layer], logits=False)
    tokens = [model.tokenizer.decode([int(token)]) for token in cache.tokens[0]]
    pattern = cache[f"layers.{arguments.layer}.self_attn.pattern"]
    written = streamscope.plot.attention(pattern, tokens, arguments.png, block=arguments.layer % model.num_layers,
                                         heads=arguments.heads, drop_first=arguments.drop_first,
                                         log_scale=arguments.log_scale)
    print(f"wrote {written}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The command's parser, built from `streamscope.cli_table.COMMANDS` (no command's module imported)."""
    root = argparse.ArgumentParser(prog="streamscope", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        if command.forwards:  # listed for --help; `main` hands the words after its name to its own parser
            commands.add_parser(command.name, help=command.help, description=command.help, add_help=False)
            continue
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        sub.add_argument("path", help=PATH_HELP)
        if command.engine:
            sub.add_argument("--engine", default="transformers", choices=tuple(MODULES))
        if command.declare is not None:
            command.declare(sub)
    return root


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``streamscope ARGV`` (default: this process's arguments); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    named: Optional[Command] = COMMANDS.get(argv[0]) if argv else None
    if named is not None and named.forwards:  # every vllm serve option is its own: vLLM's parser reads the rest
        forwarded: Callable[[list[str]], int] = implementation(named.runs)
        return forwarded(argv[1:])
    arguments = parser().parse_args(argv)
    command = COMMANDS[arguments.command]

    # Every command's PATH, once, as streamscope.load takes it (serve's in its own main).
    resolve, unresolved = implementation("streamscope.models:resolve"), implementation("streamscope.models:UNRESOLVED")
    try:
        arguments.path = str(resolve(arguments.path))
    except unresolved as refused:
        print(f"streamscope {arguments.command}: {refused}", file=sys.stderr)
        return 2
    _quiet()
    run: Callable[[argparse.Namespace], int] = implementation(command.runs)
    return run(arguments)


if __name__ == "__main__":
    sys.exit(main())
