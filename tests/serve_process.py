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


#: Starts tried when the chosen port was taken between choosing and binding (another test's server or vLLM's
#: own sockets can take it in that moment; CI saw it once in 5,000 tests).
STARTS = 3


@contextlib.contextmanager
def running(path, log: Path, *options: str):
    """``python -m streamscope serve PATH --api-key KEY *options`` on a free port: its URL, until the block ends."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    for start in range(STARTS):
        port = _port()
        # Hooks unless a test asks for the graph ops: a GPU server's default is the graph ops (where hooks do not
        # fire), a CPU server's eager hooks; the serve tests hold the hook path to the same on both.
        hooks = [] if any(option.startswith("--graph-ops") for option in options) else ["--graph-ops", "off"]
        command = [sys.executable, "-m", "streamscope", "serve", str(path), "--port", str(port), "--api-key", KEY,
                   "--dtype", "float32", "--max-model-len", "512", *hooks, *options]
        with open(log, "w") as handle:
            process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        if _came_up(process, url, log, last=start == STARTS - 1):
            break
    try:
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def _came_up(process: subprocess.Popen, url: str, log: Path, last: bool) -> bool:
    """Whether the server answers /health; False (to start again) only when its port was taken before it bound."""
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            text = log.read_text()
            if "Address already in use" in text and not last:
                return False
            pytest.fail(f"the server exited ({process.returncode}):\n{text[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not come up in 300 s:\n{log.read_text()[-4000:]}")
        time.sleep(1)
