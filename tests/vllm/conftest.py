"""vLLM runs in this process (its CPU engine), with a small KV cache."""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
