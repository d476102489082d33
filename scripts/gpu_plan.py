"""The open issues' GPU measurements, several to one device call, each under its own time limit.

A device call lasts at most ten minutes and a session has thirty, so the parts
run back to back in one call, each a child process with a limit; a part that
would not end before `--deadline` (seconds from the start) is not started, and
says so. Each part's output goes to ``<out>/<part>.log`` and its last lines to
the console; ``<out>/plan.txt`` lists what ran, for how long and how it ended.

  suite    the tapped engines (every family: values, edits, steers, the ablation's replayed
           graphs) and the lifecycle file, bfloat16                                          about 6 min
  ablate   issue 21: an ablation at every block against bare generation, tapped engine,
           in this tree and in each `--tree` (an earlier commit, to compare), 12 rounds      about 3 min a tree
  w2       issue 24: W2's steer written in a trace against bare, and its variants (each run
           printed as it ends: a run cut short still says how far it got), then raw nnsight's
           same trace against its own bare                                                     5-8 min
  w2host   issue 24: W2's trace taken apart (each part's cost by removing it, side by side), the host
           cost of the single ops of an invoke-step, and py-spy's samples of the trace; then the same,
           without py-spy, in each `--tree`                                                       4-5 min a tree
  xproc    issue 24: the T trace with the engine core in its own process (packed saves,
           pickled saves, invokes pickled one by one)                                          about 2 min
  profile  issues 21 and 24: where the host time goes, under cProfile: the ablation at every
           block (tapped, after 3 timed rounds) and W2's steer in a trace on a tapped engine     about 6 min
  harvest70b  issue 43: `benchmarks/harvest_scale.py`, the Llama-3-70B shape in FP8: 6 blocks' layer_output
           at every position to shards, against bare prefill (3 rounds), the disk and host copies alone,
           SAELens's ActivationsStore on the same engine (`harvest70b-parquet`: a 1-replica Parquet harvest
           over Ray and an SAE's steps on its rows; `harvest8b`: the 8B shape; `harvest70b-h100` and
           `harvest70b-parquet-h100`: the same on an 80 GB H100, 0.95 of its memory, 8,192 tokens a step) about 9 min
  serve    issue 18: `streamscope serve` against plain `vllm serve` under load, eager
           and tapped pairs, with the servers' host time per step by part
           (needs `.whl-gpu/serve` installed into /tmp/site)                                   about 9 min
  control  issue 18: the eager pair with its A/A control (a second plain vLLM server, the same
           command): whether streamscope's plain requests' extra p99 TTFT on the H200 is
           streamscope's or the setup's (`control-taps`: the graphs pair the same way)           about 9 min
  spy      issue 18: the eager pair, 2 rounds, then every (server, workload) run again under
           py-spy (its binary taken from the wheel in .whl-gpu/serve): where each process and
           thread spends its busy time, plain vLLM's beside streamscope's                        about 5 min
  graph39  issue 39: `benchmarks/graph_serve.py`, plain `vllm serve` (its defaults), its A/A control,
           `streamscope serve --graph-ops` and hotwire-vllm 0.1.2 up at once; plain requests and a
           steer at one block with 1, 16 and 256 distinct vectors (hotwire: 1 and 256), 5 rounds       about 9 min
  graph39-every  the same servers but hotwire: a steer at every block (1, 16, 256 vectors), an
           ablation at every block, the harvests of every block's last position and of 4 blocks at
           every position, 5 rounds (the two calls share compile caches in /tmp/graph39)          about 9 min
  graph39-h100  the same as graph39 where an H100's 80 GB holds two 8B servers: plain `vllm serve` and
           streamscope's graph-ops server only (no A/A control, no hotwire), plain requests and a steer at one
           block (1, 16, 256 vectors), 5 rounds                                                  about 5 min
  graph39-warm  the two servers of graph39-h100 started (cold: more than 330 s on an H100 on 2026-12-06), checked
           and stopped, each server's last log line printed every 30 s: their compile caches in /tmp/graph39 make
           the next call's start short (run it first on a fresh machine)                          up to 10 min
  graphcheck  issue 39: `scripts/graph_ops_gpu_check.py` (the kernels' replay bits, a site's rounds in one
           launch, the dependent launch, the idle costs), then the graph ops' part of the GPU suite in
           float32 for Llama with `test_graph_cache.py` (a cached graph's reuse)                about 3 min
  graph39-inproc  issue 39 in process: W2 with an ablation at every block on an engine with graph ops,
           compiled and graphed, against bare on it and plain vLLM's `LLM` (bound 1.03x); two
           compiled engine starts, one after the other                                           5-7 min
  pinpack  issue 39: `benchmarks/pinned_pack.py`, the graph plan's pack of a step's index lanes into pinned and
           pageable memory and the copy after it (torch alone: it runs before any chunk call)       under 1 min
  w12      issue 39: gpu_workloads.py's W1 and W2 (no ceiling, trace, transformers or W2g), 3 rounds,
           in this tree and in each `--tree`: "no slower than today"                              about 4 min a tree

On the lent machine, after the five chunk calls of `tests/GPU.md` (and, for an
earlier tree, ``git archive -o .gpu-trees/NAME.tar COMMIT`` here before the
call, so the file travels with the working tree)::

    bash .whl-gpu/install.sh && export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 && \\
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-gpu/serve/*.whl && \\
      python3 scripts/gpu_plan.py --out $OUT --parts control-taps --deadline 555
    ... python3 scripts/gpu_plan.py --out $OUT --parts w2 --deadline 555
    ... python3 scripts/gpu_plan.py --out $OUT --parts control --deadline 555   (.whl-gpu/serve installed too)
    ... python3 scripts/gpu_plan.py --out $OUT --parts graph39 --deadline 560   (.whl-gpu/serve installed and
        carried: hotwire's wheel travels in .whl-gpu/serve/hotwire, which the install's *.whl leaves out)
    ... python3 scripts/gpu_plan.py --out $OUT --parts graph39-every --deadline 560   (the next call, same machine)
    ... python3 scripts/gpu_plan.py --out $OUT --parts graph39-inproc,w12 --tree before=FILE.tar --deadline 560
    ... python3 scripts/gpu_suite.py --out $OUT/suite --gpus 0 --dtypes bfloat16 --parts alone --seconds 400

(the order the sixteenth session left: W2 ran on 2026-12-04 with a checkpoint tokenizer of the model's whole
vocabulary (RESULTS.md: 3.66x bare as written, 3.21x placed, 3.05x unchecked; raw nnsight 2.26x its own eager
bare), and `w2host` took it apart before and after that session's cuts (`--tree before=FILE.tar`, a `git archive`
made here with this tree's benchmark files copied in). The ablation at every block against that fair bare gave
1.153x over 5 rounds (bound 1.15): first `ablate` (12 rounds), then `w2host` after any further cut of the
per-invoke work, with `--tree` of the commit before it; in a call of its own, the lifecycle file, last passed on the H200
in the ninth session. `tests/vllm/test_trace_transport.py` and `tests/vllm/test_write_batch.py` passed on the
H200 (bfloat16) on 2026-12-04. A fresh machine needs the five chunk calls, then every call carries `.whl-gpu/deps`, `.whl-gpu/install.sh` and
`.whl-gpu/serve` (the server's own imports and py-spy, filled here by `scripts/fetch_serve_wheels.sh`); a call that
leaves `.whl-gpu/serve` out has no py-spy wheel.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
#: The 70B shape's engine on an 80 GB H100: its FP8 weights take 67.7 GiB, so a larger share and smaller steps.
H100_70B = ["--memory-fraction", "0.95", "--batched-tokens", "8192"]


def commands(out: Path, trees: dict[str, Path], deadline: float) -> dict[str, list[tuple[str, list[str], Path, int]]]:
    """Each part's runs: (label, command, working tree, limit in seconds)."""
    python = sys.executable
    remaining = int(deadline)
    return {
        "suite": [("suite", [python, "scripts/gpu_suite.py", "--out", str(out / "suite"), "--gpus", "0", "--slots",
                             "6", "--dtypes", "bfloat16", "--parts", "taps,alone", "--seconds", "330"], ROOT, 360)],
        "ablate": [(f"ablate ({name})", [python, "benchmarks/gpu_directions.py", "--only", "ablate", "--engines",
                                         "tapped", "--rounds", "12"], tree, 210)
                   for name, tree in {"this tree": ROOT, **trees}.items()],
        "w2": [("w2", [python, "benchmarks/gpu_trace.py", "--skip", "t,nnsight,patch"], ROOT, 560)],
        "profile": [("ablate profiled", [python, "benchmarks/gpu_directions.py", "--only", "ablate", "--engines",
                                         "tapped", "--rounds", "3", "--profile"], ROOT, 200),
                    ("w2 profiled", [python, "benchmarks/profile_trace.py", "--w2", "--taps", "--top", "30"], ROOT,
                     200)],
        "w2host": [("w2 host", [python, "benchmarks/w2_host.py", "--rounds", "2", "--out", str(out / "w2host"),
                                *(["--spy", "25"] if spied(out) else [])], ROOT, 330)]
        + [(f"w2 host ({name})", [python, "benchmarks/w2_host.py", "--rounds", "2", "--out", str(out / name)], tree,
            240) for name, tree in trees.items()],
        "xproc": [("xproc", [python, "benchmarks/gpu_trace.py", "--engine-process"], ROOT, 240)],
        # issue 42: a patch sweep over HTTP against in process; a direction from 100,000 prompts by moments
        "sweep": [("patch sweep", [python, "benchmarks/patch_sweep.py", "--shape", "llama3-8b"], ROOT, 420)],
        "moments": [("moments", [python, "benchmarks/moments.py", "--shape", "llama3-8b", "--prompts", "100000",
                                 "--rounds", "1"], ROOT, 560)],
        # issue 43: the SAE harvest at 70B in FP8 (6 blocks, every position) against bare prefill; then the 8B shape
        "harvest70b": [("humming stand-in", [python, "scripts/humming_stub.py", "/tmp/site"], ROOT, 30),
                       # 128 prompts: about 30 s a round at 70B, so 3 rounds of each fit one call with the engine's
                       # start; the Parquet and SAELens parts need Ray and SAELens carried (scripts/gpu_ray_wheels.sh)
                       ("harvest 70b", [python, "benchmarks/harvest_scale.py", "--shape", "70b", "--fp8", "--prompts",
                                        "128", "--length", "1024", "--rounds", "3", "--out", "/tmp/harvest-70b",
                                        "--skip", "parquet"], ROOT, 560)],
        # the Parquet tables through one Ray replica, and an SAE's steps on them (Ray and pyarrow installed first)
        "harvest70b-parquet": [("humming stand-in", [python, "scripts/humming_stub.py", "/tmp/site"], ROOT, 30),
                               ("harvest 70b, Parquet", [python, "benchmarks/harvest_scale.py", "--shape", "70b",
                                                         "--fp8", "--prompts", "128", "--length", "1024", "--out",
                                                         "/tmp/harvest-70b", "--skip", "rounds,saelens"], ROOT, 560)],
        # the same on an 80 GB H100 (weights 67.7 GiB): a larger share of its memory, half the tokens a step
        "harvest70b-h100": [("humming stand-in", [python, "scripts/humming_stub.py", "/tmp/site"], ROOT, 30),
                            ("harvest 70b on an H100", [python, "benchmarks/harvest_scale.py", "--shape", "70b", "--fp8",
                                                        "--prompts", "128", "--length", "1024", "--rounds", "3", "--out",
                                                        "/tmp/harvest-70b", "--skip", "parquet", *H100_70B], ROOT, 560)],
        "harvest70b-parquet-h100": [("humming stand-in", [python, "scripts/humming_stub.py", "/tmp/site"], ROOT, 30),
                                    ("harvest 70b, Parquet, on an H100", [
                                        python, "benchmarks/harvest_scale.py", "--shape", "70b", "--fp8", "--prompts",
                                        "128", "--length", "1024", "--out", "/tmp/harvest-70b", "--skip",
                                        "rounds,saelens", *H100_70B], ROOT, 330)],
        "harvest8b": [("harvest 8b", [python, "benchmarks/harvest_scale.py", "--shape", "8b", "--prompts", "256",
                                      "--length", "1024", "--rounds", "3", "--out", "/tmp/harvest-8b", "--skip",
                                      "parquet,saelens"], ROOT, 420)],
        "serve": [("serve", [python, "benchmarks/serve_load.py", "--shape", "llama3-8b", "--taps", "--host-time", "--prompts", "256",
                             "--logs", str(out / "serve-logs"),
                             "--rounds", "3", "--deadline", str(max(remaining - 40, 60))], ROOT, remaining)],
        "spy": [("spy", [python, "benchmarks/serve_load.py", "--shape", "llama3-8b", "--host-time", "--prompts", "256",
                         "--logs", str(out / "spy-logs"), "--rounds", "2", *spied(out / "spy"),
                         "--deadline", str(max(remaining - 40, 60))], ROOT, remaining)],
        # issue 39: the graph ops' server against plain vLLM serve (two groups of workloads, a call each; every
        # ratio within its own call), then in process; W1 and W2 as they were
        **{part: [(part, [python, "benchmarks/graph_serve.py", "--shape", "llama3-8b", "--only", group, "--rounds", "5",
                          "--work", "/tmp/graph39", "--logs", str(out / f"{part}-logs"),
                          "--deadline", str(max(remaining - 40, 60))], ROOT, remaining)]
           for part, group in (("graph39", "k-one"), ("graph39-every", "k-every"))},
        # the same two servers started once and stopped: their compile caches in /tmp/graph39, for the next call
        "graph39-warm": [("graph39 servers warmed", [python, "benchmarks/graph_serve.py", "--shape", "llama3-8b",
                                                     "--only", "plain,steer-one-", "--no-control", "--start-only",
                                                     "--work", "/tmp/graph39", "--logs", str(out / "graph39-warm-logs")],
                          ROOT, remaining)],
        "graph39-h100": [("graph39 on an H100", [python, "benchmarks/graph_serve.py", "--shape", "llama3-8b", "--only",
                                                 "plain,steer-one-", "--no-control", "--rounds", "5", "--work",
                                                 "/tmp/graph39", "--logs", str(out / "graph39-h100-logs"),
                                                 "--host-time", *spied(out / "graph39-h100-spy"),
                                                 "--deadline", str(max(remaining - 40, 60))], ROOT, remaining)],
        # the other group on an H100 (two servers): steers and an ablation at every block, the harvests
        "graph39-every-h100": [("graph39 every block on an H100", [
            python, "benchmarks/graph_serve.py", "--shape", "llama3-8b", "--only", "plain,steer-every-,ablate-,harvest-",
            "--no-control", "--rounds", "5", "--work", "/tmp/graph39", "--logs", str(out / "graph39-every-h100-logs"),
            "--host-time", "--deadline", str(max(remaining - 40, 60))], ROOT, remaining)],
        # one round and a profiled run of each kind: where a steered request's host time goes, and each stack at
        # which the streamscope engine's host waits for the device (in its log, graph39-spy-logs)
        "graph39-spy": [("graph39 profiled", [python, "benchmarks/graph_serve.py", "--shape", "llama3-8b", "--only",
                                              "plain,steer-one-1", "--no-control", "--rounds", "1", "--work",
                                              "/tmp/graph39", "--logs", str(out / "graph39-spy-logs"), "--host-time",
                                              "--sync-debug", *spied(out / "graph39-spy"),
                                              "--deadline", str(max(remaining - 40, 60))],
                         ROOT, remaining)],
        "graphcheck": [("graph ops check", [python, "scripts/graph_ops_gpu_check.py"], ROOT, 200),
                       ("graph ops, float32", [python, "scripts/gpu_suite.py", "--out", str(out / "suite"), "--gpus",
                                               "0", "--slots", "4", "--dtypes", "float32", "--parts", "graph",
                                               "--families", "llama", "--seconds", "200"], ROOT, 230)],
        "pinpack": [("the index's pack", [python, "benchmarks/pinned_pack.py"], ROOT, 60)],
        "graph39-inproc": [("graph39 in process", [python, "benchmarks/graph_serve.py", "--in-process", "--shape",
                                                   "llama3-8b", "--rounds", "5"], ROOT, 450)],
        "w12": [(f"w1 w2 ({name})", [python, "benchmarks/gpu_workloads.py", "--skip", "ceiling,trace,hf,w2g",
                                     "--rounds", "3"], tree, 300) for name, tree in {"this tree": ROOT, **trees}.items()],
        **{part: [(part, [python, "benchmarks/serve_load.py", "--shape", "llama3-8b", *flags, "--control",
                          "--host-time", "--prompts", "256", "--logs", str(out / f"{part}-logs"), "--rounds", "5",
                          "--deadline", str(max(remaining - 40, 60))], ROOT, remaining)]
           for part, flags in (("control", spied(out / "control-spy")), ("control-taps", ["--only-taps"]))},
    }


