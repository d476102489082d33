"""The transformers suite in a process that may have run a vLLM engine before.

Under pytest-xdist a worker runs whole files of both suites in any order. vLLM's Transformers backend decorates
transformers' own GPT-NeoX and OLMo 2 classes in place once an engine has loaded them, and an instance built
afterwards asks for a current vLLM config: the oracle's plain `from_pretrained` then needs the context
`streamscope.load` itself uses (`beside_engine`: an eager config, so the classes build as transformers' own).
"""

import sys

import pytest


@pytest.fixture(autouse=True, scope="module")
def beside_any_vllm_engine():
    if "streamscope.vllm.model" not in sys.modules:
        yield
        return
    from streamscope.vllm.model import beside_engine

    with beside_engine():
        yield
