"""Misuse on the vLLM engine: the shared table of `tests/misuse.py` (the same exception types as on
transformers), 200 traces with failures, and eight invokes of one trace, one of them bad."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import precision
import streamscope
from access import relative_error
from misuse import *  # noqa: F401,F403  (the shared tests, collected here against this engine)
from misuse import Runner

PROMPTS = [
    "Once upon a time",
    "Rome is in Italy, Berlin is in Germany, Madrid is in Spain",
    "def add(a, b):",
    "Water boils at one hundred degrees Celsius at sea level, and",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the garden",
    "Numbers",
    "She opened the door, looked at the garden",
    "Attention heads move information between positions; the MLP writes features into the stream",
]
#: What each invoke does: read only, steer block 1's last position, skip block 1, or write a wrong shape.
PLAN = ["read", "edit", "skip", "read", "edit", "bad", "skip", "edit"]
#: Invokes batched together against the same prompt run alone, relative: bit-equal measured on CPU in
#: float32; 1e-6 leaves room for kernels whose blocking follows the batch's composition (GPU).
BATCHED = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE] if precision.ON_GPU else 1e-6


@pytest.fixture(scope="module")
def runner(checkpoints):
    model = streamscope.load(checkpoints("llama"), engine="vllm", **precision.engine_kwargs())
    yield Runner("vllm", model)
    model.close()


@pytest.fixture(scope="module")
def baseline(runner):
    return runner.baseline()


def intervene(model, kind: str, vector: torch.Tensor) -> torch.Tensor:
    """One invoke's work: its intervention on block 1, then block 2's last layer_mid and the logits, as one row."""
    if kind == "edit":
        stream = model.layers[1].layer_output
        stream[:, -1] += vector.to(device=stream.device, dtype=stream.dtype)
    elif kind == "skip":
        model.layers[1].skip(model.layers[1].layer_input)
    elif kind == "bad":
        model.layers[1].layer_mid = torch.zeros(1, 2, vector.shape[0])
    return torch.cat([model.layers[2].layer_mid[0, -1], model.logits[0]])


def test_eight_invokes_with_one_bad_write_each_equal_their_solo_runs(runner, baseline):
    model = runner.model
    vector = torch.linspace(-1.0, 1.0, model.hidden_size)
    alone = []
    for prompt, kind in zip(PROMPTS, PLAN):
        if kind == "bad":
            alone.append(None)
            continue
        with runner.trace(prompt):
            row = intervene(model, kind, vector).save()
        alone.append(row)

    with pytest.raises(ValueError) as raised:
        with model.trace(**runner.sampling) as tracer:
            rows = [None] * len(PROMPTS)
            rows.save()
            for index, (prompt, kind) in enumerate(zip(PROMPTS, PLAN)):
                with tracer.invoke(prompt):
                    rows[index] = intervene(model, kind, vector)
    message = str(raised.value)
    assert "model.layers[1].layer_mid cannot take a tensor of shape (1, 2, 64)" in message
    assert f"[invoke {PLAN.index('bad')} of this trace]" in message
    errors = {}
    for index, (row, solo) in enumerate(zip(rows, alone)):
        if solo is None:
            assert row is None  # the bad invoke failed alone
        else:
            errors[index] = relative_error(row, solo)
    print(f"eight invokes against their solo runs: largest relative error {max(errors.values()):.1e}")
    assert all(error <= BATCHED for error in errors.values()), errors
    with runner.trace(PROMPTS[1]):  # the steered invoke was steered
        unsteered = intervene(model, "read", vector).save()
    assert not torch.equal(alone[1], unsteered)
    runner.assert_unchanged(baseline)


SCRIPT = textwrap.dedent('''
    import json, sys, torch
    import streamscope
    from nnsight.intervention.interleaver import OutOfOrderError


    class ProbeFailed(Exception):
        pass


    def kinds(model, prompt):
        found = {}
        try:
            with model.trace(prompt, temperature=0.0, max_tokens=1):
                table = {"layer_mid": model.layers[1].layer_mid}
                table["layer_ouput"].save()
        except KeyError as error:
            found["key"] = ["KeyError", error.args[0]]
        try:
            with model.trace(prompt, temperature=0.0, max_tokens=1):
                if model.layers[1].layer_mid.abs().max() > 0:
                    raise ProbeFailed("nothing found")
        except ProbeFailed as error:
            found["own"] = ["ProbeFailed", str(error)]
        try:
            with model.trace(prompt, temperature=0.0, max_tokens=1):
                model.layers[1].layer_output.save()
                model.layers[0].layer_output.save()
        except OutOfOrderError as error:
            found["order"] = ["OutOfOrderError", str(error)]
        return found


    if __name__ == "__main__":
        model = streamscope.load(sys.argv[1], engine="vllm", **json.loads(sys.argv[3]))
        print("RESULT " + json.dumps(kinds(model, sys.argv[2])))
        model.close()
''')


def test_errors_keep_their_type_with_the_engine_in_its_own_processes(tmp_path, checkpoints):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 (the GPU layout): a user's own class comes home from another process."""
    script = tmp_path / "errors.py"
    script.write_text(SCRIPT)
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    run = subprocess.run([sys.executable, str(script), str(checkpoints("llama")), PROMPTS[1],
                          json.dumps(precision.engine_kwargs())], env=environment,
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT "):])
    assert found["key"] == ["KeyError", "layer_ouput"]
    assert found["own"] == ["ProbeFailed", "nothing found"]
    assert found["order"][1].startswith("model.layers[0].layer_output was read after model.layers[1].layer_output")
