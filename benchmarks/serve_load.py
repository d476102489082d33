"""streamscope serve under load against plain vLLM serve: every server up at once, workloads alternated by round.

Servers, all started together on the same checkpoint and engine settings and kept up for the whole run (on a GPU
each gets an equal share of the memory and the same fixed KV cache size, so none waits for another's memory):

* ``plain eager``: vLLM's server (``python -m vllm.entrypoints.openai.api_server``), eager;
* ``streamscope eager``: ``python -m streamscope serve``, eager;
* with ``--taps``: ``plain graphs`` (vLLM's server replaying CUDA graphs) and ``streamscope tapped`` (taps at the
  steered and harvested sites, graphs replayed);
* with ``--before TREE``: ``before eager``, an earlier streamscope tree's eager server, in the same rounds;
* with ``--control``: a second plain vLLM server in each pair (``plain eager B``, ``plain graphs B``), the same
  command as the first: its ratio to the first is what two identical servers differ by in this setup (placement on
  the GPU and the cores, order in the round, noise), the floor under any gap between streamscope and plain vLLM.

Workloads, each run by ``vllm.benchmarks.serve`` (random prompts, ``--input-len`` / ``--output-len`` tokens,
``--concurrency`` clients, ``--ignore-eos``), streamscope's part sent as the requests' extra body:

* ``plain``: no streamscope field;
* ``steer``: one stored vector added at ``layer_output`` of the middle block, every position;
* ``harvest``: every block's ``layer_output`` at the prompt's last position (kept on the server's disk: the load
  generator does not download).

A round runs every (server, workload) once (plain vLLM plain, streamscope plain, steer, harvest, then the next
pair), each round starting one run further along that list, so load that drifts over minutes lands on every
workload alike and no workload always runs first. The summary gives per workload the median and the spread
(min-max over rounds) of output throughput, p99 TTFT and mean TPOT, the ratios of the medians against plain vLLM's
plain median and against the same server's own plain median, and each bound of issue 18 judged two ways: by the
spreads (met or not met where the worst and best pairings of the two spreads agree, else inconclusive) and by the
rounds (the ratio within each round, whose runs were minutes apart: met or not met where every round agrees).
``--deadline S`` stops starting rounds that would end after S seconds and still prints what ran. ``--host-time``
also prints, per streamscope server and workload, the engine's host time per step in each part of streamscope's
work (planning, hooks, handing harvests over, the writer thread: `streamscope.serve.host_time`). Shapes:

    python benchmarks/serve_load.py --shape tiny --input-len 64 --output-len 16 --concurrency 8 --prompts 32
    python benchmarks/serve_load.py --shape llama3-8b --taps --prompts 384 --deadline 520   # H200: one 10-minute call
    python benchmarks/serve_load.py --shape tiny --input-len 64 --output-len 16 --concurrency 64 --prompts 256 --host-time
    python benchmarks/serve_load.py --shape tiny --input-len 64 --output-len 16 --before /tmp/old   # an earlier tree's eager server, same rounds
    python benchmarks/serve_load.py --shape llama3-8b --control --prompts 256 --deadline 520   # the eager pair and its A/A control
    python benchmarks/serve_load.py --shape tiny --input-len 64 --output-len 16 --rounds 1 --py-spy /tmp/spy

``--py-spy DIR`` (after the timed rounds, so it cannot disturb them): one more run of every (server, workload) with
``py-spy record`` sampling the server's whole process tree (front end, engine core, their threads; not idle
time), the raw stacks kept in DIR, and per server the busy seconds of each process and thread and the functions
that took the most of them, side by side: where a streamscope server's plain requests spend what plain vLLM's do
not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    target = folder / "llama3-8b"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(LLAMA3_8B))
    wide_tokenizer(target, LLAMA3_8B["vocab_size"])
    return target, ["--dtype", "bfloat16", "--load-format", "dummy", "--max-model-len", "4096"]


def engine_options(options: list[str], memory: float | None) -> dict[str, Any]:
    """`checkpoint`'s server options as `streamscope.load(..., engine="vllm")` keywords (an in-process engine of the
    same checkpoint), with ``gpu_memory_utilization=memory`` where given (on a GPU); its engine in child processes,
    as a server's is."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    found: dict[str, Any] = {"dtype": options[options.index("--dtype") + 1],
                             "max_model_len": int(options[options.index("--max-model-len") + 1])}
    if "--load-format" in options:
        found["load_format"] = "dummy"
    if memory is not None:
        found["gpu_memory_utilization"] = memory
    return found


