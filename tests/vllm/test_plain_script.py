"""`streamscope.load(..., engine="vllm")` from a script file, run as a user runs it (issue 38, items 7 and 14).

A script without an ``if __name__ == "__main__":`` guard crashed on the CPU: vLLM spawned its engine process,
which ran the script again. Each case here is a real script file run by the venv's python in a fresh process,
with the suite's own ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` taken out of its environment (or set to 1, where vLLM
must start processes of its own). The script reads block 0's ``layer_output`` at the last position and prints
it; the oracle is transformers' float32 forward of the same checkpoint read with torch hooks (`oracle.py`).

The same runs check that a load is quiet: no vLLM INFO lines unless asked (``verbose=True``), warnings kept.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import oracle
import precision
from access import relative_error

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="each script starts an engine asking for vLLM's default 90% of the GPU beside the GPU "
                                "suite's engines; the spawn path is run here with VLLM_ENABLE_V1_MULTIPROCESSING=1")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The Eiffel Tower is in Paris"
#: vLLM's own log lines: ``(EngineCore pid=12) INFO 12-04 21:53:19 [core.py:133] ...``.
VLLM_LINE = re.compile(r"^\(\w+ pid=\d+\) (DEBUG|INFO|WARNING|ERROR) ", re.MULTILINE)

READ = """
with model.trace({prompt!r}, temperature=0.0, max_tokens=1):
    value = model.layers[0].layer_output[0, -1].save()
print("VALUE", json.dumps(value.tolist()))
"""

PLAIN = """import json
import streamscope

model = streamscope.load({path!r}, engine="vllm"{options})
""" + READ

GUARDED = """import json
import streamscope


def main():
    model = streamscope.load({path!r}, engine="vllm"{options})
""" + "".join(f"    {line}\n" if line else "\n" for line in READ.splitlines()) + """

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def expected(path):
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    return oracle.values(reference, "llama", ids)["layer_output"][0][0, -1]


def run_script(tmp_path, template: str, path: Path, multiprocessing: str | None, options: str = ""):
    script = tmp_path / "script.py"
    script.write_text(template.format(path=str(path), prompt=PROMPT, options=options))
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL")}
    environment["PYTHONPATH"] = str(ROOT)
    if multiprocessing is not None:
        environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env=environment, timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("VALUE ")]
    assert len(printed) == 1, output[-6000:]  # the script ran once: no process ran it again
    return torch.tensor(json.loads(printed[0][len("VALUE "):])), output


def levels(output: str) -> set[str]:
    return set(VLLM_LINE.findall(output))


def test_a_plain_script_loads_reads_and_exits_and_the_load_is_quiet(tmp_path, path, expected):
    value, output = run_script(tmp_path, PLAIN, path, multiprocessing=None)
    assert relative_error(value, expected) < precision.CPU_FLOAT32
    assert "INFO" not in levels(output), "vLLM's INFO lines printed by a default load"
    assert "WARNING" in levels(output), "vLLM's warnings must still show"


def test_a_guarded_script_still_runs_and_verbose_prints_vllms_log(tmp_path, path, expected):
    value, output = run_script(tmp_path, GUARDED, path, multiprocessing=None, options=", verbose=True")
    assert relative_error(value, expected) < precision.CPU_FLOAT32
    assert "INFO" in levels(output), "verbose=True prints vLLM's INFO lines"


def test_a_plain_script_runs_where_vllm_spawns_its_engine_process(tmp_path, path, expected):
    # VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine core and its worker are spawned processes (as on a GPU).
    value, output = run_script(tmp_path, PLAIN, path, multiprocessing="1")
    assert relative_error(value, expected) < precision.CPU_FLOAT32
    assert re.search(r"^\((EngineCore|Worker)\w* pid=\d+\)", output, re.MULTILINE), "no engine process started"
    assert "INFO" not in levels(output), "the engine's processes printed INFO lines"


def test_a_guarded_script_runs_where_vllm_spawns_its_engine_process(tmp_path, path, expected):
    value, _ = run_script(tmp_path, GUARDED, path, multiprocessing="1")
    assert relative_error(value, expected) < precision.CPU_FLOAT32
