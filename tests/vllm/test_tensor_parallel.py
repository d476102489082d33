"""Tensor parallelism: an engine over two ranks serves every value the one-rank engine serves, equal to it.

Each engine runs its ranks in processes of their own, started from
`tensor_parallel_run.py` (on the CPU one script process starts every case's
engines in turn; on GPUs one starts each engine). The per-head values (queries,
keys, values, head outputs, scores, pattern, head results: in a trace and
harvested) come back whole, every
rank's heads gathered in transformers' order, where each rank holds its own heads;
key/value heads that vLLM repeats on several ranks (more ranks than kv heads) come
back once each. Every value the client's support table lists is read, so the table
and the engine's ranks agree. An edit of the last head lands on the rank that holds
it, an edit of its result once over the ranks, and a skip on every rank. On the CPU both
runs are float32 and agree to float rounding; the GPU suite (tests/GPU.md) runs
this file on two GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import precision
from access import relative_error

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
SCRIPT = Path(__file__).with_name("tensor_parallel_run.py")
DTYPE = precision.DTYPE
#: On the CPU in float32 the ranks' partial sums are added in another order than one rank adds them (measured
#: up to 1e-6); on GPUs the kernels also tile otherwise (precision.GPU_ENGINE_TOLERANCE).
TOLERANCE = precision.GPU_ENGINE_TOLERANCE[DTYPE] if precision.ON_GPU else precision.CPU_FLOAT32

#: (family, checkpoint overrides): a fused block with two kv heads (one a rank), the same with one kv head
#: (repeated on both ranks), a whole-stream block, a mixture of experts (every expert for every token on a GPU:
#: the ranks' other sum order must not flip a routing choice), and a sandwich-normed block with soft caps (gemma2).
CASES = precision.selected({
    "llama": ("llama", {}),
    "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}),
    "gpt2": ("gpt2", {}),
    "mixtral": ("mixtral", precision.every_expert("mixtral") if precision.measured() else {}),
    "gemma2": ("gemma2", {}),
})


def _run(engines: list) -> list:
    """Each (checkpoint, ranks) engine's values, or the traceback it failed with: one script process starts them
    one after another, paying vLLM's imports (some 25 s on the CPU) once for all of them."""
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    run = subprocess.run([sys.executable, str(SCRIPT), PROMPT, DTYPE, *(f"{ranks}:{path}" for path, ranks in engines)],
                         env=environment, capture_output=True, text=True, timeout=900 * len(engines))
    lines = [line for line in run.stdout.splitlines() if line.startswith(("RESULT ", "FAILED "))]
    assert run.returncode == 0 and len(lines) == len(engines), run.stderr[-4000:]
    return [json.loads(line[len("RESULT "):]) for line in lines]


def _values(result, case: str, ranks: int) -> dict:
    assert isinstance(result, dict), f"{case} on {ranks} ranks failed:\n{result}"
    return {name: torch.tensor(value) for name, value in result.items()}


@pytest.fixture(scope="module")
def engines(checkpoints):
    """case -> (the one-rank engine's values, the two-rank engine's). On the CPU every case's engines run in one
    script process, all of them at the first case; on GPUs (tests/GPU.md) each case's two in a process each."""
    done: dict = {}

    def of(case: str):
        if case not in done:
            cases = list(CASES) if not precision.ON_GPU else [case]
            for name in cases:  # what the cases after this one say if the process fails (not run again)
                done[name] = f"the engines' script process failed at {case}'s setup"
            paths = {name: checkpoints(CASES[name][0], **CASES[name][1]) for name in cases}
            if precision.ON_GPU:
                results = _run([(paths[case], 1)]) + _run([(paths[case], 2)])
            else:
                results = _run([(paths[name], ranks) for ranks in (1, 2) for name in cases])
            for index, name in enumerate(cases):
                done[name] = (results[index], results[len(cases) + index])
        assert isinstance(done[case], tuple), done[case]
        single, split = done[case]
        return _values(single, case, 1), _values(split, case, 2)

    return of


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, engines):
    return engines(request.param)


def test_two_ranks_serve_every_value_of_one_rank_equal(runs):
    single, split = runs
    assert set(split) == set(single)
    per_head = [name for name in single if name.rsplit(".", 1)[-1] in
                ("queries", "keys", "values", "head_outputs", "scores", "pattern", "head_results")]
    assert per_head, "the checkpoint serves no attention internals"
    assert any(name.endswith(".head_results") for name in per_head) and "harvested head_results" in single
    # Each rank's columns of the row-parallel output and down projections, joined in rank order.
    assert any(name.endswith(".output projection") for name in single)
    assert any(name.endswith(".down projection") for name in single) == any(
        name.endswith(".mlp.neurons") for name in single)
    for name, expected in single.items():
        if name == "bundles received":  # a count per rank, not a value
            continue
        assert split[name].shape == expected.shape, (name, split[name].shape, expected.shape)
        finite = torch.isfinite(expected)
        assert torch.equal(finite, torch.isfinite(split[name])), name  # the same masked scores
        assert relative_error(split[name][finite], expected[finite]) <= TOLERANCE, name


def test_an_edit_and_a_skip_land_on_every_rank(runs):
    single, split = runs
    if "neurons edited logits" in single:  # the neurons' edits land in their ranks' shards (the gates' halves)
        assert not torch.allclose(single["neurons edited logits"], single["logits"])
        assert relative_error(split["neurons edited logits"], single["neurons edited logits"]) <= TOLERANCE
    if "head result edited logits" in single:  # the last head's result x10: its change added once over the ranks
        assert not torch.allclose(single["head result edited logits"], single["logits"])
        assert relative_error(split["head result edited logits"], single["head result edited logits"]) <= TOLERANCE
    assert not torch.allclose(single["edited logits"], single["logits"])
    assert not torch.allclose(single["skipped logits"], single["logits"])
    assert relative_error(split["edited logits"], single["edited logits"]) <= TOLERANCE
    assert relative_error(split["skipped logits"], single["skipped logits"]) <= TOLERANCE


def test_a_traces_invokes_reach_every_rank_in_one_bundle(runs):
    """Three invokes of one trace, pickled once together and sent to every rank ahead of the requests (each rank of
    the two-rank engine takes the bundle once; the one-rank engine's worker runs in its own process and takes it
    the same way): each invoke's edit gives the one-rank engine's logits."""
    single, split = runs
    assert single["bundles received"].tolist() == [1] and split["bundles received"].tolist() == [1, 1]
    edited = single["invokes' edited logits"]
    assert edited.shape[0] == 3 and not torch.allclose(edited[0], edited[1])
    assert relative_error(split["invokes' edited logits"], edited) <= TOLERANCE