def wide_tokenizer(folder: Path, size: int) -> None:
    """A tokenizer of `size` tokens (one word each, split on spaces) for a dummy-weight checkpoint.

    vLLM's random prompts are runs of consecutive token ids from a random
    start, modulo the tokenizer's vocabulary. With the test checkpoints' 512
    tokens, 256 prompts have about 155 distinct first KV blocks: a quarter of
    the prompt tokens come from the prefix cache on a server that runs only
    plain requests, and none on a harvest's (its cache salt is its own), which
    measured the cache, not streamscope. With the model's own vocabulary size
    the starts hardly ever meet.
    """
    from streamscope.testing.tokenizer import word_tokenizer

    word_tokenizer(size, bos_token_id=LLAMA3_8B["bos_token_id"], eos_token_id=LLAMA3_8B["eos_token_id"],
                   pad_token_id=0).save_pretrained(folder)


def port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server process, started at construction; `wait_up` returns once it answers ``/health``."""

    def __init__(self, command: list[str], log: Path, source: str | None = None,
                 environment: dict[str, str] | None = None) -> None:
        self.log = log
        self.port = port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               **(environment or {})}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # servers start at the same moment: each its own compile cache, so none reads another's half-written one
        env["VLLM_CACHE_ROOT"] = str(log.with_suffix(".cache"))
        if source is not None:  # another streamscope source tree (--before): first on the path, and the working
            # folder (``python -m`` puts the working folder before PYTHONPATH)
            env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
        self.handle = open(log, "w")
        self.process = subprocess.Popen([*command, "--port", str(self.port)], stdout=self.handle,
                                        stderr=subprocess.STDOUT, env=env, cwd=source)

    def wait_up(self, until: float) -> None:
        import httpx

        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > until:
                raise RuntimeError(f"server did not start: {self.log.read_text()[-3000:]}")
            time.sleep(2)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.handle.close()


def load(url: str, model: str, options: argparse.Namespace, extra: dict[str, Any] | None,
         prompts: int, seed: int) -> dict[str, Any]:
    """One run of vLLM's load generator (``vllm bench serve``) against `url`: `prompts` random requests; its result
    dict (``output_throughput`` tokens/s, ``p99_ttft_ms``, ``mean_tpot_ms``, ``completed``, ...)."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    argv = ["--backend", "vllm", "--base-url", url, "--model", model, "--dataset-name", "random",
            "--random-input-len", str(options.input_len), "--random-output-len", str(options.output_len),
            "--num-prompts", str(prompts), "--max-concurrency", str(options.concurrency),
            "--ignore-eos", "--seed", str(seed), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
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


BOUNDS = {"steer": (("throughput", ">=", 0.95), ("p99 TTFT", "<=", 1.2)), "harvest": (("throughput", ">=", 0.90),)}
METRICS = {"throughput": "output_throughput", "p99 TTFT": "p99_ttft_ms", "mean TPOT": "mean_tpot_ms"}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def verdict(results: list[dict], base: list[dict], metric: str, sense: str, bound: float) -> tuple[float, str]:
    """The ratio of the medians of `metric` (workload over base) and whether it meets `bound`: ``inconclusive`` when
    the ratio's spread (worst and best pairing of the two spreads) straddles the bound."""
    key = METRICS[metric]
    ours, theirs = [result[key] for result in results], [result[key] for result in base]
    if min(theirs) <= 0:  # the base completed nothing in a round (every request failed): no ratio to judge
        return float("nan"), "no ratio: the base run served nothing (its requests failed; see the run's report)"
    ratio = median(ours) / median(theirs)
    low, high = min(ours) / max(theirs), max(ours) / min(theirs)
    if low < bound < high:
        return ratio, "inconclusive"
    met = ratio >= bound if sense == ">=" else ratio <= bound
    return ratio, "met" if met else "NOT met"


