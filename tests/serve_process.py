"""A `streamscope serve` process for the serving tests: started on a free port, waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

#: The API key every test server is started with.
KEY = "test-key"


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running(path, log: Path, *options: str):
    """``python -m streamscope serve PATH --api-key KEY *options`` on a free port: its URL, until the block ends."""
    port = _port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "streamscope", "serve", str(path), "--port", str(port), "--api-key", KEY,
               "--dtype", "float32", "--max-model-len", "512", *options]
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited ({process.returncode}):\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not come up in 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
