"""The engine a bulk-path test module shares: a model on one engine beside its oracle (transformers' float32
forward of the same checkpoint, computing the family's own function) and the checkpoint's tokenizer.

A module asks for one fixture, module-scoped, one engine per parameter::

    engine = bulk_engines.fixture("vllm", BULK_FAMILIES)              # each family's tiny checkpoint
    engine = bulk_engines.fixture("vllm", [*BULK_FAMILIES, "llama-tapped"], taps=TAPS)   # "-tapped": started with taps

The test then reads ``engine.model``, ``engine.reference``, ``engine.tokenizer``, ``engine.family`` and ``engine.path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import pytest
from transformers import AutoTokenizer

import attention_oracle
import precision
import streamscope
from streamscope.vllm.model import beside_engine

#: The suffix of a parameter whose engine starts with the module's taps (`fixture`'s ``taps``).
TAPPED = "-tapped"


class BulkEngine:
    """`family`'s checkpoint at `path` loaded on `engine`, with its oracle and tokenizer."""

    def __init__(self, engine: str, family: str, path: Path, **options: Any) -> None:
        self.engine, self.family, self.path = engine, family, path
        if engine == "vllm":
            self.model = streamscope.load(path, engine="vllm", **options, **precision.engine_kwargs())
            with beside_engine():  # the reference's threads beside the engine's, as a user's would be
                self.reference = attention_oracle.reference_model(path)
        else:
            self.model = streamscope.load(path, **options)
            self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def close(self) -> None:
        if self.engine == "vllm":
            self.model.close()


def fixture(engine: str, params: Sequence[str], taps: Optional[Sequence[str]] = None) -> Any:
    """A module-scoped pytest fixture named ``engine``: one `BulkEngine` per parameter, closed when the module ends.

    A parameter is a family of the tiny checkpoints, or ``<family>-tapped`` for the family's engine started with
    `taps` (vLLM's taps: the decode steps replay CUDA graphs on a GPU and the hooks run at the taps).
    """

    @pytest.fixture(scope="module", params=list(params), name="engine")
    def _engine(request: Any, checkpoints: Any) -> Any:
        family = request.param.removesuffix(TAPPED)
        options = {"taps": list(taps or ())} if request.param.endswith(TAPPED) else {}
        loaded = BulkEngine(engine, family, checkpoints(family), **options)
        yield loaded
        loaded.close()

    return _engine