def round_ratios(results: list[dict], base: list[dict], metric: str) -> list[float]:
    """`metric`'s ratio (workload over base) within each round both ran in."""
    key = METRICS[metric]
    return [ours[key] / theirs[key] if theirs[key] > 0 else float("nan") for ours, theirs in zip(results, base)]


def round_verdict(ratios: list[float], sense: str, bound: float) -> str:
    """Met or not met where every round's ratio agrees; else inconclusive."""
    met = [ratio >= bound if sense == ">=" else ratio <= bound for ratio in ratios]
    return "met" if all(met) else "NOT met" if not any(met) else "inconclusive"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    parser.add_argument("--taps", action="store_true", help="also plain graphs against a tapped streamscope server")
    parser.add_argument("--only-taps", action="store_true", help="the graphs pair alone")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=512, help="requests per run (512 at 64 clients: >= 15 s a run "
                                                                 "for Llama-3-8B's shape on an H200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every (server, workload) once")
    parser.add_argument("--deadline", type=float, help="seconds from the start: no round starts that would end "
                                                       "after it (predicted from the last round); the summary of "
                                                       "what ran is printed anyway")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0, help="fixed KV cache per server on a GPU")
    parser.add_argument("--host-time", action="store_true",
                        help="time streamscope's parts of every engine step on its servers "
                             "(streamscope/serve/host_time.py) and print them per workload")
    parser.add_argument("--logs", help="with --host-time: a folder to copy the streamscope servers' logs to")
    parser.add_argument("--before", help="another streamscope source tree (e.g. `git archive` of an earlier commit): "
                                         "its eager server runs in the same rounds, for a before/after row")
    parser.add_argument("--control", action="store_true", help="a second plain vLLM server in each pair, the same "
                                                                "command: what two identical servers differ by here")
    parser.add_argument("--py-spy", help="a folder: after the rounds, each (server, workload) run again under py-spy "
                                         "(the `py-spy` command on the path), its stacks kept there and summarized")
    options = parser.parse_args()
    began = time.monotonic()

    def stamp(phase: str, since: float) -> float:
        now = time.monotonic()
        print(f"[{now - began:7.1f} s] {phase}: {now - since:.1f} s", flush=True)
        return now

    folder = Path(tempfile.mkdtemp(prefix="serve-load-"))
    path, engine = checkpoint(options.shape, folder)
    config = json.loads((path / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    middle = layers // 2
    steer = {"streamscope": {"steer": [{"value": "layer_output", "layer": middle, "vector": "bench"}]}}
    harvest = {"streamscope": {"harvest": {"values": "layer_output", "layers": None, "positions": "last"}}}
    streamscope_loads: list[tuple[str, Any]] = [("plain", None), ("steer", steer), ("harvest", harvest)]
    taps = [f"layers.{middle}.layer_output", "layers.*.layer_output"]
    stored = ["--max-stored-harvest-bytes", str(2**36), "--harvest-ttl", "3600"]
    vllm_server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path)]
    # the model the load generator names is the checkpoint's path; streamscope serve answers to the folder's name
    # unless told (7802bd4), and refused every request here with 404 until this flag
    ours = [sys.executable, "-m", "streamscope", "serve", str(path), "--served-model-name", str(path)]
    eager = [*ours, "--graph-ops", "off"]  # a GPU server's default is the graph ops (benchmarks/graph_serve.py)
    graphs = ["-cc", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"})]
    # (name, command, workloads, source tree, the plain vLLM server it is judged against)
    setups: list[tuple[str, list[str], list[tuple[str, Any]], str | None, str]] = []
    if not options.only_taps:
        setups += [("plain eager", [*vllm_server, "--enforce-eager"], [("plain", None)], None, "plain eager"),
                   ("streamscope eager", eager, streamscope_loads, None, "plain eager")]
        if options.control:
            setups.append(("plain eager B", [*vllm_server, "--enforce-eager"], [("plain", None)], None, "plain eager"))
        if options.before:
            setups.append(("before eager", eager, streamscope_loads, str(Path(options.before).resolve()),
                           "plain eager"))
    if options.taps or options.only_taps:
        setups += [("plain graphs", [*vllm_server, *graphs], [("plain", None)], None, "plain graphs"),
                   ("streamscope tapped", [*ours, "--taps", *taps], streamscope_loads, None, "plain graphs")]
        if options.control:
            setups.append(("plain graphs B", [*vllm_server, *graphs], [("plain", None)], None, "plain graphs"))
    if options.shape != "tiny":  # an equal share of the GPU each, and the same KV cache whatever the share
        engine += ["--gpu-memory-utilization", f"{0.9 / len(setups):.3f}",
                   "--kv-cache-memory-bytes", str(int(options.kv_cache_gib * 2**30))]

    since = time.monotonic()
    servers: dict[str, Server] = {}
    try:
        for name, command, _, source, _ in setups:
            ours_server = name.split()[0] != "plain"
            extra = stored if ours_server else []
            timing = {"STREAMSCOPE_SERVE_HOST_TIME": "1"} if options.host_time and ours_server else None
            servers[name] = Server([*command, *engine, *extra], folder / f"{name.replace(' ', '-')}.log", source,
                                   timing)
        for server in servers.values():
            server.wait_up(since + 900)
        since = stamp(f"{len(servers)} servers up together ({', '.join(servers)})", since)

        import httpx
        import torch

        from streamscope.serve import host_time

        vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0)).tolist()
        for name, server in servers.items():
            if name.split()[0] != "plain":
                httpx.put(f"{server.url}/v1/streamscope/vectors/bench", json={"vector": vector}).raise_for_status()
        runs = [(name, workload, extra) for name, _, workloads, _, _ in setups for workload, extra in workloads]
        for index, (name, workload, extra) in enumerate(runs):  # the first steps of each kind of request
            load(servers[name].url, str(path), options, extra, options.concurrency, seed=10**6 + index)
        since = stamp(f"warm-up ({len(runs)} runs of {options.concurrency} requests)", since)

        results: dict[tuple[str, str], list[dict]] = {(name, workload): [] for name, workload, _ in runs}
        spans: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in results}  # wall clock
        last_round = 0.0
        for round_number in range(options.rounds):
            if options.deadline is not None and time.monotonic() - began + last_round > options.deadline:
                print(f"deadline {options.deadline:.0f} s: round {round_number + 1} would end after it; stopping",
                      flush=True)
                break
            shift = round_number % len(runs)
            for index, (name, workload, extra) in enumerate(runs[shift:] + runs[:shift]):
                # fresh prompts for every run: no run reads the prefix cache another filled
                start = time.time()
                result = load(servers[name].url, str(path), options, extra, options.prompts,
                              seed=1000 * round_number + index)
                spans[name, workload].append((start, time.time()))
                if options.host_time:  # the worker's last totals of this run printed before the next run begins
                    time.sleep(host_time.INTERVAL * 1.5)
                results[name, workload].append(result)
                print(f"  round {round_number + 1} {name} {workload}: {result['output_throughput']:.1f} out tok/s, "
                      f"p99 TTFT {result['p99_ttft_ms']:.1f} ms, mean TPOT {result['mean_tpot_ms']:.2f} ms, "
                      f"{result['completed']}/{options.prompts} completed", flush=True)
            last_round = time.monotonic() - since
            since = stamp(f"round {round_number + 1}", since)
        profiles = {}
        if options.py_spy:
            for name, workload, extra in runs:
                label = name if workload == "plain" else f"{name} {workload}"
                if options.deadline is not None and time.monotonic() - began + 2 * last_round / max(len(runs), 1) \
                        > options.deadline:
                    print(f"deadline {options.deadline:.0f} s: no profile of {label}", flush=True)
                    break
                try:  # a profile that fails loses only itself: the rounds above are still summarized
                    profiles[label] = profiled(servers[name], Path(options.py_spy) / f"{label.replace(' ', '-')}.txt",
                                               lambda name=name, extra=extra: load(servers[name].url, str(path),
                                                                                   options, extra, options.prompts,
                                                                                   seed=999))
                except Exception as error:  # noqa: BLE001
                    print(f"no profile of {label}: {type(error).__name__}: {error}", flush=True)
            since = stamp(f"profiled runs ({len(profiles)})", since)
        written = {}
        for name, server in servers.items():  # every harvest was written (the load generator does not download)
            if (name, "harvest") in results:
                expected = options.concurrency + options.prompts * len(results[name, "harvest"])
                written[name] = harvests_written(server.url, expected)
    finally:
        for server in servers.values():
            server.close()
    since = stamp("servers closed", since)
    summary(options, results, setups, written)
    if options.host_time:
        host_times(servers, spans, options.logs and Path(options.logs))
        front_times({name: server for name, server in servers.items() if name.split()[0] != "plain"}, spans)
    if profiles:
        try:
            profile_summary(profiles)
        except Exception as error:  # noqa: BLE001  (the raw stacks are kept in --py-spy's folder)
            print(f"the profiles could not be summarized: {type(error).__name__}: {error}", flush=True)
    print(f"total {time.monotonic() - began:.1f} s")


