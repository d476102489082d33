"""vLLM on this CPU runs in this process, with a small KV cache; on a GPU (tests/GPU.md) in its own process.

STREAMSCOPE_TEST_DEVICE and STREAMSCOPE_TEST_DTYPE choose the run; tests/precision.py reads them and holds
every tolerance.
"""

import os
from pathlib import Path

import precision

if not precision.ON_GPU:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A trace body runs in the engine's worker, which imports the test helpers it names (matrix, access) by
# module: an engine in its own process (a GPU's, or VLLM_ENABLE_V1_MULTIPROCESSING=1) must find them too.
_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_TESTS, os.environ.get("PYTHONPATH")]))


def pytest_report_header(config):
    return precision.describe()
