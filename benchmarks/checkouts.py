"""Checkouts side by side: the pieces `cpu_serve_plan.py` and `cpu_graph_step.py` share.

Each such benchmark times one piece of streamscope's host work in a child process for each checkout
(``--tree NAME=PATH``, the checkouts alternating round by round, one thread each) and prints the medians as a
table, a row a checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Sequence


def parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The options every such benchmark takes: the checkouts, the load's shape, the steps timed and the rounds."""
    options = argparse.ArgumentParser(description=description)
    options.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout (repeat)")
    options.add_argument("--requests", type=int, default=256)
    options.add_argument("--blocks", type=int, default=32)
    options.add_argument("--hidden", type=int, default=256)
    options.add_argument("--steps", type=int, default=steps)
    options.add_argument("--rounds", type=int, default=3)
    return options


def trees(args: argparse.Namespace) -> dict[str, str]:
    """The checkouts by name (this working directory where none is named)."""
    return dict(item.split("=", 1) for item in args.tree) or {"this": os.getcwd()}


def in_checkout(path: str, script: str, arguments: Sequence[str]) -> Any:
    """What `script` prints last (JSON), run with `arguments` on the checkout at `path`, one thread."""
    environment = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    output = subprocess.run([sys.executable, script, *arguments], env=environment, check=True, capture_output=True,
                            text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def print_table(columns: Sequence[str], results: dict[tuple[str, str], list[float]], names: Sequence[str]) -> None:
    """The median of each checkout's values in each column, as a Markdown table."""
    print("| tree | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{statistics.median(results[(name, column)]):.0f}" for column in columns)
              + " |")
