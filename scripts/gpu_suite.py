"""The vLLM suite on a machine with GPUs, spread over its GPUs and several test processes per GPU.

`tests/GPU.md` gives the one command a run needs (pytest with
``STREAMSCOPE_TEST_DEVICE=cuda``); on the lent machine a device call lasts at
most ten minutes, so this script runs the same tests as many pytest processes
at once: one per family and dtype for the per-family files (the value x family
matrix and attention; the taps; the graph ops), one per dtype for each other
file, several to a GPU.
Engines on a GPU take a fixed KV cache there (`tests/precision.py`), so they
skip vLLM's free-memory profiling, which other processes on the same GPU would
upset. The lifecycle file (it measures the GPU's free memory) runs afterwards
with its GPU to itself, and the tensor-parallel file last, over two GPUs.

Each pytest process logs to its own file; at the end the script prints, and
writes to ``<out>/summary.txt``, the pass/fail/skip counts per dtype and family
or file, every failure's first lines, and each process's closest calls
(the matrix summary `tests/conftest.py` prints), and packs the logs into
``<out>/logs.tar.gz``.

    python scripts/gpu_suite.py --out $OUT --gpus 0,1 --slots 4 --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PER_FAMILY = ["tests/vllm/test_families.py", "tests/vllm/test_attention.py"]
SHARED = ["tests/vllm/test_engine.py", "tests/vllm/test_batching.py", "tests/vllm/test_misuse.py",
          "tests/vllm/test_bulk.py", "tests/vllm/test_workflows.py"]
ALONE = ["tests/vllm/test_lifecycle.py"]
TENSOR_PARALLEL = "tests/vllm/test_tensor_parallel.py"
TAPS = "tests/vllm/test_taps.py"  # per family: an eager and a tapped engine (CUDA graphs replayed)
#: per family: an engine with the graph ops, compiled with vLLM's default CUDA graphs, against the eager hook path
GRAPH = "tests/vllm/test_graph_families.py"
GRAPH_CACHE = "tests/vllm/test_graph_cache.py"  # once per dtype: compiled starts and vLLM's compile cache
OUTCOME = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


@dataclass
class Job:
    """One pytest process: its files, its dtype, the families it selects, and what it gave."""

    name: str
    dtype: str
    files: list[str]
    families: str = ""
    gpus: str = ""
    device: str = "cuda"
    multiprocessing: bool = False
    log: Path = Path()
    seconds: float = 0.0
    status: str = "not run"
    outcomes: dict[str, int] = field(default_factory=dict)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "console_output_style=classic",
                "-rfE", "--tb=short", *self.files]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(STREAMSCOPE_TEST_DEVICE=self.device, STREAMSCOPE_TEST_DTYPE=self.dtype, CUDA_VISIBLE_DEVICES=self.gpus,
                   PYTHONUNBUFFERED="1", STREAMSCOPE_TEST_FAMILIES=self.families)
        if not self.multiprocessing:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # dozens of engines a process: start each in it
        return env


def run_job(job: Job, deadline: float) -> None:
    job.log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with job.log.open("w") as log:
        process = subprocess.Popen(job.command(), cwd=ROOT, env=job.environment(), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            job.status = {0: "passed", 5: "nothing collected"}.get(code, f"exit {code}")
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            job.status = "cut at the deadline"
    job.seconds = time.monotonic() - start
    for line in job.log.read_text(errors="replace").splitlines():
        match = OUTCOME.match(line)
        if match:
            job.outcomes[match.group(2)] = job.outcomes.get(match.group(2), 0) + 1


def run_pool(jobs: list[Job], slots: list[str], deadline: float) -> None:
    """Run `jobs` in order, each on the next free slot (a GPU index, listed once per process it may hold)."""
    pending = list(jobs)
    lock = threading.Lock()

    def worker(gpu: str) -> None:
        while time.monotonic() < deadline:
            with lock:
                if not pending:
                    return
                job = pending.pop(0)
            job.gpus = job.gpus or gpu
            print(f"[{time.strftime('%H:%M:%S')}] start {job.name} on GPU {job.gpus}", flush=True)
            run_job(job, deadline)
            print(f"[{time.strftime('%H:%M:%S')}] {job.name}: {job.status}, {job.outcomes} in {job.seconds:.0f} s",
                  flush=True)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in slots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def failures(job: Job) -> list[str]:
    """The short test summary's lines of a job (FAILED/ERROR with their message)."""
    text = job.log.read_text(errors="replace") if job.log.exists() else ""
    return [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]


