"""streamscope serve under load, against plain vLLM serve, in one run, with vLLM's own load generator.

Servers, one at a time, on the same checkpoint and engine settings:

* ``plain``: vLLM's server (``python -m vllm.entrypoints.openai.api_server``), eager;
* ``streamscope``: ``python -m streamscope serve``, eager (and, with ``--taps``, a tapped one replaying CUDA graphs,
  beside a plain vLLM server with the same graph settings).

Workloads, each run by ``vllm.benchmarks.serve`` (random prompts, ``--input-len`` / ``--output-len`` tokens,
``--concurrency`` clients), with streamscope's part sent as the requests' extra body:

* ``plain``: no streamscope field;
* ``steer``: one stored vector added at ``layer_output`` of the middle block, every position;
* ``harvest``: every block's ``layer_output`` at the prompt's last position (kept on the server's disk until it
  expires: the load generator does not download).

Prints request and output throughput and p99 TTFT per (server, workload), with each streamscope figure as a ratio
of plain vLLM's plain one. Shapes:

    python benchmarks/serve_load.py --shape tiny                 # this CPU: a 3-block float32 Llama
    python benchmarks/serve_load.py --shape llama3-8b --taps     # a GPU: Llama-3-8B's shape, dummy weights, bf16
    python benchmarks/serve_load.py --shape tiny --before /tmp/old   # also an earlier tree's eager server, same run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "vocab_size": 128256, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
             "bos_token_id": 1, "eos_token_id": 2}


def checkpoint(shape: str, folder: Path) -> tuple[Path, list[str]]:
    """The checkpoint and the engine options for `shape`."""
    from streamscope.testing import build_checkpoint

    if shape == "tiny":
        return build_checkpoint("llama", folder / "tiny"), ["--dtype", "float32", "--max-model-len", "512"]
    path = build_checkpoint("llama", folder / "tokenizer-source")
    target = folder / "llama3-8b"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(LLAMA3_8B))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((path / name).read_bytes())
    return target, ["--dtype", "bfloat16", "--load-format", "dummy", "--max-model-len", "4096",
                    "--gpu-memory-utilization", "0.85"]


def port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, command: list[str], log: Path, source: str | None = None) -> None:
        import httpx

        self.port = port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if source is not None:  # another streamscope source tree (--before): first on the path, and the working
            # folder (``python -m`` puts the working folder before PYTHONPATH)
            env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
        self.handle = open(log, "w")
        self.process = subprocess.Popen([*command, "--port", str(self.port)], stdout=self.handle,
                                        stderr=subprocess.STDOUT, env=env, cwd=source)
        deadline = time.monotonic() + 900
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")
            time.sleep(2)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.handle.close()


def load(url: str, model: str, options: argparse.Namespace, extra: dict[str, Any] | None) -> dict[str, Any]:
    """One run of vLLM's load generator (``vllm bench serve``) against `url`; its result dict."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    argv = ["--backend", "vllm", "--base-url", url, "--model", model, "--dataset-name", "random",
            "--random-input-len", str(options.input_len), "--random-output-len", str(options.output_len),
            "--num-prompts", str(options.prompts), "--max-concurrency", str(options.concurrency),
            "--ignore-eos", "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99"]
    if extra:
        argv += ["--extra-body", json.dumps(extra)]
    return serve.main(parser.parse_args(argv))