def spied(folder: Path) -> list[str]:
    """``--py-spy FOLDER`` for serve_load.py where py-spy can be had: on the path, or its wheel in the carried
    ``.whl-gpu/serve`` (its binary taken out of the wheel and put on the path: a ``pip install --target`` into
    /tmp/site leaves out a wheel's scripts once /tmp/site/bin exists). Each (server, workload) run is then
    profiled after the rounds."""
    if shutil.which("py-spy") is None:
        import stat
        import zipfile

        for wheel in sorted((ROOT / ".whl-gpu" / "serve").glob("py_spy-*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                member = next((name for name in archive.namelist() if name.endswith("/scripts/py-spy")), None)
                if member is None:
                    continue
                binary = Path(tempfile.mkdtemp(prefix="py-spy-")) / "py-spy"
                binary.write_bytes(archive.read(member))
            binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
            os.environ["PATH"] = os.pathsep.join([str(binary.parent), os.environ.get("PATH", "")])
            break
    return ["--py-spy", str(folder)] if shutil.which("py-spy") else []


def unpacked(trees: list[str], into: Path) -> dict[str, Path]:
    """Each ``NAME=TAR`` of `--tree` unpacked under `into` (a `git archive` of an earlier commit)."""
    found = {}
    for item in trees:
        name, _, archive = item.partition("=")
        if not name or not archive or not Path(archive).is_file():
            raise SystemExit(f"--tree {item!r}: give NAME=FILE.tar, a `git archive` made before the call")
        with tarfile.open(archive) as tar:
            tar.extractall(into / name, filter="data")
        found[name] = into / name
    return found


def run_part(label: str, command: list[str], tree: Path, limit: int, log: Path,
             say: Callable[[str], None]) -> tuple[str, float]:
    """Run one command in `tree` (on PYTHONPATH ahead of the installed packages), its output to `log`."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), *[
        entry for entry in environment.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != str(ROOT)]]))
    start = time.monotonic()
    with log.open("a") as handle:
        handle.write(f"\n### {label}: {' '.join(command)} (in {tree}, limit {limit} s)\n")
        handle.flush()
        try:
            code = subprocess.run(command, cwd=tree, env=environment, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=limit).returncode
            outcome = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            outcome = f"stopped at its limit ({limit} s)"
    seconds = time.monotonic() - start
    tail = log.read_text().splitlines()[-25:]
    say(f"--- {label}: {outcome} after {seconds:.0f} s; the log's last lines:\n" + "\n".join(tail))
    return outcome, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--parts", required=True, help="comma-separated: suite,ablate,w2,w2host,profile,xproc,serve,control,control-taps,spy,"
                                                 "graph39,graph39-every,graph39-inproc,w12")
    parser.add_argument("--tree", action="append", default=[], help="NAME=FILE.tar: ablate (and w2host, w12) in that tree too")
    parser.add_argument("--deadline", type=float, default=570.0, help="seconds from the start for every part")
    args = parser.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    plan = args.out / "plan.txt"

    def say(line: str) -> None:
        print(line, flush=True)
        with plan.open("a") as handle:
            handle.write(line + "\n")

    trees = unpacked(args.tree, Path(tempfile.mkdtemp(prefix="gpu-trees-")))
    every = commands(args.out, trees, args.deadline)
    wanted = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in wanted if part not in every]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}: the parts are {', '.join(every)}")
    for part in wanted:
        for label, command, tree, limit in every[part]:
            left = args.deadline - (time.monotonic() - started)
            if left < 30:
                say(f"--- {label}: not started, {left:.0f} s left before the deadline")
                continue
            run_part(label, command, tree, int(min(limit, left - 10)), args.out / f"{part}.log", say)
    say(f"plan done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
