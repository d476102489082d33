"""Every Python block of the README (and of any page under docs/) runs, as written, on each engine it names.

How a block runs is said by an HTML comment on the line before its fence (invisible on GitHub):

    <!-- readme-test: transformers, vllm -->      run it on both engines (or name one)
    <!-- readme-test: skip: the reason -->        do not run it, and say why

A Python block without such a comment fails `test_every_block_says_how_it_runs`, so a new example cannot
go untested by accident. Blocks under a heading named "Serving" (at any level) are skipped with that
reason: they need a running `streamscope serve` server, and the serving feature's own tests run them.

The blocks of a page run in order, one namespace per engine, as a reader would paste them into one session:
a later block uses the `model` an earlier one loaded. Before the first block each namespace holds what the
examples take as given (`prompt`, `prompts`, `steering_vector`/`vector`/`v` of the model's width, `clean`,
`corrupted`, `my_metric`, `paris_id`, `i`, `path`, `torch`, `streamscope`). The model is the tiny Llama
`build_checkpoint` writes, with a tokenizer trained on the examples' own strings, so that " Paris" is one
token as in a real model's vocabulary; paths under /tmp/ in a block are moved to the test's temporary folder,
and the blocks run there, in a folder per engine (files they write land in it). A vLLM engine a block replaces is closed.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ENGINES = ("transformers", "vllm")
SERVING = "Serving"
_DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
_HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")


@dataclass
class Block:
    page: Path
    line: int  # the fence's line, 1-based
    headings: list[str]
    code: str
    engines: tuple[str, ...] = ()
    skip: Optional[str] = None
    directive: Optional[str] = None
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's Python blocks, with their headings and what their directive says."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    headings: list[tuple[int, str]] = []
    fence: Optional[str] = None
    index = 0
    while index < len(lines):
        line = lines[index]
        if fence is None and line.startswith("```"):
            fence = line[3:].strip()
            start, body = index, []
            index += 1
            while index < len(lines) and not lines[index].startswith("```"):
                body.append(lines[index])
                index += 1
            if fence == "python":
                found.append(_block(page, start, [text for _, text in headings], "\n".join(body),
                                    lines[start - 1] if start else ""))
            fence = None
        else:
            heading = _HEADING.match(line)
            if heading:
                level = len(heading.group(1))
                headings = [(lvl, text) for lvl, text in headings if lvl < level] + [(level, heading.group(2))]
        index += 1
    return found


def _block(page: Path, start: int, headings: list[str], code: str, before: str) -> Block:
    block = Block(page, start + 1, headings, code)
    if any(heading.strip().lower() == SERVING.lower() for heading in headings):
        block.skip = (f"under the {SERVING!r} heading: these examples need a running `streamscope serve` "
                      f"server, and the serving feature's own tests run them")
        return block
    match = _DIRECTIVE.match(before.strip())
    if match is None:
        return block
    block.directive = match.group(1)
    if block.directive.startswith("skip:"):
        block.skip = block.directive[len("skip:"):].strip()
        if not block.skip:
            block.problems.append("a skip must say why")
        return block
    block.engines = tuple(word.strip() for word in block.directive.split(","))
    unknown = [engine for engine in block.engines if engine not in ENGINES]
    if unknown or not block.engines:
        block.problems.append(f"unknown engines {unknown}: name {', '.join(ENGINES)}")
    return block


ALL = [block for page in PAGES for block in blocks(page)]
RUNS = [(block, engine) for block in ALL for engine in (block.engines or ("transformers",))
        if not block.problems and block.directive is not None or block.skip is not None]


def test_every_block_says_how_it_runs():
    assert ALL, "no Python blocks found in the README"
    missing = [block.name for block in ALL if block.directive is None and block.skip is None]
    assert not missing, (f"Python blocks without a `<!-- readme-test: ENGINES -->` or `<!-- readme-test: skip: "
                         f"why -->` comment on the line before the fence: {missing}")
    broken = [(block.name, block.problems) for block in ALL if block.problems]
    assert not broken, broken


def test_the_runner_reads_directives_and_serving_headings(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n<!-- readme-test: transformers, vllm -->\n```python\nx = 1\n```\n\n"
                    "## Serving\n\n```python\nclient = 1\n```\n\n### Details\n\n```python\ny = 2\n```\n\n"
                    "## After\n\n<!-- readme-test: skip: needs a GPU -->\n```python\nz = 3\n```\n\n```python\nw = 4\n```\n")
    first, serving, nested, skipped, bare = blocks(page)
    assert first.engines == ENGINES and first.skip is None and first.code == "x = 1"
    assert serving.skip and "streamscope serve" in serving.skip and nested.skip == serving.skip
    assert skipped.skip == "needs a GPU" and skipped.engines == ()
    assert bare.directive is None and bare.skip is None


# Running the blocks.

#: The strings the examples' prompts and answers are made of: the tiny tokenizer learns them as tokens.
def _corpus() -> list[str]:
    strings = []
    for block in ALL:
        try:
            tree = ast.parse(block.code)
        except SyntaxError:
            continue
        strings += [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return strings + ["The Eiffel Tower is in Paris, the capital of France.", "Rome is the capital of Italy."]


class Session:
    """One namespace per engine, as a reader's session; engines closed at the end."""

    def __init__(self, folder: Path):
        import torch

        import streamscope
        from streamscope.testing import build_checkpoint
        from streamscope.testing.tokenizer import save_tokenizer

        self.folder = folder
        path = build_checkpoint("llama", folder / "tiny-llama")
        tokenizer = save_tokenizer(path, corpus=_corpus())
        hidden = 64
        torch.manual_seed(0)
        vector = torch.randn(hidden) * 0.1
        paris, rome = (tokenizer(word, add_special_tokens=False)["input_ids"] for word in (" Paris", " Rome"))
        assert len(paris) == len(rome) == 1, "the examples' answers should be one token each"
        given = {"torch": torch, "streamscope": streamscope, "path": path, "prompt": "The Eiffel Tower is in",
                 "prompts": ["The Eiffel Tower is in", "The capital of France is", "Rome is the capital of"],
                 "steering_vector": vector, "vector": vector, "v": vector, "i": 0,
                 "clean": "The capital of France is", "corrupted": "The capital of Italy is",
                 "paris_id": paris[0], "my_metric": lambda logits: logits[paris[0]] - logits[rome[0]]}
        self.spaces = {engine: dict(given) for engine in ENGINES}

    def run(self, block: Block, engine: str) -> None:
        space = self.spaces[engine]
        if engine == "vllm" and "model" not in space and "streamscope.load(" not in block.code:
            import streamscope

            space["model"] = streamscope.load(space["path"], engine="vllm")
        before = space.get("model")
        code = block.code.replace("/tmp/", f"{self.folder}/")
        # nnsight reads a trace's body back from its source file: the block runs from a file of its own.
        source = self.folder / f"{block.page.stem}_{block.line}_{engine}.py"
        source.write_text(code + "\n")
        # Each engine's session has a folder of its own for the files its blocks write (acts/, lens.png).
        workdir = self.folder / engine
        workdir.mkdir(exist_ok=True)
        os.chdir(workdir)
        exec(compile(code, str(source), "exec"), space)  # noqa: S102 - the README's own code
        after = space.get("model")
        if before is not None and after is not before and hasattr(before, "close"):
            before.close()

    def close(self) -> None:
        for space in self.spaces.values():
            model = space.get("model")
            if hasattr(model, "close"):
                model.close()


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    folder = tmp_path_factory.mktemp("readme")
    here = Path.cwd()
    os.chdir(folder)
    session = Session(folder)
    yield session
    session.close()
    os.chdir(here)


@pytest.mark.parametrize("block, engine", RUNS, ids=[f"{block.name}-{engine}" for block, engine in RUNS])
def test_block_runs_as_written(session: Any, block: Block, engine: str):
    if block.skip is not None:
        pytest.skip(block.skip)
    session.run(block, engine)
