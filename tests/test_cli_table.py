"""The `streamscope` command's parser is a table (`streamscope.cli_table`): reading it imports nothing heavy.

`streamscope --help`, a command's ``--help`` and the refusal of a wrong argument run in a fresh interpreter here,
which then lists the heavy libraries it has loaded: none of torch, transformers, nnsight or vLLM may be among
them (each takes a second or more to import; before the table, ``--help`` took 5 s and more). Each command's
function, named in the table by its module path, is found where the table says.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamscope import cli
from streamscope.cli_table import COMMANDS, implementation, indices, token

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "nnsight", "vllm", "ray", "anyio")


def run_and_list_heavy(argv: list[str]) -> tuple[int, str, list[str]]:
    """`streamscope.cli.main(argv)` in a fresh interpreter: its exit status, what it printed, the heavy modules
    it had loaded when it ended."""
    code = ("import json, sys\n"
            "from streamscope.cli import main\n"
            "try:\n"
            f"    status = main({argv!r})\n"
            "except SystemExit as exit:\n"
            "    status = exit.code\n"
            f"heavy = sorted(name for name in {HEAVY!r} if name in sys.modules)\n"
            "print(json.dumps([status, heavy]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    status, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    return status, done.stdout + done.stderr, heavy


@pytest.mark.parametrize("argv, status", [
    (["--help"], 0),
    (["lens", "--help"], 0),
    (["harvest", "--help"], 0),
    (["patch", "folder", "--clean", "a"], 2),  # --corrupted, --answer and --wrong missing
    (["lens", "folder", "prompt", "--layers", "1-x"], 2),
    (["map", "folder", "--engine", "tensorflow"], 2),
    (["nonesuch"], 2),
])
def test_help_and_refused_arguments_load_nothing_heavy(argv, status):
    code, printed, heavy = run_and_list_heavy(argv)
    assert code == status, printed
    assert heavy == [], f"streamscope {' '.join(argv)} imported {heavy}"
    if argv == ["--help"]:
        assert all(f"    {name}" in printed for name in COMMANDS)
    elif status == 2:
        assert "error:" in printed


def test_the_parser_lists_the_table():
    subparsers = next(action for action in cli.parser()._actions if action.dest == "command")
    assert list(subparsers.choices) == list(COMMANDS)
    for name, command in COMMANDS.items():
        assert subparsers.choices[name].description == command.help


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_runs_the_function_the_table_names(name):
    runs = implementation(COMMANDS[name].runs)
    assert callable(runs) and runs.__name__ == COMMANDS[name].runs.split(":")[1]
    assert runs.__module__ == COMMANDS[name].runs.split(":")[0]


def test_the_dispatch_calls_the_named_function_with_the_parsed_arguments(monkeypatch, tmp_path):
    seen: list[argparse.Namespace] = []

    def command_lens(arguments: argparse.Namespace) -> int:
        seen.append(arguments)
        return 7

    monkeypatch.setattr(cli, "command_lens", command_lens)
    assert cli.main(["lens", str(tmp_path), "a prompt", "--layers", "0,2-3", "--top-k", "2"]) == 7
    (arguments,) = seen
    assert arguments.path == str(tmp_path) and arguments.prompt == "a prompt"
    assert arguments.layers == [0, 2, 3] and arguments.top_k == 2 and arguments.engine == "transformers"


def test_an_unnamed_implementation_is_refused():
    for wrong in ("streamscope.cli", "streamscope.cli:", ":main"):
        with pytest.raises(ValueError, match="'package.module:attribute'"):
            implementation(wrong)


def test_the_argument_types():
    assert indices("0,2,5-8") == [0, 2, 5, 6, 7, 8] and indices("-1") == [-1] and indices("-3--1") == [-3, -2, -1]
    with pytest.raises(argparse.ArgumentTypeError, match="0,2,5-8"):
        indices("a")
    assert token("42") == 42 and token("-1") == -1 and token(" Paris") == " Paris"