SPY_RATE = 200  # samples a second


def profiled(server: Server, out: Path, run: Any) -> tuple[dict[str, Any], Path]:
    """`run()` (one load) with py-spy sampling `server`'s process tree; the load's result and the raw stacks' file."""
    import signal

    out.parent.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.process.pid), "--subprocesses", "--threads",
                            "--nonblocking", "--nolineno", "--rate", str(SPY_RATE), "--format", "raw", "-o",
                            str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attached to every process before the load starts
    try:
        result = run()
    finally:
        spy.send_signal(signal.SIGINT)
        try:
            _, errors = spy.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, errors = spy.communicate()
    if not out.exists():
        print(f"py-spy wrote nothing for {out.stem}: {errors.decode(errors='replace')[-500:]}", flush=True)
    return result, out


def stacks(path: Path) -> list[tuple[str, str, list[str], int]]:
    """py-spy's raw stacks: (process, thread, frames, samples); a process is named by its depth in the server's
    tree (``front`` the server's own, ``engine`` its child, ``engine/1`` the engine's first child, ...) and a
    thread by its name."""
    found = []
    pids: dict[int, list[str]] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        processes = [frame for frame in frames if frame.startswith("process ")]
        threads = [frame for frame in frames if frame.startswith("thread (")]
        rest = [frame for frame in frames if not frame.startswith(("process ", "thread ("))]
        depth = len(processes)
        pid = int(processes[-1].split()[1].rstrip(":").split(":")[0]) if processes else 0
        siblings = pids.setdefault(depth, [])
        if pid not in siblings:
            siblings.append(pid)
        name = {1: "front", 2: "engine"}.get(depth, f"engine/{depth - 2}")
        if siblings.index(pid):
            name += f"#{siblings.index(pid)}"
        thread = threads[-1].split(": ", 1)[-1] if threads else "?"
        found.append((name, thread, rest, int(count)))
    return found