def harvests_written(url: str, expected: int, wait: float = 30.0) -> str:
    """How many of the run's harvests are on the server's disk, ready to download (waiting for the writer)."""
    import httpx

    deadline = time.monotonic() + wait
    while True:
        listing = httpx.get(f"{url}/v1/streamscope/harvests", timeout=30).json()["harvests"]
        ready = sum(1 for item in listing if item["ready"])
        if ready >= expected or time.monotonic() > deadline:
            return f"{ready}/{expected} (of {len(listing)} reserved)"
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    parser.add_argument("--taps", action="store_true", help="also a tapped streamscope server (CUDA graphs)")
    parser.add_argument("--only-taps", action="store_true", help="the tapped pair alone (a second run's half)")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each workload; the median one is reported")
    parser.add_argument("--before", help="another streamscope source tree (e.g. `git archive` of an earlier commit): "
                                         "its eager server runs too, in the same invocation, for a before/after row")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="serve-load-"))
    path, engine = checkpoint(options.shape, folder)
    config = json.loads((path / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    middle = layers // 2
    steer = {"streamscope": {"steer": [{"value": "layer_output", "layer": middle, "vector": "bench"}]}}
    harvest = {"streamscope": {"harvest": {"values": "layer_output", "layers": None, "positions": "last"}}}
    runs: list[tuple[str, str, dict]] = []
    taps = [f"layers.{middle}.layer_output", "layers.*.layer_output"]
    stored = ["--max-stored-harvest-bytes", str(2**36), "--harvest-ttl", "600"]
    setups: list[tuple[str, list[str], list[tuple[str, Any]], str | None]] = [
        ("plain eager", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), *engine,
                         "--enforce-eager"], [("plain", None)], None),
        ("streamscope eager", [sys.executable, "-m", "streamscope", "serve", str(path), *engine, *stored],
         [("plain", None), ("steer", steer), ("harvest", harvest)], None)]
    if options.before:
        setups.append(("before eager", [sys.executable, "-m", "streamscope", "serve", str(path), *engine, *stored],
                       [("plain", None), ("steer", steer), ("harvest", harvest)], str(Path(options.before).resolve())))
    if options.only_taps:
        setups = []
    if options.taps or options.only_taps:
        setups += [("plain graphs", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
                                     *engine, "-cc", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"})],
                    [("plain", None)], None),
                   ("streamscope tapped", [sys.executable, "-m", "streamscope", "serve", str(path), *engine,
                                           "--taps", *taps, *stored],
                    [("plain", None), ("steer", steer), ("harvest", harvest)], None)]
    written: dict[str, str] = {}
    for name, command, workloads, source in setups:
        started = time.monotonic()
        server = Server(command, folder / f"{name.replace(' ', '-')}.log", source)
        print(f"{name}: up in {time.monotonic() - started:.0f} s", flush=True)
        try:
            if not name.startswith("plain"):
                import httpx
                import torch

                vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0)).tolist()
                httpx.put(f"{server.url}/v1/streamscope/vectors/bench", json={"vector": vector}).raise_for_status()
            for workload, extra in workloads:
                warm = argparse.Namespace(**{**vars(options), "prompts": min(options.prompts, options.concurrency)})
                load(server.url, str(path), warm, extra)  # warm-up: the first run pays the engine's first steps
                results = sorted((load(server.url, str(path), options, extra) for _ in range(options.rounds)),
                                 key=lambda result: result["output_throughput"])
                runs.append((name, workload, results[len(results) // 2]))
                print(f"{name} {workload}: {runs[-1][2]['output_throughput']:.1f} out tok/s, p99 TTFT "
                      f"{runs[-1][2]['p99_ttft_ms']:.1f} ms", flush=True)  # kept if a later server fails
                if workload == "harvest":  # every harvest was written (the load generator does not download)
                    written[name] = harvests_written(server.url, warm.prompts + options.rounds * options.prompts)
        finally:
            server.close()
    baseline = {kind: result for name, workload, result in runs if workload == "plain"
                for kind in [name.split()[1]] if name.startswith("plain")}
    print(f"\nshape {options.shape}: {options.input_len} prompt / {options.output_len} generated tokens, "
          f"{options.concurrency} clients, {options.prompts} requests per run, median of {options.rounds}")
    print(f"{'server':<20}{'workload':<10}{'req/s':>9}{'out tok/s':>11}{'p99 TTFT ms':>13}{'thr ratio':>11}"
          f"{'TTFT ratio':>12}")
    for name, workload, result in runs:
        base = baseline.get("graphs" if "tapped" in name else "eager", result)
        print(f"{name:<20}{workload:<10}{result['request_throughput']:>9.2f}{result['output_throughput']:>11.1f}"
              f"{result['p99_ttft_ms']:>13.1f}{result['output_throughput'] / base['output_throughput']:>11.3f}"
              f"{result['p99_ttft_ms'] / base['p99_ttft_ms']:>12.3f}")
    for name, count in written.items():
        print(f"{name}: harvests written {count}")


if __name__ == "__main__":
    main()
