"""Every Python block of the README (and of any page under docs/) runs, as written, on each engine it names.

How a block runs is said by an HTML comment on the line before its fence (invisible on GitHub):

    <!-- readme-test: transformers, vllm -->      run it on both engines (or name one)
    <!-- readme-test: skip: the reason -->        do not run it, and say why

A Python block without such a comment fails `test_every_block_says_how_it_runs`, so a new example cannot
go untested by accident. Blocks under a heading named "Serving" (at any level) are skipped with that
reason: they need a running `streamscope serve` server, and the serving feature's own tests run them.

The blocks run in the pages' order, one test and one namespace per engine, as a reader would paste them
into one session: a later block uses the `model` an earlier one loaded (one test per engine keeps that order
under pytest-xdist too). Before the first block each namespace holds what the
examples take as given (`prompt`, `prompts`, `steering_vector`/`vector`/`v` of the model's width, `clean`,
`corrupted`, `my_metric`, `paris_id`, `i`, `path`, `torch`, `streamscope`). The model is the tiny Llama
`build_checkpoint` writes, with a tokenizer trained on the examples' own strings, so that " Paris" is one
token as in a real model's vocabulary; paths under /tmp/ in a block are moved to the test's temporary folder,
and the blocks run there (files they write land in it). A vLLM engine a block replaces is closed.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

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
    """One engine's namespace, as a reader's session of the page; its engines closed at the end."""

    def __init__(self, folder: Path, engine: str):
        import torch

        import streamscope
        from streamscope.testing import build_checkpoint
        from streamscope.testing.tokenizer import save_tokenizer

        self.folder, self.engine = folder, engine
        path = build_checkpoint("llama", folder / "tiny-llama")
        tokenizer = save_tokenizer(path, corpus=_corpus())
        torch.manual_seed(0)
        vector = torch.randn(64) * 0.1  # the tiny Llama's width
        paris, rome = (tokenizer(word, add_special_tokens=False)["input_ids"] for word in (" Paris", " Rome"))
        assert len(paris) == len(rome) == 1, "the examples' answers should be one token each"
        self.space = {"torch": torch, "streamscope": streamscope, "path": path, "prompt": "The Eiffel Tower is in",
                      "prompts": ["The Eiffel Tower is in", "The capital of France is", "Rome is the capital of"],
                      "steering_vector": vector, "vector": vector, "v": vector, "i": 0,
                      "clean": "The capital of France is", "corrupted": "The capital of Italy is",
                      "paris_id": paris[0], "my_metric": lambda logits: logits[paris[0]] - logits[rome[0]]}

    def run(self, block: Block) -> None:
        space = self.space
        if self.engine == "vllm" and "model" not in space and "streamscope.load(" not in block.code:
            import streamscope

            space["model"] = streamscope.load(space["path"], engine="vllm")
        before = space.get("model")
        code = block.code.replace("/tmp/", f"{self.folder}/")
        # nnsight reads a trace's body back from its source file: the block runs from a file of its own.
        source = self.folder / f"{block.page.stem}_{block.line}_{self.engine}.py"
        source.write_text(code + "\n")
        os.chdir(self.folder)  # files the blocks write (acts/, lens.png) land in the session's folder
        exec(compile(code, str(source), "exec"), space)  # noqa: S102 - the README's own code
        after = space.get("model")
        if before is not None and after is not before and hasattr(before, "close"):
            before.close()

    def close(self) -> None:
        model = self.space.get("model")
        if hasattr(model, "close"):
            model.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_blocks_run_as_written_in_order(engine: str, tmp_path, monkeypatch):
    """One test per engine, so the blocks run in the page's order in one session (also under pytest-xdist)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    monkeypatch.chdir(tmp_path)
    runs = [block for block in ALL if block.skip is None and engine in block.engines]
    assert runs, f"no README block runs on {engine}"
    session = Session(tmp_path, engine)
    try:
        for block in runs:
            try:
                session.run(block)
            except Exception as error:
                raise AssertionError(f"{block.name} (under {' > '.join(block.headings)!r}) failed on {engine}: "
                                     f"{type(error).__name__}: {error}") from error
    finally:
        session.close()


@pytest.mark.parametrize("block", [block for block in ALL if block.skip is not None], ids=lambda block: block.name)
def test_skipped_blocks_say_why(block: Block):
    pytest.skip(block.skip)