def profile_summary(profiles: dict[str, tuple[dict[str, Any], Path]], top: int = 14) -> None:
    """Per server, the busy seconds of each process and thread in its profiled plain run, then each main thread's
    functions with the most self time, every server's seconds side by side."""
    from collections import Counter

    loaded = {name: stacks(path) for name, (_, path) in profiles.items() if path.exists()}
    print(f"\npy-spy, each (server, workload) run again ({SPY_RATE} samples/s, busy time only): seconds per "
          "process and thread")
    for name, rows in loaded.items():
        result = profiles[name][0]
        busy: Counter = Counter()
        for process, thread, _, count in rows:
            busy[process, thread] += count
        cells = ", ".join(f"{process}/{thread} {count / SPY_RATE:.2f}" for (process, thread), count in
                          sorted(busy.items(), key=lambda item: -item[1])[:8])
        print(f"  {name} ({result['output_throughput']:.0f} out tok/s, p99 TTFT {result['p99_ttft_ms']:.0f} ms, "
              f"{result.get('duration', 0):.2f} s): {cells}")
    processes = sorted({process for rows in loaded.values() for process, _, _, _ in rows if "#" not in process})
    for process in processes:  # front, engine, and engine/1 where the worker is a process of its own (the CPU)
        selfs = {name: Counter() for name in loaded}
        inclusive = {name: Counter() for name in loaded}
        for name, rows in loaded.items():
            for where, thread, frames, count in rows:
                if where == process and thread == "MainThread" and frames:
                    selfs[name][frames[-1]] += count
                    for frame in set(frames):
                        inclusive[name][frame] += count
        for title, table in (("self", selfs), ("inclusive", inclusive)):
            frames = set().union(*table.values())
            if title == "self":  # the most time, over every server
                ranked = sorted(frames, key=lambda frame: -sum(counts[frame] for counts in table.values()))
            else:  # the calls whose time differs the most between the servers
                ranked = sorted(frames, key=lambda frame: -(max(counts[frame] for counts in table.values())
                                                             - min(counts[frame] for counts in table.values())))
            heading = "most self time" if title == "self" else "inclusive time that differs the most"
            print(f"\n{process} main thread, {heading} (s): " + " | ".join(loaded))
            for frame in ranked[:top]:
                print("  " + " | ".join(f"{table[name][frame] / SPY_RATE:7.2f}" for name in loaded) + f"  {frame}")