def closest_calls(job: Job) -> list[str]:
    text = job.log.read_text(errors="replace") if job.log.exists() else ""
    section = text.split("value x family: the value nearest its tolerance", 1)
    if len(section) < 2:
        return []
    lines = []
    for line in section[1].splitlines()[1:]:
        if line.startswith("="):
            break
        if line.strip():
            lines.append(line.strip())
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpus", default="0,1", help="GPU indices to use")
    parser.add_argument("--slots", type=int, default=4, help="pytest processes at once per GPU")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--families", default="", help="comma-separated; default every family")
    parser.add_argument("--parts", default="families,taps,graph,shared,alone,tp",
                        help="which parts to run: families (per-family files), taps (per family), graph (the graph "
                             "ops per family, and the compile cache), shared, alone, tp")
    parser.add_argument("--shared", default="", help="comma-separated file stems of the shared part (default all)")
    parser.add_argument("--tp-dtypes", default="", help="dtypes of the tensor-parallel part (default --dtypes)")
    parser.add_argument("--device", default="cuda", help="cpu: try the script itself here")
    parser.add_argument("--seconds", type=float, default=540, help="when to stop starting and cut running jobs")
    args = parser.parse_args()

    from streamscope.testing import FAMILIES

    start = time.monotonic()
    deadline = start + args.seconds
    gpus = args.gpus.split(",")
    dtypes = args.dtypes.split(",")
    parts = set(args.parts.split(","))
    families = args.families.split(",") if args.families else list(FAMILIES)
    logs = args.out / "logs"
    jobs: list[Job] = []
    if "families" in parts:
        # MoE and hybrid families take longest: start them first.
        slow = ("qwen3_next", "mixtral", "qwen3_moe", "llama4_text", "mamba", "gemma2", "gemma3_text")
        ordered = sorted(families, key=lambda family: (family not in slow, slow.index(family) if family in slow else 0))
        jobs += [Job(f"{dtype}-{family}", dtype, PER_FAMILY, families=family, log=logs / f"{dtype}-{family}.log")
                 for family in ordered for dtype in dtypes]
    if "taps" in parts:
        jobs += [Job(f"{dtype}-taps-{family}", dtype, [TAPS], families=family, log=logs / f"{dtype}-taps-{family}.log")
                 for family in families for dtype in dtypes]
    if "graph" in parts:
        jobs += [Job(f"{dtype}-graph-{family}", dtype, [GRAPH], families=family,
                     log=logs / f"{dtype}-graph-{family}.log") for family in families for dtype in dtypes]
        jobs += [Job(f"{dtype}-graph_cache", dtype, [GRAPH_CACHE], log=logs / f"{dtype}-graph_cache.log")
                 for dtype in dtypes]
    if "shared" in parts:
        jobs[:0] = [Job(f"{dtype}-{Path(file).stem}", dtype, [file], log=logs / f"{dtype}-{Path(file).stem}.log")
                    for file in SHARED for dtype in dtypes
                    if not args.shared or Path(file).stem.removeprefix("test_") in args.shared.split(",")]
    for job in jobs:
        job.device = args.device
    run_pool(jobs, [gpu for gpu in gpus for _ in range(args.slots)], deadline)
    if "alone" in parts:
        alone = [Job(f"{dtype}-{Path(file).stem}", dtype, [file], log=logs / f"{dtype}-{Path(file).stem}.log")
                 for file in ALONE for dtype in dtypes]
        run_pool(alone, gpus, deadline)
        jobs += alone
    if "tp" in parts and len(gpus) >= 2:
        tp = [Job(f"{dtype}-tensor_parallel", dtype, [TENSOR_PARALLEL], families="llama,gpt2,mixtral",
                  gpus=",".join(gpus[:2]), multiprocessing=True, log=logs / f"{dtype}-tensor_parallel.log")
              for dtype in sorted(args.tp_dtypes.split(",") if args.tp_dtypes else dtypes)]  # bfloat16 first
        run_pool(tp, ["tp"], deadline)
        jobs += tp

    lines = [f"gpu_suite: {len(jobs)} pytest processes, {time.monotonic() - start:.0f} s, GPUs {args.gpus} "
             f"x {args.slots}", ""]
    total: dict[str, int] = {}
    for job in jobs:
        for outcome, count in job.outcomes.items():
            total[outcome] = total.get(outcome, 0) + count
        counts = ", ".join(f"{count} {outcome.lower()}" for outcome, count in sorted(job.outcomes.items()))
        lines.append(f"{job.name:<34} {job.status:<20} {job.seconds:6.0f} s  {counts}")
    lines += ["", "total: " + ", ".join(f"{count} {outcome.lower()}" for outcome, count in sorted(total.items())), ""]
    for job in jobs:
        bad = failures(job)
        if bad:
            lines.append(f"--- {job.name}")
            lines += [line[:400] for line in bad]
    lines += ["", "closest calls (value x family, per process):"]
    for job in jobs:
        for line in closest_calls(job):
            lines.append(f"{job.dtype:<9} {line}")
    text = "\n".join(lines)
    print(text, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.txt").write_text(text + "\n")
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as archive:
        archive.add(logs, arcname="logs")
    import shutil

    shutil.rmtree(logs)  # only the two files come back


if __name__ == "__main__":
    main()
