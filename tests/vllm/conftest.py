"""vLLM on this CPU runs in this process, with a small KV cache; on a GPU (tests/GPU.md) in its own process.

STREAMSCOPE_TEST_DEVICE and STREAMSCOPE_TEST_DTYPE choose the run; tests/precision.py reads them and holds
every tolerance.
"""

import os

import precision

if not precision.ON_GPU:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_report_header(config):
    return precision.describe()