def host_times(servers: dict[str, Server], spans: dict[tuple[str, str], list[tuple[float, float]]],
               logs: Path | None) -> None:
    """Per streamscope server and workload, the engine's host time per step in each part (median over rounds):
    the difference of the worker's running totals around each run (`streamscope.serve.host_time`)."""
    from streamscope.serve import host_time

    print("\nhost time per engine step (median over rounds; plan, hooks and send are within step, enter, fill and "
          "copy within plan, wait, pack, launch and event within copy; writer is the harvest writer's thread; rows "
          "and reqs: the mean batch, its scheduled tokens and requests; plan cpu and copy cpu: the thread's CPU time "
          "in them, their wall time above it a wait, for the GIL or a blocking call; pf: the steps that run prompt "
          "rows, their share, and step and plan ms over those steps and over the decode-only rest)")
    print(f"{'server':<20}{'workload':<9}{'steps':>8}{'step ms':>10}{'plan us':>10}{'hooks us':>10}{'send us':>10}"
          f"{'writer us':>11}{'enter us':>10}{'fill us':>10}{'copy us':>10}{'wait us':>10}{'pack us':>10}"
          f"{'launch us':>10}{'event us':>10}{'rows':>8}{'reqs':>7}{'plan cpu':>10}{'copy cpu':>10}{'pf share':>9}"
          f"{'pf step ms':>11}{'dec step ms':>12}{'pf plan us':>11}{'dec plan us':>12}")
    for name, server in servers.items():
        lines = [parsed for line in server.log.read_text(errors="replace").splitlines()
                 if host_time.PREFIX in line and (parsed := host_time.parse(line)) is not None]
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(server.log, logs / server.log.name)
        if not lines:
            continue
        for (server_name, workload), windows in spans.items():
            if server_name != name or not windows:
                continue
            rows = []
            for start, end in windows:
                before = next((totals for stamp_, totals in reversed(lines) if stamp_ < start), None)
                after = next((totals for stamp_, totals in reversed(lines)
                              if stamp_ < end + host_time.INTERVAL * 1.4), None)
                if after is None:
                    continue
                base = before or dict.fromkeys(after, 0.0)
                steps = after["steps"] - base["steps"]
                if steps > 0:
                    rows.append({key: (after[key] - base[key]) / (1 if key == "steps" else steps) for key in after})
            if rows:
                cell = {key: median([row[key] for row in rows]) for key in rows[0]}
                print(f"{name:<20}{workload:<9}{cell['steps']:>8.0f}{cell['step'] * 1e3:>10.3f}"
                      f"{cell['plan'] * 1e6:>10.1f}{cell['hooks'] * 1e6:>10.1f}{cell['send'] * 1e6:>10.1f}"
                      f"{cell['writer'] * 1e6:>11.1f}{cell['enter'] * 1e6:>10.1f}{cell['fill'] * 1e6:>10.1f}"
                      f"{cell['copy'] * 1e6:>10.1f}{cell.get('wait', 0.0) * 1e6:>10.1f}"
                      f"{cell.get('pack', 0.0) * 1e6:>10.1f}{cell.get('launch', 0.0) * 1e6:>10.1f}"
                      f"{cell.get('event', 0.0) * 1e6:>10.1f}{cell.get('rows', 0.0):>8.1f}{cell.get('requests', 0.0):>7.1f}"
                      f"{cell.get('plan_cpu', 0.0) * 1e6:>10.1f}{cell.get('copy_cpu', 0.0) * 1e6:>10.1f}"
                      + by_step_kind(cell))


def by_step_kind(cell: dict[str, float]) -> str:
    """The host-time table's last columns: the share of steps that run prompt rows, and step and plan time over those
    steps and over the decode-only rest (`cell` holds per-step means: a total over the prefill steps, divided by
    every step, is divided again by their share)."""
    share = cell.get("prefill_steps", 0.0)
    prefill = [cell.get(f"{part}_prefill", 0.0) / share if share else 0.0 for part in ("step", "plan")]
    decode = [(cell[part] - cell.get(f"{part}_prefill", 0.0)) / (1 - share) if share < 1 else 0.0
              for part in ("step", "plan")]
    return (f"{share:>9.3f}{prefill[0] * 1e3:>11.3f}{decode[0] * 1e3:>12.3f}{prefill[1] * 1e6:>11.1f}"
            f"{decode[1] * 1e6:>12.1f}")


def front_times(servers: dict[str, Server], spans: dict[tuple[str, str], list[tuple[float, float]]]) -> None:
    """Per streamscope server and workload, the front end's mean time a request (median over rounds): from its
    arrival to its hand-over to vLLM (``admit``), and from there to its first body bytes (``first``: the time to
    its first token in vLLM and the engine), from the running totals the front end prints
    (`streamscope.serve.host_time.FrontTime`); a workload named plain is read from the plain requests' totals."""
    from streamscope.serve import host_time

    print("\nthe front end's time a request (median over rounds): arrival to vLLM, and vLLM to the first bytes")
    print(f"{'server':<20}{'workload':<16}{'requests':>9}{'admit ms':>10}{'first ms':>10}")
    for name, server in servers.items():
        lines = [parsed for line in server.log.read_text(errors="replace").splitlines()
                 if host_time.FRONT_PREFIX in line and (parsed := host_time.parse_front(line)) is not None]
        for (server_name, workload), windows in spans.items():
            if server_name != name or not windows or not lines:
                continue
            kind = "plain" if workload == "plain" else "streamscope"
            rows = []
            for start, end in windows:
                before = next((totals[kind] for stamp, totals in reversed(lines) if stamp < start), (0, 0.0, 0.0))
                after = next((totals[kind] for stamp, totals in reversed(lines)
                              if stamp < end + host_time.INTERVAL * 1.4), None)
                if after is not None and after[0] > before[0]:
                    count = after[0] - before[0]
                    rows.append((count, (after[1] - before[1]) / count, (after[2] - before[2]) / count))
            if rows:
                print(f"{name:<20}{workload:<16}{median([row[0] for row in rows]):>9.0f}"
                      f"{median([row[1] for row in rows]) * 1e3:>10.2f}{median([row[2] for row in rows]) * 1e3:>10.1f}")


def summary(options: argparse.Namespace, results: dict[tuple[str, str], list[dict]], setups: list,
            written: dict[str, str]) -> None:
    rounds = max((len(values) for values in results.values()), default=0)
    print(f"\nshape {options.shape}: {options.input_len} prompt / {options.output_len} generated tokens, "
          f"{options.concurrency} clients, {options.prompts} requests per run, {rounds} round(s); "
          "median [min-max] over rounds")
    print(f"{'server':<20}{'workload':<9}{'out tok/s':>26}{'p99 TTFT ms':>26}{'mean TPOT ms':>24}"
          f"{'thr/vLLM':>10}{'TTFT/vLLM':>11}{'thr/own':>9}{'TTFT/own':>10}")
    base_of = {name: base for name, _, _, _, base in setups}
    for (name, workload), values in results.items():
        if not values:
            continue
        cells = []
        for key, width, digits in (("output_throughput", 26, 1), ("p99_ttft_ms", 26, 1), ("mean_tpot_ms", 24, 2)):
            series = [value[key] for value in values]
            cells.append(f"{median(series):.{digits}f} [{min(series):.{digits}f}-{max(series):.{digits}f}]"
                         .rjust(width))
        ratios = []
        for base in (results.get((base_of[name], "plain")), results.get((name, "plain"))):
            for metric in ("throughput", "p99 TTFT"):
                if base:
                    ratios.append(f"{verdict(values, base, metric, '>=', 0)[0]:.3f}")
                else:
                    ratios.append("-")
        print(f"{name:<20}{workload:<9}{''.join(cells)}{ratios[0]:>10}{ratios[1]:>11}{ratios[2]:>9}{ratios[3]:>10}")
    print("\nbounds (issue 18; the ratio of medians judged by the spreads, then the ratio in each round judged by "
          "the rounds):")
    for (name, workload), values in results.items():
        if name.split()[0] == "plain" or workload not in BOUNDS or not values:
            continue
        for against, base in (("plain vLLM", results.get((base_of[name], "plain"))),
                              ("own plain", results.get((name, "plain")))):
            if not base:
                continue
            for metric, sense, bound in BOUNDS[workload]:
                ratio, judged = verdict(values, base, metric, sense, bound)
                rounds = round_ratios(values, base, metric)
                print(f"  {name} {workload} {metric} against {against}: {ratio:.3f} ({sense} {bound}): {judged}; "
                      f"by round {' '.join(f'{value:.3f}' for value in rounds)}: {round_verdict(rounds, sense, bound)}")
    controls = [(name, base) for name, _, _, _, base in setups if name != base and name.split()[0] == "plain"]
    if controls:
        print("\ncontrol (a second plain vLLM server against the first, the same command: the setup's own gap):")
    for name, base in controls:
        values, first = results.get((name, "plain")), results.get((base, "plain"))
        if not values or not first:
            continue
        for metric in ("throughput", "p99 TTFT"):
            rounds = round_ratios(values, first, metric)
            print(f"  {name} against {base}, {metric}: {verdict(values, first, metric, '>=', 0)[0]:.3f} "
                  f"(by round {' '.join(f'{value:.3f}' for value in rounds)})")
    for name, count in written.items():
        print(f"{name}: harvests written {count}")


if __name__ == "__main__":
    main()
